-- Model weights each node holds for endpoint replicas, as its agent last
-- reported them: on its disk (`cached`, one row per weights key, `replica`
-- empty) or as a parked replica in host memory (`parked`, one row per
-- replica, with the endpoint whose tenant pays for the memory). `since` is
-- when it was parked, or last used on disk. Replaced as a whole when the
-- agent reports a change; placement reads it to start a replica where it
-- is ready soonest, and a parked row that goes away is metered.
CREATE TABLE node_weights (
    node_id TEXT NOT NULL REFERENCES nodes (id),
    tier TEXT NOT NULL,
    weights_key TEXT NOT NULL,
    replica TEXT NOT NULL,
    endpoint_id TEXT,
    size_bytes BIGINT NOT NULL,
    since BIGINT NOT NULL,
    reported_at BIGINT NOT NULL,
    PRIMARY KEY (node_id, tier, weights_key, replica)
);
CREATE INDEX node_weights_key ON node_weights (weights_key);
