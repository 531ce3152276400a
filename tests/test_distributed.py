"""Several ranks, one result: the per-layer work split across 2 gloo processes gives one process's weights and
scores, with each layer built by one rank only; the evaluation's window shards add up to every window once, and
its sums per position bucket to one process's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import isolated_cache_dir

from tcal.app import CONF_DIR
from tcal.distributed import Ranks, split_work
from tcal.evaluate.validation import RankWindows

SMOKE = ("experiment=smoke", "eval.num_windows=3", "save_student=false")
GA_S2_FULL = ("retention=ga_s2", "retention.num_windows=2", "init=full")


def read_results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def tcal(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, str]:
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "tcal.app", *SMOKE, *overrides,
               f"paths.cache_dir={isolated_cache_dir(tmp_path / f'cache_{name}')}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=Path(CONF_DIR).parent, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_results(run_dir), done.stdout + done.stderr


def test_two_ranks_calibrate_and_score_like_one_process_each_layer_once(tmp_path):
    buckets = "eval.position_buckets=[0,16,32]"  # rank 1 repeats a window at weight 0: it must count nowhere
    one, _ = tcal(tmp_path, "one", *GA_S2_FULL, buckets, "trainer=cpu")
    two, log = tcal(tmp_path, "two", *GA_S2_FULL, buckets, "trainer=ddp")
    assert two["init_weights_digest"] == one["init_weights_digest"]
    assert two["retention_scores"] == pytest.approx(one["retention_scores"], rel=1e-6)
    assert two["keep_layers"] == one["keep_layers"]
    shares = {int(rank): eval(layers) for rank, layers in
              re.findall(r"rank (\d) of 2 calibrates layers (\[[\d, ]*\])", log)}
    assert sorted(shares) == [0, 1]  # GA-S2 calibrated every layer, split over both ranks
    built = shares[0] + shares[1]
    assert sorted(built) == list(range(4)) and not set(shares[0]) & set(shares[1])
    for name, metrics in one["metrics"].items():
        assert two["metrics"][name]["student_ppl"] == pytest.approx(metrics["student_ppl"], rel=1e-6)
        for bucket, other in zip(metrics["by_position"], two["metrics"][name]["by_position"], strict=True):
            assert other["tokens"] == bucket["tokens"]
            for role in ("teacher_ppl", "student_ppl"):
                assert other[role] == pytest.approx(bucket[role], rel=1e-6)


@pytest.mark.parametrize("num_windows,world", [(5, 2), (4, 2), (3, 4), (1, 3)])
def test_rank_windows_cover_every_window_once_with_equal_lengths(num_windows, world):
    windows = torch.arange(num_windows)[:, None].repeat(1, 3)
    shards = [RankWindows(windows, rank, world) for rank in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of batches
    weighted = [(int(w[0]), float(weight)) for s in shards for w, weight in (s[i] for i in range(len(s)))]
    counted = sorted(w for w, weight in weighted if weight == 1.0)
    assert counted == list(range(num_windows))
    assert all(weight in (0.0, 1.0) for _, weight in weighted)


def test_split_work_on_one_rank_computes_every_item():
    assert split_work(Ranks(), [3, 1, 2], lambda i: i * 10) == {3: 30, 1: 10, 2: 20}
    assert Ranks(1, 3).share(range(7)) == [1, 4]


def test_two_ranks_of_batch_2_give_the_curve_of_one_process_of_batch_4(tmp_path):
    distill = ("stage=distill", "init=zero_gate", "stage.seq_len=32", "stage.max_tokens=384",
               "stage.eval_every_tokens=128")
    one, _ = tcal(tmp_path, "one", *distill, "stage.batch_size=4", "trainer=cpu")
    two, _ = tcal(tmp_path, "two", *distill, "stage.batch_size=2", "trainer=ddp")
    assert two["stages"]["distill"]["tokens_per_step"] == one["stages"]["distill"]["tokens_per_step"] == 128
    for name, points in one["curve"].items():
        assert [p["tokens"] for p in two["curve"][name]] == [p["tokens"] for p in points] == [0, 128, 256, 384]
        assert [p["ppl"] for p in two["curve"][name]] == pytest.approx([p["ppl"] for p in points], rel=1e-5)
