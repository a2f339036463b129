-- Indexes for the API's hot reads when the queue is long (issue 15,
-- `scripts/bench api` with 10,000 queued instances):
--
-- - the scheduler reads the oldest pending instances and queued jobs
--   (`WHERE state = 'pending' ORDER BY id LIMIT n`): with an index on
--   `state` alone every pending row was read and sorted on each pass;
--   `(state, id)` hands them over in order and stops after n;
-- - a quota check counts a tenant's live work (`WHERE tenant_id = ? AND
--   state IN (...)`) and a list may filter by tenant and state: with
--   `(tenant_id, id)` that read every row the tenant ever had, finished
--   ones included; `(tenant_id, state, id)` reads only the live ones.
--
-- The `(state, id)` indexes replace the `(state)` ones, a prefix of them.
DROP INDEX instances_state;
CREATE INDEX instances_state ON instances (state, id);
CREATE INDEX instances_tenant_state ON instances (tenant_id, state, id);
DROP INDEX jobs_state;
CREATE INDEX jobs_state ON jobs (state, id);
CREATE INDEX jobs_tenant_state ON jobs (tenant_id, state, id);
