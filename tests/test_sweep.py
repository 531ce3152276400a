"""Every job of a sweep stands alone: a bad setting or a divergence fails its own job, recorded in its folder
with its error, the other jobs run, and the sweep ends with one line per failed job and exit code 1; a rerun
into the sweep's folder with another config refuses the folders holding results and leaves them as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir

from tcal.store.record import recorded_setting
from tcal.tools.report import build_report

TINY = ["experiment=smoke", "init=naive", "eval.num_windows=2", "save_student=false", "logger=none"]
ONE_STEP = ["stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=64",
            "stage.eval_every_tokens=64", "stage.lr_rest=1e-4"]


def sweep(cache: str, sweep_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`tcal -m ...` into `sweep_dir`; its summary lines (one per failed job)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", "-m", *TINY, *args, f"hydra.sweep.dir={sweep_dir}",
                           f"paths.cache_dir={cache}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    text = done.stderr.replace("\r", "\n")
    return done, [line.strip() for line in text.splitlines() if line.strip().startswith("tcal: ")]


def record(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_a_failing_job_does_not_stop_the_sweep(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done, summary = sweep(isolated_cache_dir(tmp_path / "cache"), sweep_dir, *ONE_STEP, "stage.lr_mixer=100,-1,1e-3")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout
    assert summary == [
        f"tcal: sweep job 0 failed ({sweep_dir / '0'}): Divergence: distill: perplexity on eval set 'shakespeare' is "
        f"nan at step 1 (tokens_seen 64); stopping with the last checkpoint kept",
        f"tcal: sweep job 1 failed ({sweep_dir / '1'}): configuration error: stage.lr_mixer=-1.0; expected a learning "
        f"rate > 0"]
    diverged, bad_setting, fine = (record(sweep_dir / str(i)) for i in range(3))
    assert (diverged["status"], diverged["failed_after"]) == ("failed", "initialized")
    assert diverged["curve"]["shakespeare"][0]["tokens"] == 0  # what it did before diverging
    assert bad_setting == {"schema_version": 2, "status": "failed", "failed_after": None,
                           "config": bad_setting["config"],
                           "error": "configuration error: stage.lr_mixer=-1.0; expected a learning rate > 0"}
    assert bad_setting["config"]["stage"]["lr_mixer"] == -1
    assert fine["status"] == "complete" and fine["config"]["stage"]["lr_mixer"] == 1e-3
    markdown = build_report(sweep_dir, tmp_path / "report")
    failed = markdown.split("## Failed runs")[1].split("## Incomplete runs")[0]
    assert failed.strip().splitlines() == [
        f"- `0/results.json`: {diverged['error']} (after: initialized)",
        f"- `1/results.json`: {bad_setting['error']} (after: nothing)"]
    assert "1 complete runs, 2 failed, 0 incomplete, 0 damaged." in markdown


@pytest.mark.slow
def test_a_sweep_into_a_folder_of_another_config_keeps_its_results(tmp_path):
    sweep_dir, cache = tmp_path / "sweep", isolated_cache_dir(tmp_path / "cache")
    done, summary = sweep(cache, sweep_dir, "retention.ratio=0.5,1.5")
    assert done.returncode == 1 and len(summary) == 1, done.stderr[-3000:]
    kept = (sweep_dir / "0" / "results.json").read_bytes()
    done, summary = sweep(cache, sweep_dir, "retention.ratio=0.75,1.0")
    assert done.returncode == 1, done.stderr[-3000:]
    assert summary == [f"tcal: sweep job 0 failed ({sweep_dir / '0'}): configuration error: {sweep_dir / '0'} holds a "
                       f"run of another config (retention.ratio=0.75 (that run: 0.5)); expected an empty folder or "
                       f"one of this config: pass another hydra.run.dir / hydra.sweep.dir"]
    assert (sweep_dir / "0" / "results.json").read_bytes() == kept
    replaced = record(sweep_dir / "1")  # held only a failure before any work: no result to keep
    assert replaced["status"] == "complete" and recorded_setting(replaced, "retention.ratio") == 1.0


def test_two_sweeps_into_one_folder_each_report_only_their_own_failures(tmp_path):
    """The same sweep started twice into one folder: each job is done by one of them (the other finds it held, or
    complete), and neither reports the other's refusals: both exit 0 with every job complete."""
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, "-m", "tcal.cli.app", "-m", "experiment=smoke", "init=naive,zero_gate,small_gate",
            "eval.num_windows=2", "save_student=false", f"hydra.sweep.dir={sweep_dir}",
            f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    sweeps = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [sweep.communicate(timeout=600) for sweep in sweeps]
    assert [sweep.returncode for sweep in sweeps] == [0, 0], [err[-2000:] for _, err in done]
    records = [json.loads((sweep_dir / str(job) / "results.json").read_text()) for job in range(3)]
    assert [record["status"] for record in records] == ["complete"] * 3
    assert not (sweep_dir / "failed_jobs.jsonl").exists()
