-- GPU sharing: fractions of a GPU and MIG instances.
--
-- A GPU's capacity is 1000 milli-GPU. `used_milli` is the sum of what its
-- holders take; whole GPUs take 1000. A GPU in MIG mode (`mig_mode`, as the
-- agent reports it) takes MIG instances only, and also counts the compute
-- and memory slices they hold. Every placement is one conditional UPDATE of
-- the GPU row (`WHERE used_milli + :m <= 1000 ...`), so no interleaving of
-- placements, on any number of server replicas, can overbook a GPU or its
-- MIG geometry. `instance_id` still names the holder of a whole GPU.
ALTER TABLE gpus ADD COLUMN mig_mode BIGINT NOT NULL DEFAULT 0;
ALTER TABLE gpus ADD COLUMN used_milli BIGINT NOT NULL DEFAULT 0;
ALTER TABLE gpus ADD COLUMN used_mig_compute BIGINT NOT NULL DEFAULT 0;
ALTER TABLE gpus ADD COLUMN used_mig_memory BIGINT NOT NULL DEFAULT 0;
UPDATE gpus SET used_milli = 1000 WHERE instance_id IS NOT NULL;

-- Who holds what of each GPU: one row per (GPU, holder) while held. A MIG
-- instance has a GPU instance number (`mig_slot`, from 1) unique on its GPU.
CREATE TABLE gpu_allocations (
    gpu_id TEXT NOT NULL REFERENCES gpus (id),
    instance_id TEXT NOT NULL REFERENCES instances (id),
    milli BIGINT NOT NULL,
    mig_profile TEXT,
    mig_compute BIGINT NOT NULL DEFAULT 0,
    mig_memory BIGINT NOT NULL DEFAULT 0,
    mig_slot BIGINT,
    PRIMARY KEY (gpu_id, instance_id),
    UNIQUE (gpu_id, mig_slot)
);
CREATE INDEX gpu_allocations_instance ON gpu_allocations (instance_id);
INSERT INTO gpu_allocations (gpu_id, instance_id, milli)
    SELECT id, instance_id, 1000 FROM gpus WHERE instance_id IS NOT NULL;

-- What an instance asked for (NULL: whole GPUs) and what it was given.
ALTER TABLE instances ADD COLUMN share_milli BIGINT;
ALTER TABLE instances ADD COLUMN mig_profile TEXT;
ALTER TABLE instances ADD COLUMN mig_compute BIGINT;
ALTER TABLE instances ADD COLUMN mig_memory BIGINT;
ALTER TABLE instances ADD COLUMN mig_memory_mib BIGINT;
ALTER TABLE instances ADD COLUMN gpu_slices TEXT NOT NULL DEFAULT '[]';
