-- How far an instance's lifecycle has been turned into usage events. NULL:
-- not yet. For a running instance it is the end of the last complete
-- metering slice; for a final one its finish time (metering is done).
ALTER TABLE instances ADD COLUMN metered_until BIGINT;
