-- Replica pools: instances of one template whose count an autoscaling
-- policy (crates/scale) sets from metrics reported through the API.
-- `spec` is the CreateReplicaPool body as JSON; `metrics` the last
-- PoolMetrics report. The policy's state lives in the server's loop; the
-- last decision is kept here so the API can show it.
CREATE TABLE replica_pools (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    desired BIGINT,
    reason TEXT,
    metrics TEXT,
    metrics_at BIGINT,
    created_at BIGINT NOT NULL
);
CREATE INDEX replica_pools_tenant ON replica_pools (tenant_id);

-- The instances a pool started for its replicas.
CREATE TABLE replica_pool_members (
    pool_id TEXT NOT NULL REFERENCES replica_pools(id),
    instance_id TEXT NOT NULL REFERENCES instances(id),
    created_at BIGINT NOT NULL,
    PRIMARY KEY (pool_id, instance_id)
);
