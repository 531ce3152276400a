"""`phase1`, `phase2`, `full`: Taylor-Calibrate's phases on every GDN layer (`init.phases`; each mode's own by
default)."""

from tcal.init.calibration.calibrate import calibrate_gdns
from tcal.settings.init import CalibratedInitSettings


def calibrated(gdns, init: CalibratedInitSettings, ctx) -> dict:
    return calibrate_gdns(gdns, ctx, tuple(init.phases))
