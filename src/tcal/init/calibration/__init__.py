"""Taylor-Calibrate's machinery, shared by the calibrating init modes: teacher statistics, Phase 1's closed-form rules, Phase 2's alignment, full_plus's pool."""
