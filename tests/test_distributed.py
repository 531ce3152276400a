"""Several ranks, one result: the per-layer work split across 2 gloo processes gives one process's weights and
scores, with each layer built by one rank only; the evaluation's window shards add up to every window once, and
its sums per position bucket to one process's.

One launch per job, one decision for all ranks: a sweep of 2-rank jobs runs once, each job on fresh ranks, and a
failure on one rank of one job fails that job only (the others give their single runs' results exactly); a
refusal, a failed step or a divergence on one rank stops every rank with the same error, none left waiting.
Faults are injected in the ranks by tests/faults/sitecustomize.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import collective_cases
import pytest
import torch
from conftest import REPO, compose, isolated_cache_dir

from tcal.cli.rank import STOP_GRACE_S, free_port
from tcal.evaluate.validation import RankWindows
from tcal.pipeline import run
from tcal.runtime.distributed import Ranks, split_work

SMOKE = ("experiment=smoke", "eval.num_windows=3", "save_student=false")
GA_S2_FULL = ("retention=ga_s2", "retention.num_windows=2", "init=full")
TWO_RANKS = ("trainer=ddp", "trainer.accelerator=cpu", "logger=none")
FAULTS = Path(__file__).parent / "faults"


def read_results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def tcal(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, str]:
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "tcal.cli.app", *SMOKE, *overrides,
               f"paths.cache_dir={isolated_cache_dir(tmp_path / f'cache_{name}')}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_results(run_dir), done.stdout + done.stderr


def one_process(tmp_path: Path, name: str, *overrides: str) -> dict:
    """The one-process run of `tcal ...` (trainer=cpu), run here: the figures two ranks must give."""
    run_dir = tmp_path / name
    run(compose(*SMOKE, *overrides, f"paths.cache_dir={isolated_cache_dir(tmp_path / f'cache_{name}')}",
                "trainer=cpu"), run_dir)
    return read_results(run_dir)


def test_two_ranks_calibrate_and_score_like_one_process_each_layer_once(tmp_path):
    buckets = "eval.position_buckets=[0,16,32]"  # rank 1 repeats a window at weight 0: it must count nowhere
    one = one_process(tmp_path, "one", *GA_S2_FULL, buckets)
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


@pytest.mark.slow  # two ranks of gloo: 35-70 s; `make test-slow`
def test_two_ranks_of_batch_2_give_the_curve_of_one_process_of_batch_4(tmp_path):
    distill = ("stage=distill", "init=zero_gate", "stage.seq_len=32", "stage.max_tokens=384",
               "stage.eval_every_tokens=128")
    one = one_process(tmp_path, "one", *distill, "stage.batch_size=4")
    two, _ = tcal(tmp_path, "two", *distill, "stage.batch_size=2", "trainer=ddp")
    assert two["stages"]["distill"]["tokens_per_step"] == one["stages"]["distill"]["tokens_per_step"] == 128
    record = two["stages"]["distill"]
    assert (record["world_size"], record["steps"], record["tokens_seen"]) == (2, 3, 384)
    digests = record["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both ranks end identical
    for name, points in one["curve"].items():
        assert [p["tokens"] for p in two["curve"][name]] == [p["tokens"] for p in points] == [0, 128, 256, 384]
        assert [p["ppl"] for p in two["curve"][name]] == pytest.approx([p["ppl"] for p in points], rel=1e-5)


def tcal_with_fault(fault: dict | list | None, *args: str) -> subprocess.CompletedProcess:
    """`tcal ARGS` with `fault` (one, or a list) injected in its ranks (tests/faults/sitecustomize.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
           "TCAL_TEST_FAULT": json.dumps(fault) if fault else ""}
    return subprocess.run([sys.executable, "-m", "tcal.cli.app", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def tcal_lines(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.startswith("tcal: ")]


def without_run_specifics(record: dict) -> dict:
    """A record without what differs between two runs of one config in two places (timings, the cache folder)."""
    config = {**record["config"], "paths": {k: v for k, v in record["config"]["paths"].items() if k != "cache_dir"}}
    return {**{k: v for k, v in record.items() if k != "timings"}, "config": config}


def test_decisions_and_failures_on_one_rank_reach_every_rank(tmp_path):
    collective_cases.prepare(tmp_path)
    torch.multiprocessing.start_processes(collective_cases.run_rank, args=(2, free_port(), str(tmp_path)), nprocs=2,
                                          start_method="spawn")
    zero, one = (json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1))
    assert list(zero) == list(one) == [case.__name__ for case in collective_cases.CASES]  # no rank left early
    missing = tmp_path / "cache_1" / "key-a.json"
    assert zero == {**one, "unpicklable_failure_on_rank_1": {"raised": "RuntimeError",
                                                              "message": "NeedsTwoArguments: layer 3: out of memory"}}
    assert one == {
        "decide_value": {"returned": "decided by rank 0"},
        "decide_refusal": {"raised": "FolderInUse", "message": f"{tmp_path} holds a run of another config"},
        "refusal_on_rank_1": {"raised": "ConfigError", "message": "stage.lr_mixer=-1; expected a learning rate > 0"},
        "different_failures": {"raised": "ValueError", "message": "rank 0's failure"},  # the lowest rank's error
        "unpicklable_failure_on_rank_1": {"raised": "NeedsTwoArguments", "message": "layer 3: out of memory"},
        "entry_missing_on_rank_1": {"raised": "RuntimeError", "message": (
            f"cache demo: rank 0 read {missing} but this rank cannot (missing); the ranks of a run must share "
            f"paths.cache_dir")},
        "write_fails_on_rank_0": {"raised": "OSError", "message": "[Errno 28] No space left on device"},
        "work_after_failures": {"returned": {"1": 10, "2": 20, "3": 30}},
    }


@pytest.mark.slow
def test_a_sweep_of_two_rank_jobs_runs_once_with_fresh_ranks_per_job_and_a_rank_failure_fails_only_its_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    message = "injected: rank 1 of job 1 runs out of memory"
    fault = {"call": "tcal.student.convert:build_student", "rank": 1, "when": {"seed": 1}, "raise": "RuntimeError",
             "message": message}
    done = tcal_with_fault(fault, "-m", *SMOKE, *TWO_RANKS, "seed=0,1,2", f"hydra.sweep.dir={sweep_dir}",
                           f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    assert done.returncode == 1, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert output.count("Launching 3 jobs") == 1  # the sweep ran once, not once per rank
    assert len(re.findall(r"starting ranks 0-1 of 2 \(process group at 127\.0\.0\.1:\d+\)", output)) == 3
    assert tcal_lines(done.stderr) == [f"tcal: sweep job 1 failed ({sweep_dir / '1'}): RankFailed: rank 1: "
                                       f"RuntimeError: {message}"]
    assert sorted(path.name for path in sweep_dir.iterdir()) == ["0", "1", "2", "failed_jobs.jsonl", "multirun.yaml"]
    failed = read_results(sweep_dir / "1")
    assert (failed["status"], failed["error"]) == ("failed", f"RankFailed: rank 1: RuntimeError: {message}")
    for seed in (0, 2):
        alone, _ = tcal(tmp_path, f"alone_{seed}", *TWO_RANKS, f"seed={seed}")
        job = read_results(sweep_dir / str(seed))
        assert job["status"] == "complete"
        assert without_run_specifics(job) == without_run_specifics(alone)


STOPS = re.compile(r"^\[([\d-]+ [\d:,]+)\]\[tcal\.cli\.rank\]\[ERROR\] - rank (\d) of 2 stops: (.*)$", re.MULTILINE)


@pytest.mark.parametrize("case", ["refusal_on_rank_0", pytest.param("divergence_on_rank_1", marks=pytest.mark.slow)])
def test_a_failure_on_one_rank_stops_every_rank_with_the_same_line(tmp_path, case):
    if case == "refusal_on_rank_0":
        message = "eval.seq_len=64: injected refusal on rank 0 only"
        fault = {"call": "tcal.run:check_loaded", "rank": 0, "raise": "ConfigError", "message": message}
        args, code = (), 2
    else:
        fault = {"call": "tcal.training.stages:chunked_kd_loss", "rank": 1, "nan": True}
        args, code = ("stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=256",
                      "stage.eval_every_tokens=128"), 1
    run_dir = tmp_path / "run"
    done = tcal_with_fault(fault, *SMOKE, *TWO_RANKS, *args, f"hydra.run.dir={run_dir}",
                           f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    ended = datetime.now()
    assert done.returncode == code, done.stderr[-3000:]
    stops = {int(rank): (datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f"), line)
             for when, rank, line in STOPS.findall(done.stdout)}
    assert sorted(stops) == [0, 1], done.stdout[-3000:]
    (first, line), (_, other) = sorted(stops.values())
    assert other == line  # every rank stopped with the same error
    assert "stopping ranks" not in done.stdout + done.stderr  # each rank stopped by itself, none was killed
    assert (ended - first).total_seconds() < 60
    if case == "refusal_on_rank_0":
        assert line == f"configuration error: {message}"
        assert tcal_lines(done.stderr) == [f"tcal: configuration error: {message}"]
        assert not (run_dir / "results.json").exists()  # refused before any work
    else:
        assert re.fullmatch(r"Divergence: distill: loss is nan at step 0 \(tokens_seen \d+\); stopping with the "
                            r"last checkpoint kept", line), line
        assert tcal_lines(done.stderr) == [f"tcal: run failed: {line.removeprefix('Divergence: ')} "
                                           f"(record: {run_dir / 'results.json'})"]
        record = read_results(run_dir)
        assert (record["status"], record["error"]) == ("failed", line)


@pytest.mark.slow
def test_ranks_still_running_after_one_failed_are_stopped_and_the_record_says_why(tmp_path):
    message = "injected: rank 1 fails while rank 0 works alone"
    faults = [{"call": "tcal.init:init_student", "rank": 1, "raise": "RuntimeError", "message": message},
              {"call": "tcal.init:init_student", "rank": 0, "sleep": 900}]  # longer than the test's timeout
    run_dir = tmp_path / "run"
    done = tcal_with_fault(faults, *SMOKE, *TWO_RANKS, f"hydra.run.dir={run_dir}",
                           f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"stopping ranks [0]: still running {STOP_GRACE_S:.0f} s after rank 1 failed" in done.stdout
    assert tcal_lines(done.stderr) == [f"tcal: run failed: rank 1: RuntimeError: {message} "
                                       f"(record: {run_dir / 'results.json'})"]
    record = read_results(run_dir)  # written by rank 0 before it was stopped, marked failed by the job
    assert (record["status"], record["error"]) == ("failed", f"RankFailed: rank 1: RuntimeError: {message}")


def test_cpu_ranks_are_bounded_where_they_start(tmp_path, monkeypatch):
    """`run_ranks` called without the command line's preflight: more CPU ranks than the CPUs this process may use
    is one line before any rank process starts."""
    from tcal.cli.rank import run_ranks
    from tcal.errors import ConfigError

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(subprocess, "Popen", no_rank)
    settings = compose("experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=3")
    with pytest.raises(ConfigError, match=r"^trainer.devices=3 CPU processes with trainer.accelerator=cpu, more than "
                                          r"the 2 CPUs this process may use; expected at most 2$"):
        run_ranks(settings, tmp_path / "run", resume=False)
    assert not (tmp_path / "run").exists()
