"""The tools beside the library: `tcal-plan`, `tcal-report` and the W&B dashboard."""
