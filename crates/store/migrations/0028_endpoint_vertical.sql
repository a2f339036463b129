-- Endpoints that opted into automatic vertical moves: the GPU classes the
-- autoscaler may move their replicas between, and how long a
-- recommendation must hold. A move is rolled out as a new revision of the
-- endpoint (its gpu_types changed); the last one is kept for operators.
CREATE TABLE endpoint_vertical (
    endpoint_id TEXT PRIMARY KEY REFERENCES endpoints (id),
    classes TEXT NOT NULL,
    sustain_ms BIGINT NOT NULL,
    opted_at BIGINT NOT NULL,
    last_move TEXT,
    moved_at BIGINT
);
