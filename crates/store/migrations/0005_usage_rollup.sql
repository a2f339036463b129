-- Usage summed at ingestion, so that rating a tenant's period reads a few
-- rows instead of every event (see `Store::usage_rollup`). One row per
-- group of events that rate alike without an on-demand minimum: meter,
-- billing class, subject kind, `s` (the start, or the end for count
-- meters, which are rated by their end alone) and end. `subj` is always
-- '' (summed over subjects): rows per subject would be about one per event
-- (agents meter each instance in one-minute slices), so a price book with
-- an on-demand minimum is still rated from `usage_events`. `total` is the
-- summed amount, `n` the number of events. Only whole amounts up to 2^40
-- are summed here (`append_usage` adds every such event it inserts, in the
-- same transaction); the others are read from `usage_events` one by one.
CREATE TABLE usage_rollup (
    tenant_id TEXT NOT NULL,
    meter_detail TEXT NOT NULL,
    billing_class TEXT NOT NULL,
    subject_kind TEXT NOT NULL,
    subj TEXT NOT NULL,
    s BIGINT NOT NULL,
    end_ms BIGINT NOT NULL,
    total BIGINT NOT NULL,
    n BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, meter_detail, billing_class, subject_kind, subj, s, end_ms)
);
-- Rating reads one tenant's rows by time.
CREATE INDEX usage_rollup_tenant_end ON usage_rollup (tenant_id, end_ms);
-- The events rating still reads one by one (amounts not summed in the
-- rollup) and corrections: partial indexes, so that finding them does not
-- scan every event of the period.
CREATE INDEX usage_events_unrolled ON usage_events (tenant_id, end_ms)
    WHERE amount_int IS NULL OR amount_int > 1099511627776;
CREATE INDEX usage_events_corrections ON usage_events (tenant_id, end_ms)
    WHERE corrects_id IS NOT NULL;
-- Existing events.
INSERT INTO usage_rollup (tenant_id, meter_detail, billing_class, subject_kind, subj, s, end_ms,
                          total, n)
SELECT tenant_id, meter_detail, billing_class, subject_kind,
       '' AS subj,
       CASE WHEN meter IN ('requests', 'input_tokens', 'output_tokens')
            THEN end_ms ELSE start_ms END AS s,
       end_ms, CAST(SUM(amount_int) AS BIGINT), COUNT(*)
FROM usage_events
WHERE amount_int IS NOT NULL AND amount_int <= 1099511627776
GROUP BY tenant_id, meter_detail, billing_class, subject_kind, s, end_ms;
