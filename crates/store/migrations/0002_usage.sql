-- The append-only usage ledger (flotilla-billing's `UsageEvent`). Rows are
-- never updated or deleted: a duplicate send hits the key and changes
-- nothing, a correction is a new row naming the one it voids. The key
-- (tenant, source, event id) is what makes ingestion exactly-once across
-- crashes: a sender re-sends everything and the key absorbs what was
-- already committed.
CREATE TABLE usage_events (
    tenant_id TEXT NOT NULL,
    source TEXT NOT NULL,
    event_id TEXT NOT NULL,
    subject_kind TEXT NOT NULL,
    subject_id TEXT NOT NULL,
    -- The meter's kind (`gpu_seconds`, `requests`, …) and the whole meter
    -- as JSON; `model` and `share_units` repeat the GPU meter's detail as
    -- columns so that rating can aggregate in SQL ('' and 0 otherwise).
    meter TEXT NOT NULL,
    meter_detail TEXT NOT NULL,
    model TEXT NOT NULL,
    share_units BIGINT NOT NULL,
    billing_class TEXT NOT NULL,
    start_ms BIGINT NOT NULL,
    end_ms BIGINT NOT NULL,
    -- The exact decimal as text; `amount_int` is the same value when it is
    -- a whole number (every GPU and instance meter), so SQL can sum it
    -- exactly (SQLite would sum text as floating point).
    amount TEXT NOT NULL,
    amount_int BIGINT,
    node_id TEXT,
    -- The event this one voids (same tenant), if it is a correction.
    corrects_source TEXT,
    corrects_id TEXT,
    received_at BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, source, event_id)
);
-- Rating reads one tenant's events by time.
CREATE INDEX usage_events_tenant_end ON usage_events (tenant_id, end_ms);
