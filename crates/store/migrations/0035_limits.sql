-- Limits of the process runtime.
--
-- `instances.disk_mb`: how large the instance's working directory may
-- grow on a process node before the agent stops it (NULL: the node's
-- default, `flotilla agent --default-disk`).
-- `nodes.unenforced_limits`: what the node's agent said at registration it
-- cannot enforce (JSON array of lines such as "memory: no writable cgroup
-- controller"); NULL or empty: every limit is enforced.
ALTER TABLE instances ADD COLUMN disk_mb BIGINT;
ALTER TABLE nodes ADD COLUMN unenforced_limits TEXT;
