-- Node pools grown and shrunk through a capacity provider (a cloud API,
-- the simulated cloud, local agent processes).
--
-- `pool_machines`: every machine a pool asked a provider for, by the node
-- name its agent registers under. `booting` until a node of that name
-- joins the pool, `joined` while it serves, `draining` while it is being
-- given back (cordoned), then `terminated`; `failed` when the provider
-- could not build it. `idle_since` is set while the joined node runs
-- nothing, so the idle timeout survives a leader change. Times are UTC
-- milliseconds, like every other column.
CREATE TABLE pool_machines (
    name TEXT PRIMARY KEY,
    pool TEXT NOT NULL,
    provider TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    machine_id TEXT,
    state TEXT NOT NULL
        CHECK (state IN ('booting', 'joined', 'draining', 'terminated', 'failed')),
    reason TEXT,
    node_id TEXT,
    created_at BIGINT NOT NULL,
    joined_at BIGINT,
    idle_since BIGINT,
    ended_at BIGINT
);
CREATE INDEX pool_machines_pool ON pool_machines (pool, state);

-- One-time join tokens: a new machine's agent trades its token for an
-- agent key once (`POST /v1/agent/join`). Only the SHA-256 of the token is
-- kept. A token is refused once used or past `expires_at`.
CREATE TABLE join_tokens (
    token_hash TEXT PRIMARY KEY,
    pool TEXT NOT NULL,
    machine TEXT NOT NULL REFERENCES pool_machines (name),
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at BIGINT,
    key_id TEXT
);
CREATE INDEX join_tokens_machine ON join_tokens (machine);
