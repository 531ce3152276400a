"""`naive`: conversion only; the dynamics stay at fla's defaults."""

from tcal.registry import INIT_MODES
from tcal.settings.init import InitSettings


@INIT_MODES.option("naive", InitSettings)
def naive(gdns, init: InitSettings, ctx) -> dict:
    return {}
