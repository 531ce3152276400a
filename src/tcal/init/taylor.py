"""`phase1`, `phase2`, `full`: Taylor-Calibrate's phases on every GDN layer (`init.phases`; each mode's own by
default)."""

from tcal.init.calibration.calibrate import calibrate_gdns
from tcal.registry import INIT_MODES
from tcal.settings.init import CalibratedInitSettings


@INIT_MODES.option("phase1", CalibratedInitSettings, phases=["phase1"])
@INIT_MODES.option("phase2", CalibratedInitSettings, phases=["phase2"])
@INIT_MODES.option("full", CalibratedInitSettings)
def calibrated(gdns, init: CalibratedInitSettings, ctx) -> dict:
    return calibrate_gdns(gdns, ctx, tuple(init.phases))
