"""`ar` (attention removal): keep the layers whose attention the teacher misses most.

For each layer, the teacher runs with that layer's attention output replaced by zeros (the residual stream
and the MLP stay) and its perplexity on the calibration split is the layer's score; the K layers with the
highest scores stay softmax (ties: lower layer index). Independent of the init mode.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from tcal.evaluate.perplexity import perplexity
from tcal.retention import Selection
from tcal.retention.cache import scored_selection, scoring_windows
from tcal.runtime.distributed import Ranks
from tcal.runtime.progress import progress
from tcal.settings.retention import ScoredRetentionSettings
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)


def _zero_output(module, args, output):
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]),) + tuple(output[1:])
    return torch.zeros_like(output)


@contextmanager
def attention_bypassed(teacher, layer: int):
    """Within the block, layer `layer`'s attention contributes nothing to the residual stream."""
    handle = adapter_for(teacher.config).attention(teacher, layer).register_forward_hook(_zero_output)
    try:
        yield teacher
    finally:
        handle.remove()


def bypass_perplexities(teacher, windows: torch.Tensor, batch_size: int, ranks: Ranks | None = None
                        ) -> dict[int, float]:
    """Layer -> teacher perplexity on `windows` with that layer's attention bypassed (each rank scores its
    share of the layers; every rank gets all scores)."""
    ranks = ranks or Ranks()
    scores = {}
    with ranks.together():
        for i in progress(ranks.share(range(teacher.config.num_hidden_layers)), desc="retention ar: bypass ppl",
                          unit="layer"):
            with attention_bypassed(teacher, i):
                scores[i] = perplexity(teacher, windows, batch_size)
    return ranks.merge(scores)


def ar(retention: ScoredRetentionSettings, ctx) -> Selection:
    """Keep the layers whose attention bypass raises perplexity most."""
    return scored_selection(retention, ctx, lambda: bypass_perplexities(ctx.teacher, scoring_windows(retention, ctx),
                                                                  int(retention.batch_size), ctx.ranks), highest=True)
