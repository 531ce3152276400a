"""`full_plus` (docs/method.md, section "full_plus"): the calibration pool comes from the calibration split only
and never overlaps its held-out windows; the held-out loss picks the state kept; the mode runs end to end on a tiny
teacher, same seed same layers, and its artifacts are reused. Everything is tiny: the file runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose, isolated_cache_dir, make_teacher

from tcal.data.documents import Document, Splits
from tcal.init.calibration.calibrate import ArtifactStore
from tcal.init.calibration.phase2 import LayerStack, fit_stack
from tcal.init.calibration.pool import PoolDraws, calibrate_on_pool, minibatches
from tcal.settings.init import pool_windows
from tcal.init.full_plus import full_plus_pool
from tcal.pipeline import run
from tcal.settings.schedule import lr_factor
from tcal.store.record import recorded_setting
from tcal.student.alignment import alignment_metrics
from tcal.student.convert import naive_gdn
from tcal.student.gdn import GatedDeltaNet

EOS = 99


class WordTokenizer:
    """Each whitespace-separated number is its own token id: token positions can be read off the text."""

    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(word) for word in text.split()]}


def numbers(first: int, last: int) -> str:
    return " ".join(str(i) for i in range(first, last + 1))


def calibration_seq_len(seq_len: int) -> SimpleNamespace:
    """The run config as `full_plus_pool` reads it: the window length is `calibration.seq_len`."""
    return SimpleNamespace(calibration=SimpleNamespace(seq_len=seq_len))


def pool_cfg(**phase2):
    steps = {"steps": 6, "batch_size": 2, "select_every": 2, "lr_projections": 1e-2, "lr_dynamics": 1e-2,
             "weight_decay": 0.01, "grad_clip": 1.0, "schedule": "constant", **phase2}
    return SimpleNamespace(**steps)


# ------------------------------------------------------------------ the pool


def test_pool_windows_by_hand():
    """Calibration split "1 .. 17" + EOS is 18 tokens; 8 windows of 2 sit at stride (18 - 2) // 7 = 2; every 4th
    (indices 3 and 7) is held out. Training and evaluation documents use other ids, and none of them appear."""
    splits = Splits(train=[Document("train", numbers(40, 60))], calibration=[Document("cal", numbers(1, 17))],
                    evaluation=[Document("eval", numbers(70, 90))])
    ctx = SimpleNamespace(splits=splits, tokenizer=WordTokenizer(), settings=calibration_seq_len(2))
    cfg = SimpleNamespace(pool=SimpleNamespace(tokens=16, held_out_every=4))
    pool = full_plus_pool(ctx, cfg)
    assert pool.fit.tolist() == [[1, 2], [3, 4], [5, 6], [9, 10], [11, 12], [13, 14]]
    assert pool.held_out.tolist() == [[7, 8], [15, 16]]

    draws = pool.fit[minibatches(len(pool.fit), 2, 9, torch.Generator().manual_seed(0))]
    drawn = set(draws.flatten().tolist())
    assert drawn == set(pool.fit.flatten().tolist())  # 18 draws cover all 6 fit windows: shuffled passes
    assert not drawn & set(pool.held_out.flatten().tolist())


def test_pool_needs_held_out_and_fit_windows():
    ctx = SimpleNamespace(splits=Splits([], [Document("cal", numbers(1, 17))], []), tokenizer=WordTokenizer(),
                          settings=calibration_seq_len(2))
    with pytest.raises(ValueError, match="every 9th of 8 windows"):
        full_plus_pool(ctx, SimpleNamespace(pool=SimpleNamespace(tokens=16, held_out_every=9)))


def test_longer_windows_cut_the_same_budget_into_fewer_windows():
    """Calibration split "1 .. 35" + EOS is 36 tokens. A 16-token budget is 8 windows of 2 (stride 4) or 2 windows
    of 8 (stride 28); the held-out window of each cut is the last."""
    ctx = SimpleNamespace(splits=Splits([], [Document("cal", numbers(1, 35))], []), tokenizer=WordTokenizer())
    cfg = SimpleNamespace(pool=SimpleNamespace(tokens=16, held_out_every=2))
    short = full_plus_pool(SimpleNamespace(**vars(ctx), settings=calibration_seq_len(2)), cfg)
    long = full_plus_pool(SimpleNamespace(**vars(ctx), settings=calibration_seq_len(8)), cfg)
    assert short.fit.tolist() == [[1, 2], [9, 10], [17, 18], [25, 26]]
    assert short.held_out.tolist() == [[5, 6], [13, 14], [21, 22], [29, 30]]
    assert long.fit.tolist() == [list(range(1, 9))]
    assert long.held_out.tolist() == [list(range(29, 36)) + [EOS]]
    assert short.fit.numel() + short.held_out.numel() == long.fit.numel() + long.held_out.numel() == 16
    assert pool_windows(16384, 256) == 64 and pool_windows(16384, 2048) == 8
    with pytest.raises(ValueError, match="a pool of 16 tokens does not cut into whole windows of 5 tokens"):
        pool_windows(16, 5)


def test_minibatches_are_seeded():
    def draw(seed):
        return minibatches(10, 3, 7, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    assert all(len(set(row.tolist())) == 3 for row in draw(1)[:3])  # within a pass, no window twice


def test_cosine_schedule_reaches_zero():
    factor = lr_factor("cosine", 10)
    assert [factor(0), factor(5)] == [1.0, pytest.approx(0.5)] and factor(10) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor("constant", 10)(7) == 1.0
    with pytest.raises(ValueError, match="expected one of constant, cosine"):
        lr_factor("linear", 10)


# ------------------------------------------------------------------ held-out state selection


def small_problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    gdn = GatedDeltaNet(16, 2, 8, layer_idx=0)
    x = torch.randn(8, 12, 16, generator=gen)
    target = torch.randn(8, 12, 16, generator=gen) * 0.5
    return gdn, x, target


def fit_on_pool(gdn, fit, held_out, phase2) -> dict:
    """Phase 2 of one layer on the pool `fit` = (inputs, targets), `held_out` choosing its state: a stack of one."""
    stacked = [tuple(t[None] for t in pair) for pair in (fit, held_out)]
    return fit_stack([gdn], PoolDraws(*stacked, phase2, [torch.Generator().manual_seed(0)]), phase2)[0]


def test_selection_keeps_the_held_out_best_not_the_last():
    """Planted: the held-out target is the starting layer's own output, so the starting state has held-out loss
    0 and every later state more. The fitted loss falls, yet the starting state (step 0) is the one kept."""
    gdn, x, target = small_problem()
    start = {k: v.clone() for k, v in gdn.state_dict().items()}
    with torch.no_grad():
        held = (x[:2], LayerStack([gdn]).forward(x[None, :2])[0])  # the output as the fit computes it
    record = fit_on_pool(gdn, (x[2:], target[2:]), held, pool_cfg())
    assert record["losses"][-1] < record["losses"][0]  # the fit did move the layer
    assert record["best_step"] == 0 and record["held_out_loss_after"] == 0.0
    assert all(loss > 0 for step, loss, _ in record["held_out_curve"] if step > 0)
    for key, value in start.items():
        assert torch.equal(gdn.state_dict()[key], value), key


def test_selection_keeps_the_lowest_held_out_loss():
    """The kept state's held-out loss, measured again, is the minimum of the held-out curve."""
    gdn, x, target = small_problem(1)
    held = (x[:2], target[:2])
    record = fit_on_pool(gdn, (x, target), held, pool_cfg(steps=8))
    curve = {step: loss for step, loss, _ in record["held_out_curve"]}
    assert sorted(curve) == [0, 2, 4, 6, 8]
    assert record["held_out_loss_after"] == min(curve.values()) == curve[record["best_step"]]
    assert alignment_metrics(gdn, *held)["mse"] == pytest.approx(min(curve.values()), rel=1e-6)
    assert record["held_out_loss_after"] < record["held_out_loss_before"]


def test_same_seed_same_layers():
    """Bit-identical layers from two uncached calibrations with the same seed, the second with one teacher pass
    per layer (`layers_per_pass`, which saves memory and must change nothing); another seed differs."""
    teacher = make_teacher("llama", seed=3)
    pool = SimpleNamespace(fit=torch.randint(101, (6, 16), generator=torch.Generator().manual_seed(0)),
                           held_out=torch.randint(101, (2, 16), generator=torch.Generator().manual_seed(1)))
    phase1 = compose("teacher=tiny_llama").calibration.phase1

    def layers(seed, layers_per_pass=None):
        gdns = {i: naive_gdn(teacher, i) for i in (1, 2)}
        calibrate_on_pool(teacher, gdns, pool, ["value_scale"], phase1, pool_cfg(steps=4), {}, ArtifactStore(None),
                          seed, block_size=8, layers_per_pass=layers_per_pass)
        return gdns

    first, again, other = layers(0), layers(0, layers_per_pass=1), layers(1)
    for i in (1, 2):
        for key, value in first[i].state_dict().items():
            assert torch.equal(again[i].state_dict()[key], value), (i, key)
    assert not torch.equal(first[1].q_proj.weight, other[1].q_proj.weight)


# ------------------------------------------------------------------ end to end


TINY_FULL_PLUS = ("experiment=smoke", "init=full_plus", "calibration.seq_len=32", "init.pool.tokens=512",
                  "init.phase2.steps=6", "init.phase2.select_every=3", "save_student=false")


def run_full_plus(root: Path, cache: str, name: str, *overrides: str) -> dict:
    cfg = compose(*TINY_FULL_PLUS, f"paths.cache_dir={cache}", f"paths.output_dir={root / 'outputs'}", *overrides)
    run(cfg, root / name)
    return json.loads((root / name / "results.json").read_text())


def test_full_plus_end_to_end_and_cached(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    first = run_full_plus(tmp_path, cache, "first")
    assert first["status"] == "complete" and recorded_setting(first, "init.name") == "full_plus"
    calibration = first["calibration"]
    assert calibration["pool_tokens"] == 14 * 32 and calibration["held_out_tokens"] == 2 * 32
    assert calibration["pool_seq_len"] == 32
    assert sorted(calibration["layers"]) == ["1", "3"]
    for record in calibration["layers"].values():
        assert record["cached"] is False
        assert {"gamma", "sigma"} <= set(record["phase1"])  # the recipe's rules: all four
        assert record["phase1"]["sigma"] == pytest.approx([0.1] * 4)  # pinned by the recipe's clip
        assert len(record["phase2"]["losses"]) == 6
    artifacts = list((Path(cache) / "calibration" / "tiny_llama").glob("*.safetensors"))
    assert len(artifacts) == 2

    second = run_full_plus(tmp_path, cache, "second")
    assert all(r["cached"] is True for r in second["calibration"]["layers"].values())
    assert second["metrics"] == first["metrics"]  # the reused layers are the computed ones

    changed = run_full_plus(tmp_path, cache, "changed", "init.phase1_rules=[value_scale]")
    assert all(r["cached"] is False for r in changed["calibration"]["layers"].values())
    assert all(list(r["phase1"]) == ["sigma"] for r in changed["calibration"]["layers"].values())  # those rules only
    assert len(list((Path(cache) / "calibration" / "tiny_llama").glob("*.safetensors"))) == 4


def test_full_plus_on_windows_as_long_as_the_teacher_reads(tmp_path):
    """calibration.seq_len=2048 cuts the same 4,096-token pool into one fit and one held-out window instead of 64 +
    64 of 32 tokens; the long run calibrates (its own artifacts, not the short run's) and evaluates."""
    cache = isolated_cache_dir(tmp_path / "cache")
    short = run_full_plus(tmp_path, cache, "short", "init.pool.tokens=4096", "init.pool.held_out_every=2")
    long = run_full_plus(tmp_path, cache, "long", "init.pool.tokens=4096", "init.pool.held_out_every=2",
                         "calibration.seq_len=2048", "init.phase2.batch_size=1")
    assert short["calibration"]["pool_seq_len"] == 32 and long["calibration"]["pool_seq_len"] == 2048
    for run_results in (short, long):
        calibration = run_results["calibration"]
        assert calibration["pool_tokens"] == calibration["held_out_tokens"] == 2048
        assert all(r["cached"] is False for r in calibration["layers"].values())
        assert all(len(r["phase2"]["losses"]) == 6 for r in calibration["layers"].values())
    assert long["status"] == "complete" and long["metrics"] != short["metrics"]
    assert len(list((Path(cache) / "calibration" / "tiny_llama").glob("*.safetensors"))) == 4
