"""`recall`: keep the layers the teacher retrieves with (docs/method.md, section "Retained-layer policies").

A perplexity score is blind to retrieval: on ordinary text few tokens need an exact copy from far back, so the
layers that do the copying cost little perplexity when they go. This policy probes retrieval directly. On
`num_prompts` synthetic sequences cut from the calibration split (`tcal.data.needles`: key-value statements hidden in
the split's text, then one key asked back), teacher-forced, it measures for every layer i and sequence p:

    A_ip = mean NLL of p's answer tokens (the asked value)    T_ip = mean NLL of p's ordinary text tokens

with layer i's attention bypassed (`probe=bypass`: output 0, residual and MLP kept, as AR does) or replaced by
its initialized GDN (`probe=gdn`: the run's init mode; every layer is initialized once, as for GA-S2), and once
with nothing changed (A_0p, T_0p). Per sequence and over the P sequences:

    s_ip = (A_ip - A_0p) - (T_ip - T_0p)      recall_i = mean_p s_ip      se_i = std_p(s_ip) / sqrt(P)

the rise in the answer's loss beyond the rise on the text of the same forward, so a layer indispensable everywhere
(layers 0 and 1 of SmolLM2) does not pass for a retriever. `mean_p (T_ip - T_0p)` is an AR-like score.

Which layers the score chooses (`scored=null`, the rule): those whose score stands above the probe's own noise,

    recall_i - noise_z * se_i > 0

at most K of them, highest first. The standard error comes from the spread over the probe's sequences, so a layer
whose rise depends on which needles were drawn is not scored, and a retriever is scored however large the other
layers' scores are. `scored=N` overrides the rule with the N highest scores. The other kept layers are placed by
`fill`: `text`, the highest text-loss rises among the others (what AR would keep), or `uniform`, the uniform
policy's layers with each scored layer taking the place of its nearest uniform slot.

Cost: L + 1 teacher forwards over num_prompts x seq_len tokens, of which the probe computes about half: a forward
with layer i changed replays the base forward's outputs of layers 0..i-1 instead of computing them again
(`earlier_layers_replayed`: their inputs are unchanged, so the figures are the same). The losses are cached like AR's
scores (`tcal.retention.cache`; `probe=gdn` adds the init, the calibration and the seed to the key) and serve
every ratio, `scored`, `fill` and `noise_z`. The details (both rises and the standard error per layer, the rule's
figures, the scored layers, the probe's size and its seconds) go to results.json `retention_details`.

`search=greedy` then measures students instead of the teacher, from this keep list; `search=prune` removes layers
one at a time from the rule's list at `prune_from_ratio` (or from `prune_from`, without the probe) by the same
students' figures (`tcal.retention.search`).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager

import torch

from tcal.data.needles import ANSWER, TEXT
from tcal.retention import Selection
from tcal.retention.ar import attention_bypassed
from tcal.retention.cache import score_folder, selection_key, top_k
from tcal.retention.probe import earlier_layers_replayed, layer_outputs_recorded, probe_sequences, sequence_losses
from tcal.retention.search import pruned, searched
from tcal.runtime.progress import progress
from tcal.settings.fields import INIT
from tcal.settings.retention import FILLS, PROBES, RecallRetentionSettings, num_kept, uniform_layers
from tcal.store.cache import get_or_build, json_codec
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)


@contextmanager
def attention_replaced(teacher, layer: int, gdn):
    """Within the block, layer `layer`'s attention output is `gdn`'s output on the same input."""

    def replace(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        out = gdn(hidden)[0].to(hidden.dtype)
        return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out

    handle = adapter_for(teacher.config).attention(teacher, layer).register_forward_hook(replace, with_kwargs=True)
    try:
        yield teacher
    finally:
        handle.remove()


def probe_losses(teacher, ids, labels, batch_size: int, ranks, gdns: dict | None = None, desc: str = "") -> dict:
    """{"base": [[A_0p, T_0p] per sequence], "layers": {i: [[A_ip, T_ip] per sequence]}}: each rank probes its
    share of the layers, every rank gets all."""
    num_layers = teacher.config.num_hidden_layers
    mine_layers = list(ranks.share(range(num_layers)))
    base: list = []
    mine: dict[int, list] = {i: [] for i in mine_layers}
    starts = range(0, ids.shape[0], batch_size)
    with progress(total=len(starts) * len(mine_layers), desc=desc, unit="layer-batch") as bar:
        for start in starts:
            batch, batch_labels = ids[start:start + batch_size], labels[start:start + batch_size]
            with layer_outputs_recorded(teacher) as outputs:
                base += sequence_losses(teacher, batch, batch_labels)
            for i in mine_layers:
                changed = attention_bypassed(teacher, i) if gdns is None else attention_replaced(teacher, i, gdns[i])
                with changed, earlier_layers_replayed(teacher, outputs, i):
                    mine[i] += sequence_losses(teacher, batch, batch_labels)
                bar.update(1)
            del outputs
    return {"base": base, "layers": ranks.merge(mine)}


def recall_scores(losses: dict) -> dict[str, dict[int, float]]:
    """Per layer, from `probe_losses`' result: `score` (recall_i), `se` (its standard error over the sequences),
    `answer_rise` and `text_rise` (means over the sequences)."""
    base = torch.tensor(losses["base"], dtype=torch.float64)
    figures: dict[str, dict[int, float]] = {"score": {}, "se": {}, "answer_rise": {}, "text_rise": {}}
    for i, rows in losses["layers"].items():
        rise = torch.tensor(rows, dtype=torch.float64) - base
        per_sequence = rise[:, 0] - rise[:, 1]
        n = per_sequence.numel()
        figures["score"][int(i)] = float(per_sequence.mean())
        figures["se"][int(i)] = float(per_sequence.std(correction=1)) / math.sqrt(n) if n > 1 else math.inf
        figures["answer_rise"][int(i)] = float(rise[:, 0].mean())
        figures["text_rise"][int(i)] = float(rise[:, 1].mean())
    return figures


def above_noise(scores: dict[int, float], se: dict[int, float], noise_z: float) -> list[int]:
    """The layers whose score stands above the probe's noise, score - noise_z * se > 0, highest score first
    (ties: lower index)."""
    return sorted((i for i in scores if scores[i] - noise_z * se[i] > 0), key=lambda i: (-scores[i], i))


def uniform_fill(chosen: list[int], k: int, num_layers: int) -> list[int]:
    """`chosen` plus k - len(chosen) layers placed as the uniform policy places K = k: each chosen layer (in the
    order given) takes its nearest free uniform slot (ties: the lower slot), the slots left are kept, and a slot
    that is already chosen gives way to the nearest layer not taken (ties: the lower index)."""
    slots = uniform_layers(num_layers, k / num_layers)
    if len(slots) != k:  # k / L rounds back to k for every k <= L; a guard for the arithmetic
        raise ValueError(f"uniform slots for {k} of {num_layers} layers came out as {len(slots)}")
    free = list(slots)
    for layer in chosen:
        free.remove(min(free, key=lambda s: (abs(s - layer), s)))
    keep = list(chosen)
    for slot in free:
        if slot in keep:
            slot = min((i for i in range(num_layers) if i not in keep), key=lambda i: (abs(i - slot), i))
        keep.append(slot)
    return sorted(keep)


def chosen_by_score(scores: dict[int, float], se: dict[int, float], k: int, scored: int | None,
                    noise_z: float) -> list[int]:
    """The kept layers the recall score chooses: the rule's (`scored=None`: above the noise, at most k) or the
    `scored` highest."""
    if scored is None:
        return above_noise(scores, se, noise_z)[:k]
    return sorted(scores, key=lambda i: (-scores[i], i))[:min(int(scored), k)]


def keep_list(chosen: list[int], text_rise: dict[int, float], k: int, fill: str, num_layers: int) -> list[int]:
    """The k kept layers: `chosen` (by the recall score) and the rest placed by `fill`."""
    if fill == "text":
        others = {i: v for i, v in text_rise.items() if i not in chosen}
        return sorted(list(chosen) + top_k(others, k - len(chosen), highest=True)) if k > len(chosen) \
            else sorted(chosen)
    if fill == "uniform":
        return uniform_fill(list(chosen), k, num_layers)
    raise ValueError(f"retention.fill={fill!r}; expected one of {', '.join(FILLS)}")


def recall(retention: RecallRetentionSettings, ctx) -> Selection:
    """Keep the layers whose removal costs the teacher's retrieval beyond the probe's noise and its cost on
    ordinary text, then fill the rest."""
    num_layers = ctx.num_layers
    k = num_kept(retention.ratio, num_layers)
    if retention.probe not in PROBES:
        raise ValueError(f"retention.probe={retention.probe!r}; expected one of {', '.join(PROBES)}")
    if k == num_layers:
        log.info("retention recall: ratio %s keeps all %d layers; nothing to score", retention.ratio, num_layers)
        return Selection(list(range(num_layers)))
    if retention.search == "prune" and retention.prune_from is not None:
        return pruned(retention, ctx, list(retention.prune_from))
    key, parts = selection_key(retention, ctx, (INIT,) if retention.probe == "gdn" else ())

    def compute() -> dict:
        start = time.perf_counter()
        ids, labels = probe_sequences(retention, ctx)
        gdns = None
        if retention.probe == "gdn":
            from tcal.retention.ga_s2 import initialized_gdns

            gdns = initialized_gdns(ctx)
        losses = probe_losses(ctx.teacher, ids, labels, int(retention.batch_size), ctx.ranks, gdns,
                              desc=f"retention recall ({retention.probe}): probe loss")
        return {"losses": losses, "seconds": round(time.perf_counter() - start, 3),
                "tokens": int(ids.numel()) * (num_layers + 1),
                "answer_tokens": int((labels[:, 1:] == ANSWER).sum()),
                "text_tokens": int((labels[:, 1:] == TEXT).sum())}

    codec = json_codec(lambda value: {"key": key, "parts": parts, "value": value}, lambda record: record["value"])
    folder = score_folder(retention, ctx)
    probe = get_or_build("retention", f"recall-by-sequence-{key}", compute, folder=folder, codec=codec,
                         ranks=ctx.ranks)
    figures = recall_scores(probe["losses"])
    scores, se = figures["score"], figures["se"]
    chosen = chosen_by_score(scores, se, k, retention.scored, float(retention.noise_z))
    keep = keep_list(chosen, figures["text_rise"], k, retention.fill, num_layers)
    rank = {i: r + 1 for r, i in enumerate(sorted(scores, key=lambda i: (-scores[i], i)))}
    rule = "override" if retention.scored is not None else f"score - {retention.noise_z} * se > 0"
    log.info("retention recall: scores %s -> keep %s (by the score: %s, %s; %.1f s of scoring)",
             {i: f"{v:.3f}±{se[i]:.3f}" for i, v in scores.items()}, keep, sorted(chosen), rule, probe["seconds"])
    base = torch.tensor(probe["losses"]["base"], dtype=torch.float64).mean(0).tolist()
    details = {"probe": str(retention.probe), "scored_layers": sorted(chosen), "fill": str(retention.fill),
               "scored": retention.scored, "rule": rule, "noise_z": float(retention.noise_z),
               "above_noise": above_noise(scores, se, float(retention.noise_z)),
               "rank": {str(i): r for i, r in rank.items()},
               "se": {str(i): v for i, v in sorted(se.items())},
               "answer_rise": {str(i): v for i, v in sorted(figures["answer_rise"].items())},
               "text_rise": {str(i): v for i, v in sorted(figures["text_rise"].items())},
               "base_answer_nll": base[0], "base_text_nll": base[1], "sequences": len(probe["losses"]["base"]),
               "seq_len": int(retention.seq_len), "probe_seed": int(retention.probe_seed),
               "seconds": probe["seconds"], "tokens": probe["tokens"], "answer_tokens": probe["answer_tokens"],
               "text_tokens": probe["text_tokens"]}
    selection = Selection(keep, scores, details)
    if retention.search == "none":
        return selection
    if retention.search == "prune":
        k0 = num_kept(retention.prune_from_ratio, num_layers)
        start = keep_list(chosen_by_score(scores, se, k0, retention.scored, float(retention.noise_z)),
                          figures["text_rise"], k0, retention.fill, num_layers)
        return pruned(retention, ctx, start, selection)
    return searched(retention, ctx, selection, figures["text_rise"], figures["answer_rise"])
