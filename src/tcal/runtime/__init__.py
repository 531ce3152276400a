"""One process among a run's ranks: starting them, shared decisions, signals, its worker pools' bound, its log file."""
