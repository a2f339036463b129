-- Serverless endpoints: a replica template (`spec`, the validated
-- EndpointSpec as JSON) at a `revision`, scaled by the autoscaler from the
-- gateway's demand signals (`signals`, the last EndpointSignals as JSON) and
-- custom metrics. The policy's state lives in the server's loop; its last
-- decision is kept so the API can show it. A deleted endpoint keeps its row
-- (`deleted_at`) until its replicas have stopped; its name is free at once.
CREATE TABLE endpoints (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    revision BIGINT NOT NULL,
    desired BIGINT,
    reason TEXT,
    signals TEXT,
    custom_metric TEXT,
    last_request_at BIGINT NOT NULL,
    deleted_at BIGINT,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE UNIQUE INDEX endpoints_name ON endpoints (tenant_id, name) WHERE deleted_at IS NULL;

-- Replicas: instances started for an endpoint, with the revision they run,
-- the port given them in `PORT`, when their readiness probe first passed
-- (then they enter the gateway's route table) and when they were taken out
-- of rotation to drain before being stopped.
CREATE TABLE endpoint_replicas (
    instance_id TEXT PRIMARY KEY REFERENCES instances (id),
    endpoint_id TEXT NOT NULL REFERENCES endpoints (id),
    revision BIGINT NOT NULL,
    port BIGINT NOT NULL,
    ready_at BIGINT,
    draining_at BIGINT,
    created_at BIGINT NOT NULL
);
CREATE INDEX endpoint_replicas_endpoint ON endpoint_replicas (endpoint_id);

-- Inference keys: a JSON list of endpoint ids the key may call through the
-- gateway (`[]`: every endpoint of its tenant). NULL for API keys. An
-- inference key cannot call the management API.
ALTER TABLE api_keys ADD COLUMN endpoints TEXT;
