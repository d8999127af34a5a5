"""Step programs of the recovery workflow and what they share (config, run store, contracts)."""
