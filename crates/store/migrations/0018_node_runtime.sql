-- How each node's agent runs workloads: sandboxed processes or containers.
-- Placement sends an instance with an image only to `container` nodes and
-- one without only to `process` nodes. Nodes registered before agents said
-- so ran processes (the only runtime there was), hence the default.
ALTER TABLE nodes ADD COLUMN runtime TEXT NOT NULL DEFAULT 'process'
    CHECK (runtime IN ('process', 'container'));
