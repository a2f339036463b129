-- Each node's image cache, as its agent last reported it: one row per
-- image reference. Replaced as a whole when the agent reports a change.
-- `last_used_at` is NULL for an image no instance started from yet.
CREATE TABLE node_images (
    node_id TEXT NOT NULL REFERENCES nodes (id),
    image TEXT NOT NULL,
    image_id TEXT NOT NULL,
    size_bytes BIGINT NOT NULL,
    last_used_at BIGINT,
    reported_at BIGINT NOT NULL,
    PRIMARY KEY (node_id, image)
);
