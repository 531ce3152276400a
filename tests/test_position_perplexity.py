"""Perplexity by position bucket: the bucket sums against a plain full-logits reference, the overall figure kept
through Lightning validation, and `metrics.<eval set>.by_position` in a smoke run's results.json."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, compose, isolated_cache_dir, make_teacher

from tcal.evaluate import perplexity as perplexity_module
from tcal.evaluate.perplexity import nll_sums, perplexity, position_nll_sums, token_nll
from tcal.evaluate.validation import validate_windows
from tcal.runtime.distributed import Ranks


def _windows(count: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))


def _combined_ppl(buckets: list[dict], key: str = "ppl") -> float:
    """The perplexity of all the buckets' tokens together, from each bucket's perplexity and token count."""
    tokens = sum(b["tokens"] for b in buckets)
    return math.exp(sum(b["tokens"] * math.log(b[key]) for b in buckets) / tokens)


def test_bucket_sums_match_a_full_logits_reference(monkeypatch):
    """Chunked NLL rows cut across windows (7 rows a chunk); window 2 has weight 0 (a padding repeat)."""
    monkeypatch.setattr(perplexity_module, "NLL_CHUNK_ROWS", 7)
    model = make_teacher("llama")
    windows, weights = _windows(3, 30), torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    starts = (0, 5, 12)
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=windows).logits.double(), -1)
    reference = torch.zeros(len(starts), 2, dtype=torch.float64)
    for row in range(2):
        for position in range(1, 30):  # the predicted token's position; token 0 is never predicted
            bucket = max(i for i, start in enumerate(starts) if start <= position)
            reference[bucket, 0] -= logp[row, position - 1, windows[row, position]]
            reference[bucket, 1] += 1
    nll = token_nll(model, windows)
    sums = position_nll_sums(nll, starts, weights)
    assert sums[:, 1].tolist() == [8.0, 14.0, 36.0]  # positions 1-4, 5-11, 12-29 of two windows
    torch.testing.assert_close(sums, reference, rtol=1e-5, atol=0)
    total, count = nll_sums(nll, weights)
    assert float(sums[:, 1].sum()) == float(count)
    assert math.isclose(float(sums[:, 0].sum()), float(total), rel_tol=1e-12)


def test_validation_by_position_keeps_the_overall_perplexity():
    """Through Lightning validation with buckets: the overall perplexity is the plain one, and the buckets'
    tokens together give it back; a bucket past the window's end is left out."""
    model = make_teacher("llama")
    eval_windows = {"a": _windows(5, 24, seed=1), "b": _windows(3, 24, seed=2)}
    trainer = compose("experiment=smoke").trainer
    plain = validate_windows(model, eval_windows, 2, trainer, Ranks())
    done = validate_windows(model, eval_windows, 2, trainer, Ranks(), position_buckets=[0, 8, 20, 40])
    assert plain.by_position == {}
    for name, windows in eval_windows.items():
        expected = perplexity(model, windows, batch_size=2)
        assert math.isclose(done.perplexities[name], expected, rel_tol=1e-6)
        assert math.isclose(plain.perplexities[name], expected, rel_tol=1e-6)
        buckets = done.by_position[name]
        assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [
            (0, 8, 7 * len(windows)), (8, 20, 12 * len(windows)), (20, 24, 4 * len(windows))]
        assert math.isclose(_combined_ppl(buckets), expected, rel_tol=1e-9)


@pytest.fixture(scope="module")
def smoke_by_position(tmp_path_factory):
    from tcal.pipeline import run

    root = tmp_path_factory.mktemp("by_position")
    cfg = compose("experiment=smoke", "init=naive", "eval.position_buckets=[0,16,32]",
                  f"paths.cache_dir={isolated_cache_dir(root / 'cache')}", f"paths.output_dir={root / 'outputs'}")
    run(cfg, root / "run")
    return root, json.loads((root / "run" / "results.json").read_text())


def test_smoke_run_writes_perplexity_by_position(smoke_by_position):
    root, results = smoke_by_position
    metrics = results["metrics"]["shakespeare"]
    buckets = metrics["by_position"]
    windows = 4  # experiment=smoke: 4 windows of 64 tokens
    assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [(0, 16, 15 * windows), (16, 32, 16 * windows),
                                                                      (32, 64, 32 * windows)]
    for role in ("teacher", "student"):
        assert math.isclose(_combined_ppl(buckets, f"{role}_ppl"), metrics[f"{role}_ppl"], rel_tol=1e-9)
    assert list((root / "cache" / "teacher_eval").glob("ppl_by_position-*.json"))  # the teacher's, cached
