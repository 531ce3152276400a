"""`explicit`: the layers listed in `retention.keep`."""

from tcal.convert import validate_keep_layers
from tcal.retention import POLICIES, Selection


@POLICIES.register("explicit")
def explicit(cfg, ctx) -> Selection:
    return Selection(validate_keep_layers(cfg.keep, ctx.num_layers))
