"""The entry points: `tcal` (Hydra) and its sweeps' bookkeeping."""
