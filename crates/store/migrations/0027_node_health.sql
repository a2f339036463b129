-- GPU health and node events. A GPU with a fault (an XID or ECC error, over
-- temperature, as the server judged its agent's telemetry) takes no new
-- work until an operator resets it; work already on it keeps running.
ALTER TABLE gpus ADD COLUMN fault TEXT;
ALTER TABLE gpus ADD COLUMN fault_at BIGINT;

-- What happened to a node or its GPUs, for operators: faults, resets,
-- cordons, drains, unreachability. Append-only, numbered per node.
CREATE TABLE node_events (
    node_id TEXT NOT NULL REFERENCES nodes (id),
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    gpu_id TEXT,
    message TEXT NOT NULL,
    at BIGINT NOT NULL,
    PRIMARY KEY (node_id, seq)
);
