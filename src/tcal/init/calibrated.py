"""`phase1`, `phase2`, `full`: Taylor-Calibrate's phases on every GDN layer (the phases come from the YAML)."""

from tcal.calibration.calibrate import calibrate_gdns
from tcal.init import INIT_MODES


@INIT_MODES.register("phase1")
@INIT_MODES.register("phase2")
@INIT_MODES.register("full")
def calibrated(gdns, cfg, ctx) -> dict:
    return calibrate_gdns(gdns, ctx, tuple(cfg.phases))
