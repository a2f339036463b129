-- Replica pools (`/v1/pools`, migration 0008) are gone: endpoints
-- (`/v1/endpoints`, migration 0013) replaced them, and nothing reads or
-- writes these tables any more. The members table references the pools
-- table, so it goes first (PostgreSQL refuses to drop a referenced table);
-- the pools' tenant index goes with its table. `IF EXISTS` on both
-- backends. The instances the pools started stay, as every instance does.
DROP TABLE IF EXISTS replica_pool_members;
DROP TABLE IF EXISTS replica_pools;
