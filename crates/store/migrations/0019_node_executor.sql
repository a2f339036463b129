-- Which engine runs each node's work: Flotilla's own agent, or a cluster
-- engine (Slurm, Kubernetes) whose nodes an executor bridge registers.
-- Every node registered before bridges existed ran the agent.
ALTER TABLE nodes ADD COLUMN executor TEXT NOT NULL DEFAULT 'agent'
    CHECK (executor IN ('agent', 'slurm', 'kubernetes'));
