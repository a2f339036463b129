-- Named leases with fencing tokens: `leader` says which server replica runs
-- the control loops. `token` grows by one whenever the lease changes hands
-- (or is taken again after it ran out), never otherwise, so a write made
-- under an older token can be recognised and refused. Times are UTC
-- milliseconds, like every other column.
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    acquired_at BIGINT NOT NULL
);
