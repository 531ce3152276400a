"""`uniform`: every (L / K)-th layer from layer 0 (L=28, K=7: 0, 4, ..., 24)."""

from tcal.retention import POLICIES, Selection
from tcal.settings.retention import num_kept


def uniform_layers(num_layers: int, ratio: float) -> list[int]:
    k = num_kept(ratio, num_layers)
    return [i * num_layers // k for i in range(k)]


@POLICIES.register("uniform")
def uniform(cfg, ctx) -> Selection:
    return Selection(uniform_layers(ctx.num_layers, cfg.ratio))
