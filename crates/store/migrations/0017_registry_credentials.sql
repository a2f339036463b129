-- A tenant's logins to container registries, one per registry host.
-- `secret_sealed` is the password or token encrypted with the server's
-- secrets key (AES-256-GCM; `v1:` + hex of nonce and ciphertext), bound to
-- the row's tenant, registry and user name so a sealed value copied into
-- another row does not open. The plaintext is never stored.
CREATE TABLE registry_credentials (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    registry TEXT NOT NULL,
    username TEXT NOT NULL,
    secret_sealed TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    UNIQUE (tenant_id, registry)
);
