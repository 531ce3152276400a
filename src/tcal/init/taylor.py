"""`phase1`, `phase2`, `full`: Taylor-Calibrate's phases on every GDN layer (the phases come from the YAML)."""

from tcal.init import INIT_MODES
from tcal.init.calibration.calibrate import calibrate_gdns


@INIT_MODES.register("phase1")
@INIT_MODES.register("phase2")
@INIT_MODES.register("full")
def calibrated(gdns, cfg, ctx) -> dict:
    return calibrate_gdns(gdns, ctx, tuple(cfg.phases))
