-- A provider's offer of a node: the weekly windows (UTC) when its GPUs are
-- offered, as the JSON of flotilla_core::offer::NodeOffer. NULL: offered
-- always, as before. The scheduler sees a node outside its windows as
-- unavailable; the reconciler stops work on it when a window closes.
ALTER TABLE nodes ADD COLUMN offer TEXT;
