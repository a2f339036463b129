-- Instances run from an OCI image in a container.
--
-- `image` holds the container part of the spec (image reference, ports to
-- publish, scratch size) as JSON; NULL means a command on the node.
-- `published_ports` and `cold_start` hold what the node's agent reported of
-- the running container (JSON): where its ports are reachable, and how long
-- the pull and the start took.
ALTER TABLE instances ADD COLUMN image TEXT;
ALTER TABLE instances ADD COLUMN published_ports TEXT;
ALTER TABLE instances ADD COLUMN cold_start TEXT;
