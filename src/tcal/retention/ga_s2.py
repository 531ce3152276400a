"""`ga_s2`: keep the layers that, kept alone as softmax attention, give the best initialized student.

For each layer i, a probe student keeps only layer i softmax and converts every other layer with the run's
init mode (`init=...`); its zero-shot perplexity on the calibration split is layer i's score, and the K
layers with the lowest scores stay softmax (ties: lower layer index). Depends on the init mode.

A converted layer's init does not depend on which other layers are kept (the calibration is teacher-forced),
so every layer is initialized once (`apply_init` on all L naive GDNs, one calibration) and the L probes are
assembled from those parts: L perplexity evaluations, not L calibrations.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from tcal.evaluate.perplexity import perplexity
from tcal.init import apply_init
from tcal.retention import Selection
from tcal.retention.cache import scored_selection, scoring_windows
from tcal.runtime.progress import progress
from tcal.settings.fields import INIT
from tcal.settings.retention import GaS2RetentionSettings, num_kept
from tcal.student.convert import build_student, naive_gdn
from tcal.student.gdn import use_gdn_kernel
from tcal.student.hybrid import LINEAR, HybridForCausalLM, teacher_layer_types
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)


def initialized_gdns(ctx) -> dict[int, torch.nn.Module]:
    """Every layer's naive GDN (the same as in any student of this run), initialized by the run's init mode."""
    teacher, init = ctx.teacher, ctx.settings.init
    device = next(teacher.parameters()).device
    gdns = {i: use_gdn_kernel(naive_gdn(teacher, i, init.gqa_expansion, int(ctx.settings.seed)).to(device),
                              ctx.gdn_kernel) for i in range(ctx.num_layers)}
    apply_init(gdns, init, ctx)
    for gdn in gdns.values():
        gdn.eval()
    return gdns


def probes(teacher, gdns: dict, gqa_expansion: str = "whole_head", seed: int = 0
           ) -> Iterator[tuple[int, HybridForCausalLM]]:
    """(i, the student keeping only layer i softmax, with `gdns[j]` as layer j's mixer for every j != i).

    One student is built and its mixers swapped in place for each i (the kept layer runs the teacher's own
    attention module), so a probe costs no conversion. The yielded model changes at the next step."""
    adapter = adapter_for(teacher.config)
    own = teacher_layer_types(teacher.config)
    num_layers = len(own)
    probe = build_student(teacher, [0], gqa_expansion, seed).to(next(teacher.parameters()).device)
    for i in range(num_layers):
        for j, layer in enumerate(probe.model.layers):
            layer.self_attn = adapter.attention(teacher, j) if j == i else gdns[j]
        probe.config.layer_types = [kind if j == i else LINEAR for j, kind in enumerate(own)]
        yield i, probe


def probe_perplexities(ctx, gdns: dict, windows: torch.Tensor, batch_size: int) -> dict[int, float]:
    """Layer -> its probe's perplexity; each rank evaluates its share of the probes, every rank gets all."""
    mine = set(ctx.ranks.share(range(len(gdns))))
    scores = {}
    with ctx.ranks.together():
        parts = probes(ctx.teacher, gdns, ctx.settings.init.gqa_expansion, int(ctx.settings.seed))
        bar = progress(total=len(mine), desc=f"retention ga_s2 ({ctx.settings.init.name}): probe ppl", unit="layer")
        for i, probe in parts:
            if i in mine:
                scores[i] = perplexity(probe, windows, batch_size)
                bar.update(1)
        bar.close()
    return ctx.ranks.merge(scores)


def ga_s2(retention: GaS2RetentionSettings, ctx) -> Selection:
    """Keep the layers whose single-softmax probe student has the lowest perplexity (init-dependent)."""
    num_kept(retention.ratio, ctx.num_layers)  # a bad ratio fails before anything is read

    def score() -> dict[int, float]:
        windows = scoring_windows(retention, ctx)
        return probe_perplexities(ctx, initialized_gdns(ctx), windows, int(retention.batch_size))

    return scored_selection(retention, ctx, score, highest=False, also=(INIT,))
