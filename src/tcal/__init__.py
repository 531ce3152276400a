"""Taylor-Calibrate: hybrid Gated DeltaNet conversion and distillation."""
