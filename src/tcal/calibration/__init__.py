"""Teacher statistics and the Taylor-Calibrate init phases."""
