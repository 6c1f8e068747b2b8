"""What a run shows and records, at the bottom floor: the console, metrics, run status, trackers, the controller
actor, and the eval samples."""
