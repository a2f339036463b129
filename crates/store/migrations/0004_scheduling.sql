-- Scheduling: queue priority (higher first), service tier (1 dedicated,
-- 2 shared/spot, 3 queued) and whether the scheduler may preempt the
-- instance. `preempted_by` is set when the scheduler preempts a running
-- instance (the instance it makes room for); `requeued_from` names the
-- preempted instance a new pending one requeues. Booleans are BIGINT 0/1
-- like the rest of the schema.
ALTER TABLE instances ADD COLUMN priority BIGINT NOT NULL DEFAULT 0;
ALTER TABLE instances ADD COLUMN tier BIGINT NOT NULL DEFAULT 1;
ALTER TABLE instances ADD COLUMN preemptible BIGINT NOT NULL DEFAULT 0;
ALTER TABLE instances ADD COLUMN preempted_by TEXT;
ALTER TABLE instances ADD COLUMN requeued_from TEXT;
