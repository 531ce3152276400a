"""Numerical faults: degenerate calibration statistics still give finite parameters; a NaN loss in Phase 2,
Stage 1 or Stage 2, or a NaN or infinite perplexity on the curve, stops that work as a `Divergence` naming the
step and tokens (and the layer or eval set), keeps the last good checkpoint and leaves results.json "failed",
in strict JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, example_record, isolated_cache_dir, make_teacher

from tcal.errors import Divergence
from tcal.evaluate.perplexity import perplexity
from tcal.init.calibration import phase2 as phase2_module
from tcal.init.calibration.phase1 import apply_phase1
from tcal.init.calibration.stats import LayerStats, blockwise_attention, collect_teacher_stats
from tcal.pipeline import run
from tcal.store.record import write_record
from tcal.student.convert import naive_gdn
from tcal.training import stages as stages_module
from tcal.training.stages import StageModule

B, T, H, DH, D = 2, 24, 4, 16, 64


@pytest.fixture(scope="module")
def teacher():
    return make_teacher("llama")


@pytest.fixture(scope="module")
def phase1_cfg():
    return compose("experiment=smoke").calibration.phase1


def assert_finite(gdn) -> None:
    bad = [name for name, p in gdn.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite parameters: {bad}"


def stats_from(teacher, layer: int, **changes) -> LayerStats:
    """Real statistics of `layer` on random tokens, with fields replaced by degenerate values."""
    tokens = torch.randint(3, teacher.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    stats = collect_teacher_stats(teacher, tokens, layers=[layer])[layer]
    return LayerStats(**{**stats.__dict__, **changes})


def test_a_head_attending_only_to_itself_gives_the_distance_floor():
    q = torch.nn.functional.normalize(torch.randn(1, 2, 12, 8), dim=-1)
    _, dist, ent, count = blockwise_attention(q, q.clone(), torch.randn(1, 2, 12, 8), scaling=1e4)
    assert torch.allclose(dist / count, torch.full((2,), 0.5, dtype=torch.float64))
    assert torch.allclose(ent / count, torch.zeros(2, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("case", ["self_only", "below_floor", "equal_entropy", "zero_context", "constant_context"])
def test_degenerate_statistics_give_finite_parameters(case, teacher, phase1_cfg):
    changes = {
        "self_only": {"mean_distance": torch.full((H,), 0.5), "mean_entropy": torch.zeros(H)},
        "below_floor": {"mean_distance": torch.full((H,), 1e-6)},
        "equal_entropy": {"mean_entropy": torch.full((H,), 2.0)},
        "zero_context": {"context": torch.zeros(B, T, H, DH)},
        "constant_context": {"context": torch.ones(B, T, H, DH)},
    }[case]
    gdn = naive_gdn(teacher, 1)
    record = apply_phase1(gdn, stats_from(teacher, 1, **changes), phase1_cfg)
    assert_finite(gdn)
    assert all(torch.isfinite(torch.tensor(record[k])).all() for k in ("gamma", "beta_target", "sigma", "alpha"))
    if case == "below_floor":
        assert record["gamma"] == pytest.approx([phase1_cfg.gamma_max] * H)  # clipped, not infinite
    if case == "equal_entropy":
        assert record["beta_target"] == pytest.approx([phase1_cfg.beta_low + phase1_cfg.beta_span] * H)


@pytest.mark.parametrize("padded_rows", [1, 2], ids=["one_all_padding_sequence", "all_padding"])
def test_all_padding_sequences_give_finite_statistics_and_parameters(padded_rows, teacher, phase1_cfg):
    tokens = torch.randint(3, teacher.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:padded_rows] = 0
    stats = collect_teacher_stats(teacher, tokens, attention_mask=mask, layers=[1])[1]
    for field in ("mean_distance", "mean_entropy", "inputs", "context", "attn_output"):
        assert torch.isfinite(getattr(stats, field)).all(), field
    gdn = naive_gdn(teacher, 1)
    apply_phase1(gdn, stats, phase1_cfg, mask)
    assert_finite(gdn)


# ----------------------------------------------------------------------------------------------------------
# A NaN loss stops the work


def nan_after(real, calls: int):
    """`real`, except that its loss is NaN from call number `calls` on."""
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        count["n"] += 1
        out = real(*args, **kwargs)
        if count["n"] < calls:
            return out
        return (out[0] * float("nan"), out[1]) if isinstance(out, tuple) else out * float("nan")

    return wrapped


@pytest.mark.parametrize("fit", ["batched", "sequential"])
def test_nan_in_phase2_names_layer_step_and_tokens(fit, tmp_path, monkeypatch):
    """The third loss of the first layer's fit is NaN (the batched fit reads its losses every few steps, and still
    names the first bad step)."""
    monkeypatch.setattr(phase2_module, "stack_losses", nan_after(phase2_module.stack_losses, 3))
    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=phase2",
                  f"calibration.fit={fit}")
    with pytest.raises(Divergence, match=r"phase 2: alignment loss of layer 1 is nan at step 2 "
                                         r"\(128 calibration tokens\)"):
        run(cfg, tmp_path / "run")
    results = read_strict(tmp_path / "run")
    assert (results["status"], results["failed_after"]) == ("failed", "converted")  # nothing of the failed init
    assert "calibration" not in results and "alignment loss of layer 1 is nan at step 2" in results["error"]
    assert not list((tmp_path / "cache" / "calibration").rglob("*.safetensors"))  # no artifact of a failed layer


@pytest.mark.parametrize("kind,target,match", [
    ("align", "alignment_loss", r"align: alignment loss of layer 1 is nan at step 4 \(tokens_seen 320\)"),
    ("distill", "chunked_kd_loss", r"distill: loss is nan at step 4 \(tokens_seen 320\)"),
])
def test_nan_in_a_stage_stops_it_keeping_checkpoint_and_results(kind, target, match, tmp_path, monkeypatch):
    calls_per_step = 2 if kind == "align" else 1  # align: one loss per GDN layer (1 and 3)
    monkeypatch.setattr(stages_module, target, nan_after(getattr(stages_module, target), 4 * calls_per_step + 1))
    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=zero_gate",
                  "eval.num_windows=2", f"stage={kind}", "stage.batch_size=2", "stage.seq_len=32",
                  "stage.max_tokens=640", "stage.eval_every_tokens=192", *(["stage.cache=false"] if kind == "align" else []))
    with pytest.raises(Divergence, match=match):
        run(cfg, tmp_path / "run")
    results = read_strict(tmp_path / "run")
    assert (results["status"], results["failed_after"]) == ("failed", "initialized")
    assert [p["tokens"] for p in results["curve"]["shakespeare"]] == [0, 192]  # the points before the fault
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / kind / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["tcal"]["tokens_seen"] == 192
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values())


def read_strict(run_dir: Path) -> dict:
    """results.json read as strict JSON: a NaN or Infinity token fails."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads((run_dir / "results.json").read_text(), parse_constant=refuse)


def distill_cfg(tmp_path: Path, *overrides: str):
    return compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=zero_gate",
                   "eval.num_windows=2", "stage=distill", "stage.batch_size=2", "stage.seq_len=32", *overrides)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_perplexity_stops_the_stage_naming_the_eval_set(value, tmp_path, monkeypatch):
    real = StageModule.on_perplexities
    calls = {"n": 0}

    def poisoned(module, ppl):
        calls["n"] += 1
        return real(module, ppl if calls["n"] < 3 else {name: value for name in ppl})

    monkeypatch.setattr(StageModule, "on_perplexities", poisoned)
    cfg = distill_cfg(tmp_path, "stage.max_tokens=640", "stage.eval_every_tokens=192")
    with pytest.raises(Divergence, match=rf"distill: perplexity on eval set 'shakespeare' is {value} at step 6 "
                                         rf"\(tokens_seen 384\); stopping with the last checkpoint kept"):
        run(cfg, tmp_path / "run")
    results = read_strict(tmp_path / "run")
    assert (results["status"], results["failed_after"]) == ("failed", "initialized")
    assert [p["tokens"] for p in results["curve"]["shakespeare"]] == [0, 192]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "distill" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 and checkpoint["tcal"]["tokens_seen"] == 192  # the last good one


def test_perplexity_of_a_diverged_model_is_infinite_not_an_error():
    class Certain(torch.nn.Module):
        """Puts all its mass on token 0, and the windows never hold it: an NLL far beyond exp's range."""

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=False):
            logits = torch.full((*input_ids.shape, 8), -1e6)
            logits[..., 0] = 1e6
            return type("Out", (), {"logits": logits})

    assert perplexity(Certain(), torch.randint(1, 8, (2, 6))) == math.inf


def test_results_hold_no_nan_tokens(tmp_path):
    results = example_record(metrics={"a": {"student_ppl": math.nan, "teacher_ppl": 3.5}},
                             curve={"a": [{"tokens": 0, "ppl": math.inf}]})
    write_record(tmp_path / "results.json", results)
    assert read_strict(tmp_path) == results  # what is returned is what is written
    assert results["metrics"]["a"] == {"student_ppl": None, "teacher_ppl": 3.5}
    assert results["non_finite"] == {"note": "NaN or infinite values, written as null",
                                     "values": ["metrics.a.student_ppl=nan", "curve.a[0].ppl=inf"]}


def test_learning_rate_100_fails_with_one_line_and_a_failed_record(tmp_path):
    """One step at learning rate 100 (the weights leave float range) ends the run "failed", not "complete"."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "init=naive", "stage=distill",
                           "stage.max_tokens=64", "stage.eval_every_tokens=64", "stage.batch_size=2", "stage.seq_len=32",
                           "stage.lr_mixer=100", "stage.lr_rest=100", "eval.num_windows=2", "logger=none",
                           f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", f"hydra.run.dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("tcal: ")]
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert lines == [f"tcal: run failed: distill: perplexity on eval set 'shakespeare' is nan at step 1 (tokens_seen "
                     f"64); stopping with the last checkpoint kept (record: {run_dir / 'results.json'})"]
    results = read_strict(run_dir)
    assert (results["status"], results["failed_after"]) == ("failed", "initialized") and "metrics" not in results
    assert results["error"] == "Divergence: " + lines[0].removeprefix("tcal: run failed: ").split(" (record: ")[0]
