-- The audit log: one row per authenticated mutating API call (POST, PUT,
-- PATCH, DELETE), whatever its result. Append-only: nothing updates or
-- deletes a row. No foreign keys: the log must take a row even for a call
-- naming an object that does not exist, and must outlive what it names.
-- `id` is `aud_` + a ULID, so it sorts by time; pages run newest first.
CREATE TABLE audit_log (
    id TEXT PRIMARY KEY,
    at BIGINT NOT NULL,
    key_id TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    method TEXT NOT NULL,
    route TEXT NOT NULL,
    object_id TEXT,
    status INTEGER NOT NULL,
    request_id TEXT
);

-- A tenant reads its own entries, newest first.
CREATE INDEX audit_log_tenant ON audit_log (tenant_id, id);
