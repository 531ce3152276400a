"""Shared machinery of the scored policies (`ar`, `ga_s2`): scoring windows, the on-disk score cache, and
turning per-layer scores into a keep list.

Scores are expensive (L perplexity evaluations of the teacher or of probe students), so they are cached as
JSON under `<paths.cache_dir>/retention/`. The key holds everything the scores depend on and nothing else:
- the teacher's fingerprint (config and every weight),
- the policy name and its scoring settings (`seq_len`, `num_windows`, `batch_size`, ...), but not `ratio`
  (scores do not depend on it, so one scoring serves every ratio of a sweep) nor `cache`,
- the data node without its evaluation-only fields (`evaluation_docs`, `eval_files`: selection never reads
  the evaluation split), and the calibration split's token content (digest of its whole token stream, so a
  changed document or tokenizer is a new key; the scoring windows and calibration batches are cut from it),
- what the policy adds (`extra`): for `ga_s2` the init mode node, the calibration node and the seed (the
  naive GDN's new parameters are seeded); `ar` adds nothing (it is independent of the init).
A hit reads the file and runs no teacher forward.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

import torch

from tcal.cache import Codec, get_or_build, json_codec
from tcal.data import token_stream, token_windows
from tcal.fingerprint import digest, plain, teacher_fingerprint, tensor_bytes

log = logging.getLogger(__name__)

# Retention fields that select among scores instead of producing them.
NOT_SCORING = ("ratio", "cache", "keep", "scored", "fill")
# Data fields that only concern the evaluation split, or only the training batches.
EVALUATION_ONLY = ("evaluation_docs", "eval_files", "retrieval_mix")


def scoring_windows(cfg, ctx) -> torch.Tensor:
    """[num_windows, seq_len] tokens from the calibration split (never the evaluation split)."""
    return token_windows(ctx.splits.calibration, ctx.tokenizer, int(cfg.seq_len), int(cfg.num_windows))


def calibration_tokens_digest(ctx) -> str:
    """Digest of the calibration split's whole token stream (what every scoring window is cut from)."""
    stream = token_stream(ctx.splits.calibration, ctx.tokenizer)
    return digest(stream.numel(), tensor_bytes(stream))


def selection_key(cfg, ctx, extra: dict | None = None) -> tuple[str, dict]:
    """(digest, the parts it was built from) for the scores of policy `cfg.name`."""
    data = {k: v for k, v in plain(ctx.settings.data).items() if k not in EVALUATION_ONLY}
    parts = {
        "teacher": teacher_fingerprint(ctx.teacher),
        "policy": str(cfg.name),
        "settings": {k: v for k, v in plain(cfg).items() if k not in NOT_SCORING and k != "name"},
        "data": data,
        "calibration_tokens": calibration_tokens_digest(ctx),
        **(extra or {}),
    }
    return digest(parts), parts


def score_folder(cfg, ctx) -> Path | None:
    """Where scores are cached (none with `retention.cache=false`)."""
    return ctx.cache_dir / "retention" if cfg.cache else None


def score_codec(key: str, parts: dict) -> Codec[dict[int, float]]:
    """One JSON file per key: `{"key": ..., "parts": ..., "scores": {"layer": score}}`."""
    return json_codec(lambda scores: {"key": key, "parts": parts,
                                      "scores": {str(k): v for k, v in sorted(scores.items())}},
                      lambda record: {int(k): float(v) for k, v in record["scores"].items()})


def cached_scores(cfg, ctx, score: Callable[[], dict[int, float]], extra: dict | None = None) -> dict[int, float]:
    """Per-layer scores from the cache (`tcal.cache`, kind `retention`), or from `score()` (then saved)."""
    key, parts = selection_key(cfg, ctx, extra)

    def compute() -> dict[int, float]:
        return {int(i): finite_or_inf(s) for i, s in score().items()}

    return get_or_build("retention", f"{cfg.name}-{key}", compute, folder=score_folder(cfg, ctx),
                        codec=score_codec(key, parts), ranks=ctx.ranks)


def finite_or_inf(value: float) -> float:
    """NaN perplexities (a broken model) count as infinitely bad."""
    value = float(value)
    return math.inf if math.isnan(value) else value


def top_k(scores: dict[int, float], k: int, highest: bool) -> list[int]:
    """The k layers with the highest (or lowest) scores, ties broken by the lower layer index; sorted."""
    order = sorted(scores, key=lambda i: (-scores[i] if highest else scores[i], i))
    return sorted(order[:k])


def scored_selection(cfg, ctx, score: Callable[[], dict[int, float]], highest: bool, extra: dict | None = None):
    """Keep the K best-scoring layers (cached scores); K = L keeps everything without scoring."""
    from tcal.retention import Selection, num_kept

    num_layers = ctx.num_layers
    k = num_kept(cfg.ratio, num_layers)
    if k == num_layers:
        log.info("retention %s: ratio %s keeps all %d layers; nothing to score", cfg.name, cfg.ratio, num_layers)
        return Selection(list(range(num_layers)))
    scores = cached_scores(cfg, ctx, score, extra)
    keep = top_k(scores, k, highest)
    log.info("retention %s: scores %s -> keep %s", cfg.name, {i: round(v, 2) for i, v in scores.items()}, keep)
    return Selection(keep, scores)
