"""`ar` (attention removal): keep the layers whose attention the teacher misses most.

For each layer, the teacher runs with that layer's attention output replaced by zeros (the residual stream
and the MLP stay) and its perplexity on the calibration split is the layer's score; the K layers with the
highest scores stay softmax (ties: lower layer index). Independent of the init mode.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from tcal.evaluate.perplexity import perplexity
from tcal.retention import POLICIES, Selection, num_kept
from tcal.retention.cache import cached_scores, scoring_windows, top_k
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


def bypass_perplexities(teacher, windows: torch.Tensor, batch_size: int) -> dict[int, float]:
    """Layer -> teacher perplexity on `windows` with that layer's attention bypassed."""
    scores = {}
    for i in tqdm(range(teacher.config.num_hidden_layers), desc="retention ar: bypass ppl", unit="layer"):
        with attention_bypassed(teacher, i):
            scores[i] = perplexity(teacher, windows, batch_size)
    return scores


@POLICIES.register("ar")
def ar(cfg, ctx) -> Selection:
    num_layers = ctx.num_layers
    k = num_kept(cfg.ratio, num_layers)
    if k == num_layers:
        log.info("retention ar: ratio %s keeps all %d layers; nothing to score", cfg.ratio, num_layers)
        return Selection(list(range(num_layers)))
    scores = cached_scores(cfg, ctx, lambda: bypass_perplexities(ctx.teacher, scoring_windows(cfg, ctx),
                                                                 int(cfg.batch_size)))
    keep = top_k(scores, k, highest=True)
    log.info("retention ar: bypass perplexities %s -> keep %s",
             {i: round(s, 2) for i, s in scores.items()}, keep)
    return Selection(keep, scores)
