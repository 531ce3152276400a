"""`explicit`: the layers listed in `retention.keep`."""

from tcal.retention import POLICIES, Selection
from tcal.student.convert import validate_keep_layers


@POLICIES.register("explicit")
def explicit(cfg, ctx) -> Selection:
    return Selection(validate_keep_layers(cfg.keep, ctx.num_layers))
