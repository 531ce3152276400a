"""`uniform`: every (L / K)-th layer from layer 0 (L=28, K=7: 0, 4, ..., 24)."""

from tcal.retention import Selection
from tcal.settings.retention import RetentionSettings, uniform_layers

__all__ = ["uniform", "uniform_layers"]


def uniform(retention: RetentionSettings, ctx) -> Selection:
    return Selection(uniform_layers(ctx.num_layers, retention.ratio))
