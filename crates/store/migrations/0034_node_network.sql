-- How each node's agent isolates its workloads' network, as it last
-- registered it (JSON: isolated, detail, allow_egress); NULL for agents
-- that did not say. Shown by `flotilla nodes show`.
ALTER TABLE nodes ADD COLUMN network TEXT;
