"""`explicit`: the layers listed in `retention.keep`."""

from tcal.retention import Selection
from tcal.settings.retention import ExplicitRetentionSettings, validate_keep_layers


def explicit(retention: ExplicitRetentionSettings, ctx) -> Selection:
    return Selection(validate_keep_layers(retention.keep, ctx.num_layers))
