-- Queue triggers: what the last read of each of an endpoint's external
-- queue triggers showed (a JSON list of TriggerStatus: depth or error, and
-- when it was read), so any server can show it; written by the leader's
-- endpoint controller each pass.
ALTER TABLE endpoints ADD COLUMN triggers TEXT;
