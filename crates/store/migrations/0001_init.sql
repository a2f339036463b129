-- Flotilla's schema, portable between SQLite and PostgreSQL: text ids,
-- BIGINT for every number, booleans and times (times are UTC milliseconds
-- since the epoch), JSON as TEXT. The same file runs on both backends.

CREATE TABLE tenants (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    quota_gpus_total BIGINT,
    quota_gpus_per_model TEXT NOT NULL DEFAULT '{}',
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, id);

CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    owner_tenant_id TEXT NOT NULL REFERENCES tenants (id),
    region TEXT NOT NULL,
    pool TEXT NOT NULL,
    state TEXT NOT NULL,
    cordoned BIGINT NOT NULL DEFAULT 0,
    simulated BIGINT NOT NULL,
    cpu_milli BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    agent_version TEXT NOT NULL,
    last_heartbeat_at BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE instances (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    name TEXT,
    state TEXT NOT NULL,
    state_reason TEXT NOT NULL,
    gpus BIGINT NOT NULL,
    gpu_types TEXT NOT NULL,
    cpu_milli BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    command TEXT NOT NULL,
    env TEXT NOT NULL,
    workdir TEXT,
    billing_class TEXT NOT NULL,
    node_id TEXT REFERENCES nodes (id),
    gpu_model TEXT,
    gpu_ids TEXT NOT NULL DEFAULT '[]',
    exit_code BIGINT,
    stop_requested BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    started_at BIGINT,
    finished_at BIGINT
);
CREATE INDEX instances_tenant ON instances (tenant_id, id);
CREATE INDEX instances_state ON instances (state);
CREATE INDEX instances_node ON instances (node_id);

-- A GPU is free exactly when instance_id is NULL. Allocation is a
-- conditional UPDATE (`WHERE instance_id IS NULL`), so two placements can
-- never both take the same GPU, whatever the number of server replicas.
CREATE TABLE gpus (
    id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL REFERENCES nodes (id),
    idx BIGINT NOT NULL,
    model TEXT NOT NULL,
    uuid TEXT NOT NULL,
    memory_mib BIGINT NOT NULL,
    instance_id TEXT REFERENCES instances (id),
    UNIQUE (node_id, idx)
);
CREATE INDEX gpus_instance ON gpus (instance_id);

CREATE TABLE instance_events (
    instance_id TEXT NOT NULL REFERENCES instances (id),
    seq BIGINT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at BIGINT NOT NULL,
    PRIMARY KEY (instance_id, seq)
);

CREATE TABLE instance_logs (
    instance_id TEXT NOT NULL REFERENCES instances (id),
    seq BIGINT NOT NULL,
    stream TEXT NOT NULL,
    at BIGINT NOT NULL,
    line TEXT NOT NULL,
    PRIMARY KEY (instance_id, seq)
);

-- Responses of create requests, replayed for a repeated Idempotency-Key.
-- status is NULL while the first request is still being handled.
CREATE TABLE idempotency_keys (
    scope TEXT NOT NULL,
    idem_key TEXT NOT NULL,
    request_hash TEXT NOT NULL,
    status BIGINT,
    response TEXT,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (scope, idem_key)
);
