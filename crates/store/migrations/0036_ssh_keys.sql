-- A tenant's registered SSH public keys (`flotilla ssh-keys`): the server's
-- SSH endpoint (`flotilla ssh`) lets in a client that proves it holds the
-- private half of one of its instance's tenant's keys. Public halves only.
-- `public_key` is `ALGORITHM BASE64` without the comment; `fingerprint` is
-- OpenSSH's `SHA256:…`, unique per tenant (one key registered twice would
-- only make removing it confusing).
CREATE TABLE ssh_keys (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    name TEXT NOT NULL,
    algorithm TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    public_key TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    UNIQUE (tenant_id, fingerprint)
);
