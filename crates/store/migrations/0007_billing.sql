-- Billing state beside the usage ledger: the versioned price catalog and
-- the recorded spot price series (every charge names the version or point
-- that priced it), per-tenant commitments, discounts and credit grants,
-- finalised invoices (immutable rows), budgets with their alerts and
-- webhook deliveries, and the providers that own nodes.
--
-- Decimals are stored as their exact text (SQLite has no exact decimal
-- type); whole structures as JSON text, with the columns queries filter on
-- repeated beside them.

-- One row per published catalog version; rows are never updated. The
-- primary key on `version` makes two operators publishing at once a
-- conflict, never two versions with the same number.
CREATE TABLE price_versions (
    version BIGINT PRIMARY KEY,
    effective_from BIGINT NOT NULL,
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL
);

-- The spot price series: a point is in force from `at_ms` until the
-- model's next point.
CREATE TABLE spot_points (
    model TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    utilisation TEXT NOT NULL,
    per_gpu_second TEXT NOT NULL,
    price_version BIGINT NOT NULL,
    PRIMARY KEY (model, at_ms)
);

-- Reserved commitments, discounts and credit grants of a tenant
-- (flotilla-billing's `Commitment`, `Discount`, `CreditGrant` as JSON).
CREATE TABLE commitments (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX commitments_tenant ON commitments (tenant_id);

CREATE TABLE discounts (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX discounts_tenant ON discounts (tenant_id);

CREATE TABLE credit_grants (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX credit_grants_tenant ON credit_grants (tenant_id);

-- Finalised invoices. `body` is the invoice's serialised form, written
-- once: no statement of the store updates or deletes a row. One invoice per
-- tenant and period.
CREATE TABLE invoices (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    period_start BIGINT NOT NULL,
    period_end BIGINT NOT NULL,
    total TEXT NOT NULL,
    currency TEXT NOT NULL,
    body TEXT NOT NULL,
    finalised_at BIGINT NOT NULL,
    UNIQUE (tenant_id, period_start)
);

-- What each finalised invoice drew from each credit grant, written in the
-- same transaction as the invoice: the next invoice draws only the rest.
CREATE TABLE credit_draws (
    invoice_id TEXT NOT NULL REFERENCES invoices (id),
    grant_id TEXT NOT NULL REFERENCES credit_grants (id),
    amount TEXT NOT NULL,
    PRIMARY KEY (invoice_id, grant_id)
);

-- A tenant's budget (flotilla-billing's `Budget` as JSON) and where its
-- alerts go. The webhook secret signs deliveries; it is never read back
-- through the API.
CREATE TABLE budgets (
    tenant_id TEXT PRIMARY KEY REFERENCES tenants (id),
    body TEXT NOT NULL,
    webhook_url TEXT,
    webhook_secret TEXT,
    updated_at BIGINT NOT NULL
);

-- Thresholds crossed, once per tenant, period and threshold (the key makes
-- an alert fire once across restarts and server replicas).
CREATE TABLE budget_alerts (
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    period_start BIGINT NOT NULL,
    threshold BIGINT NOT NULL,
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, period_start, threshold)
);

-- The webhook delivery log: one row per alert to deliver, retried with
-- backoff until delivered or out of attempts.
CREATE TABLE webhook_deliveries (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants (id),
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts BIGINT NOT NULL,
    next_attempt_at BIGINT NOT NULL,
    last_status BIGINT,
    last_error TEXT,
    delivered_at BIGINT,
    created_at BIGINT NOT NULL
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_attempt_at);
CREATE INDEX webhook_deliveries_tenant ON webhook_deliveries (tenant_id, id);

-- Marketplace: a provider is a tenant offering machines; nodes it
-- registered carry its id, and are paid out for the usage they carried.
CREATE TABLE providers (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL UNIQUE REFERENCES tenants (id),
    created_at BIGINT NOT NULL
);
ALTER TABLE nodes ADD COLUMN provider_id TEXT REFERENCES providers (id);
