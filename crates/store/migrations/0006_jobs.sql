-- Jobs: batch and training work run by a gang of instances. The job row
-- holds the spec (as JSON: it is read whole, never queried into) and the
-- state derived from its members; `attempt` counts placements of the
-- gang, `failures` the attempts that failed (against max_retries).
-- Columns the scheduler and quotas query (tenant, state, gpus,
-- gpu_types, priority, tier) repeat the spec's values.
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    state TEXT NOT NULL,
    state_reason TEXT NOT NULL,
    spec TEXT NOT NULL,
    gpus BIGINT NOT NULL,
    nodes BIGINT NOT NULL,
    gpu_types TEXT NOT NULL,
    priority BIGINT NOT NULL,
    tier BIGINT NOT NULL,
    attempt BIGINT NOT NULL DEFAULT 0,
    failures BIGINT NOT NULL DEFAULT 0,
    cancel_requested BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    started_at BIGINT,
    finished_at BIGINT
);
CREATE INDEX jobs_tenant ON jobs (tenant_id, id);
CREATE INDEX jobs_state ON jobs (state);

CREATE TABLE job_events (
    job_id TEXT NOT NULL REFERENCES jobs (id),
    seq BIGINT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at BIGINT NOT NULL,
    PRIMARY KEY (job_id, seq)
);

-- Members: an instance belongs to at most one job, as one rank of one
-- attempt. NULL for plain instances.
ALTER TABLE instances ADD COLUMN job_id TEXT;
ALTER TABLE instances ADD COLUMN job_rank BIGINT;
ALTER TABLE instances ADD COLUMN job_attempt BIGINT;
CREATE INDEX instances_job ON instances (job_id, job_attempt);

-- Sharing: GPUs guaranteed to a tenant (its work within them may reclaim
-- capacity others borrowed) and its fair-share weight; NULL: none / 1.
ALTER TABLE tenants ADD COLUMN quota_gpus_guaranteed BIGINT;
ALTER TABLE tenants ADD COLUMN fair_share_weight BIGINT;
