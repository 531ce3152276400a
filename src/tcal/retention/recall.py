"""`recall`: keep the layers the teacher retrieves with (docs/method.md, section "Retained-layer policies").

A perplexity score is blind to retrieval: on ordinary text few tokens need an exact copy from far back, so the
layers that do the copying cost little perplexity when they go. This policy probes retrieval directly. On
`num_prompts` synthetic sequences cut from the calibration split (`tcal.data.needles`: key-value statements hidden in
the split's text, then one key asked back), teacher-forced, it measures for every layer i, in one forward:

    A_i = mean NLL of the answer tokens (the asked value)    T_i = mean NLL of the ordinary text tokens

with layer i's attention bypassed (`probe=bypass`: output 0, residual and MLP kept, as AR does) or replaced by
its initialized GDN (`probe=gdn`: the run's init mode; every layer is initialized once, as for GA-S2), and once
with nothing changed (A_0, T_0). Layer i's score is

    recall_i = (A_i - A_0) - (T_i - T_0)

the rise in the answer's loss beyond the rise on the text of the same forward, so a layer indispensable everywhere
(layers 0 and 1 of SmolLM2) does not pass for a retriever. `T_i - T_0` is an AR-like score from the same forward.

Of the K = round(ratio * L) kept layers, `scored` (all K when null) are the highest `recall` scores; the rest are
placed by `fill`: `text`, the highest text-loss rises among the others (what AR would keep), or `uniform`, the
uniform policy's layers with each scored layer taking the place of its nearest uniform slot.

Cost: (L + 1) teacher forwards over num_prompts x seq_len tokens (31 x 8 x 256 = 63k tokens for SmolLM2 by
default, as many as AR reads). The scores are cached like AR's (`tcal.retention.cache`); `probe=gdn` adds the init, the calibration and
the seed to the key. The details (both rises per layer, the scored layers, the probe's size and its seconds) go to
results.json `retention_details`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from tcal.data.needles import ANSWER, TEXT, probe_batch
from tcal.evaluate.perplexity import token_nll
from tcal.retention import POLICIES, Selection
from tcal.retention.ar import attention_bypassed
from tcal.retention.cache import score_folder, selection_key, top_k
from tcal.retention.uniform import uniform_layers
from tcal.runtime.progress import progress
from tcal.settings.fields import INIT
from tcal.settings.retention import FILLS, PROBES, num_kept
from tcal.store.cache import get_or_build, json_codec
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)



def probe_sequences(cfg, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_prompts, seq_len] ids, labels) cut from the calibration split, drawn from `probe_seed`."""
    return probe_batch(ctx.splits.calibration, ctx.tokenizer, int(cfg.seq_len), int(cfg.num_prompts),
                       int(cfg.probe_seed))


@torch.no_grad()
def answer_and_text_nll(model, ids: torch.Tensor, labels: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """(mean NLL of the ANSWER tokens, mean NLL of the TEXT tokens) of `model` on the sequences, teacher-forced
    (float64 sums; a token counts when it is predicted, i.e. from position 1 on)."""
    sums = torch.zeros(2, dtype=torch.float64)
    counts = torch.zeros(2, dtype=torch.float64)
    for start in range(0, ids.shape[0], batch_size):
        nll = token_nll(model, ids[start:start + batch_size]).double().cpu()
        target = labels[start:start + batch_size, 1:]
        for j, label in enumerate((ANSWER, TEXT)):
            mask = target == label
            sums[j] += nll[mask].sum()
            counts[j] += mask.sum()
    answer, text = (sums / counts).tolist()
    return answer, text


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
    """{"base": [A_0, T_0], "layers": {i: [A_i, T_i]}}: each rank probes its share of the layers, every rank
    gets all."""
    base = answer_and_text_nll(teacher, ids, labels, batch_size)
    mine = {}
    for i in progress(ranks.share(range(teacher.config.num_hidden_layers)), desc=desc, unit="layer"):
        changed = attention_bypassed(teacher, i) if gdns is None else attention_replaced(teacher, i, gdns[i])
        with changed:
            mine[i] = list(answer_and_text_nll(teacher, ids, labels, batch_size))
    return {"base": list(base), "layers": ranks.merge(mine)}


def recall_scores(losses: dict) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """(recall score, answer-loss rise, text-loss rise) per layer from `probe_losses`' result."""
    base_answer, base_text = losses["base"]
    answer = {int(i): a - base_answer for i, (a, _) in losses["layers"].items()}
    text = {int(i): t - base_text for i, (_, t) in losses["layers"].items()}
    return {i: answer[i] - text[i] for i in answer}, answer, text


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


def keep_list(scores: dict[int, float], text_rise: dict[int, float], k: int, scored: int | None, fill: str,
              num_layers: int) -> tuple[list[int], list[int]]:
    """(the keep list, its layers chosen by the recall score)."""
    s = k if scored is None else min(int(scored), k)
    by_recall = sorted(scores, key=lambda i: (-scores[i], i))[:s]
    if fill == "text":
        others = {i: v for i, v in text_rise.items() if i not in by_recall}
        keep = sorted(by_recall + top_k(others, k - s, highest=True)) if k > s else sorted(by_recall)
    elif fill == "uniform":
        keep = uniform_fill(by_recall, k, num_layers)
    else:
        raise ValueError(f"retention.fill={fill!r}; expected one of {', '.join(FILLS)}")
    return keep, sorted(by_recall)


@POLICIES.register("recall")
def recall(cfg, ctx) -> Selection:
    """Keep the layers whose removal costs the teacher's retrieval most beyond its cost on ordinary text."""
    num_layers = ctx.num_layers
    k = num_kept(cfg.ratio, num_layers)
    if cfg.probe not in PROBES:
        raise ValueError(f"retention.probe={cfg.probe!r}; expected one of {', '.join(PROBES)}")
    if k == num_layers:
        log.info("retention recall: ratio %s keeps all %d layers; nothing to score", cfg.ratio, num_layers)
        return Selection(list(range(num_layers)))
    key, parts = selection_key(cfg, ctx, (INIT,) if cfg.probe == "gdn" else ())

    def compute() -> dict:
        start = time.perf_counter()
        ids, labels = probe_sequences(cfg, ctx)
        gdns = None
        if cfg.probe == "gdn":
            from tcal.retention.ga_s2 import initialized_gdns

            gdns = initialized_gdns(ctx)
        losses = probe_losses(ctx.teacher, ids, labels, int(cfg.batch_size), ctx.ranks, gdns,
                              desc=f"retention recall ({cfg.probe}): probe loss")
        return {"losses": losses, "seconds": round(time.perf_counter() - start, 3),
                "tokens": int(ids.numel()) * (num_layers + 1),
                "answer_tokens": int((labels[:, 1:] == ANSWER).sum()), "text_tokens": int((labels[:, 1:] == TEXT).sum())}

    codec = json_codec(lambda value: {"key": key, "parts": parts, "value": value}, lambda record: record["value"])
    folder = score_folder(cfg, ctx)
    probe = get_or_build("retention", f"recall-{key}", compute, folder=folder, codec=codec, ranks=ctx.ranks)
    scores, answer_rise, text_rise = recall_scores(probe["losses"])
    keep, by_recall = keep_list(scores, text_rise, k, cfg.scored, cfg.fill, num_layers)
    rank = {i: r + 1 for r, i in enumerate(sorted(scores, key=lambda i: (-scores[i], i)))}
    log.info("retention recall: scores %s -> keep %s (by the score: %s; %.1f s of scoring)",
             {i: round(v, 3) for i, v in scores.items()}, keep, by_recall, probe["seconds"])
    details = {"probe": str(cfg.probe), "scored_layers": by_recall, "fill": str(cfg.fill),
               "rank": {str(i): r for i, r in rank.items()},
               "answer_rise": {str(i): v for i, v in sorted(answer_rise.items())},
               "text_rise": {str(i): v for i, v in sorted(text_rise.items())},
               "base_answer_nll": probe["losses"]["base"][0], "base_text_nll": probe["losses"]["base"][1],
               "seconds": probe["seconds"], "tokens": probe["tokens"], "answer_tokens": probe["answer_tokens"],
               "text_tokens": probe["text_tokens"]}
    return Selection(keep, scores, details)
