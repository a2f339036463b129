-- A counter per tenant that every usage append which records new events
-- for the tenant bumps, in the same transaction as the events: budget
-- checks compare it with what they saw last time and rate only tenants
-- whose usage changed, whichever server (or replica) ingested it. No
-- backfill: a server rates every budget on its first check anyway.
CREATE TABLE usage_marks (
    tenant_id TEXT PRIMARY KEY,
    appended BIGINT NOT NULL
);
