"""Shared machinery of the scored policies (`ar`, `ga_s2`): scoring windows, the on-disk score cache, and
turning per-layer scores into a keep list.

Scores are expensive (L perplexity evaluations of the teacher or of probe students), so they are cached as
JSON under `<paths.cache_dir>/retention/`. The key holds everything the scores depend on and nothing else: the
teacher's fingerprint (config and every weight), the policy, the calibration split's token content (digest of its
whole token stream: the scoring windows are cut from it), and every setting declared to change retention scores
(`tcal.settings.relevance.cache_settings`; not `ratio`, which only chooses among them, so one scoring serves every
ratio of a sweep). A policy whose scores depend on the init (`ga_s2`, recall's `gdn` probe) adds the settings
that change an initialized layer. A hit reads the file and runs no teacher forward.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

import torch

from tcal.data.documents import token_stream, token_windows
from tcal.settings.relevance import cache_settings
from tcal.store.cache import Codec, get_or_build, json_codec
from tcal.store.fingerprint import digest, teacher_fingerprint, tensor_bytes

log = logging.getLogger(__name__)

def scoring_windows(retention, ctx) -> torch.Tensor:
    """[num_windows, seq_len] tokens from the calibration split (never the evaluation split)."""
    return token_windows(ctx.splits.calibration, ctx.tokenizer, int(retention.seq_len), int(retention.num_windows))


def calibration_tokens_digest(ctx) -> str:
    """Digest of the calibration split's whole token stream (what every scoring window is cut from)."""
    stream = token_stream(ctx.splits.calibration, ctx.tokenizer)
    return digest(stream.numel(), tensor_bytes(stream))


def selection_key(retention, ctx, also: tuple[str, ...] = ()) -> tuple[str, dict]:
    """(digest, the parts it was built from) for the scores of policy `retention.name` (`also`: the products besides
    the scores that they depend on)."""
    parts = {
        "teacher": teacher_fingerprint(ctx.teacher),
        "policy": str(retention.name),
        "settings": cache_settings("retention", ctx.settings, also),
        "calibration_tokens": calibration_tokens_digest(ctx),
    }
    return digest(parts), parts


def score_folder(retention, ctx) -> Path | None:
    """Where scores are cached (none with `retention.cache=false`)."""
    return ctx.cache_dir / "retention" if retention.cache else None


def score_codec(key: str, parts: dict) -> Codec[dict[int, float]]:
    """One JSON file per key: `{"key": ..., "parts": ..., "scores": {"layer": score}}`."""
    return json_codec(lambda scores: {"key": key, "parts": parts,
                                      "scores": {str(k): v for k, v in sorted(scores.items())}},
                      lambda record: {int(k): float(v) for k, v in record["scores"].items()})


def cached_scores(retention, ctx, score: Callable[[], dict[int, float]],
                  also: tuple[str, ...] = ()) -> dict[int, float]:
    """Per-layer scores from the cache (`tcal.store.cache`, kind `retention`), or from `score()` (then saved)."""
    key, parts = selection_key(retention, ctx, also)

    def compute() -> dict[int, float]:
        return {int(i): finite_or_inf(s) for i, s in score().items()}

    return get_or_build("retention", f"{retention.name}-{key}", compute, folder=score_folder(retention, ctx),
                        codec=score_codec(key, parts), ranks=ctx.ranks)


def finite_or_inf(value: float) -> float:
    """NaN perplexities (a broken model) count as infinitely bad."""
    value = float(value)
    return math.inf if math.isnan(value) else value


def top_k(scores: dict[int, float], k: int, highest: bool) -> list[int]:
    """The k layers with the highest (or lowest) scores, ties broken by the lower layer index; sorted."""
    order = sorted(scores, key=lambda i: (-scores[i] if highest else scores[i], i))
    return sorted(order[:k])


def scored_selection(retention, ctx, score: Callable[[], dict[int, float]], highest: bool, also: tuple[str, ...] = ()):
    """Keep the K best-scoring layers (cached scores); K = L keeps everything without scoring."""
    from tcal.retention import Selection
    from tcal.settings.retention import num_kept

    num_layers = ctx.num_layers
    k = num_kept(retention.ratio, num_layers)
    if k == num_layers:
        log.info("retention %s: ratio %s keeps all %d layers; nothing to score", retention.name, retention.ratio,
                 num_layers)
        return Selection(list(range(num_layers)))
    scores = cached_scores(retention, ctx, score, also)
    keep = top_k(scores, k, highest)
    log.info("retention %s: scores %s -> keep %s", retention.name, {i: round(v, 2) for i, v in scores.items()}, keep)
    return Selection(keep, scores)
