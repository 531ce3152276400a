"""`naive`: conversion only; the dynamics stay at fla's defaults."""

from tcal.settings.init import InitSettings


def naive(gdns, init: InitSettings, ctx) -> dict:
    return {}
