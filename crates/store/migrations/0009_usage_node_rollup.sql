-- GPU usage summed per node at ingestion, so that provider payouts read a
-- few rows per node and interval instead of every event of the month (see
-- `Store::usage_on_nodes`). Payouts price GPU time at list price by model,
-- share, billing class, subject kind (endpoints are serverless) and
-- interval; the tenant, the subject and the source change nothing, so rows
-- sum over them. Only `gpu_seconds` events that name a node and whose
-- whole amount is at most 2^40 are summed here (`append_usage` adds every
-- such event it inserts, in the same transaction as the event); the others
-- are read one by one. Every node is summed, not only providers' nodes: a
-- node's provider is looked up when the payout is computed.
-- (0008 is taken by autoscaling on another branch.)
CREATE TABLE usage_node_rollup (
    node_id TEXT NOT NULL,
    meter_detail TEXT NOT NULL,
    billing_class TEXT NOT NULL,
    subject_kind TEXT NOT NULL,
    start_ms BIGINT NOT NULL,
    end_ms BIGINT NOT NULL,
    total BIGINT NOT NULL,
    n BIGINT NOT NULL,
    PRIMARY KEY (node_id, meter_detail, billing_class, subject_kind, start_ms, end_ms)
);
-- Payouts read one month of every node.
CREATE INDEX usage_node_rollup_end ON usage_node_rollup (end_ms);
-- What payouts still read one by one: node GPU events not summed above,
-- and corrections of any tenant (which void the event they correct).
CREATE INDEX usage_events_node_unrolled ON usage_events (end_ms)
    WHERE node_id IS NOT NULL AND meter = 'gpu_seconds'
      AND (amount_int IS NULL OR amount_int > 1099511627776);
CREATE INDEX usage_events_corrections_end ON usage_events (end_ms)
    WHERE corrects_id IS NOT NULL;
-- Existing events.
INSERT INTO usage_node_rollup (node_id, meter_detail, billing_class, subject_kind, start_ms,
                               end_ms, total, n)
SELECT node_id, meter_detail, billing_class, subject_kind, start_ms, end_ms,
       CAST(SUM(amount_int) AS BIGINT), COUNT(*)
FROM usage_events
WHERE node_id IS NOT NULL AND meter = 'gpu_seconds'
  AND amount_int IS NOT NULL AND amount_int <= 1099511627776
GROUP BY node_id, meter_detail, billing_class, subject_kind, start_ms, end_ms;
