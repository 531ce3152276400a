"""`naive`: conversion only; the dynamics stay at fla's defaults."""

from tcal.init import INIT_MODES


@INIT_MODES.register("naive")
def naive(gdns, cfg, ctx) -> dict:
    return {}
