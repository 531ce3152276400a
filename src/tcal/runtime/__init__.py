"""One process among a run's ranks: starting them, shared decisions, signals."""
