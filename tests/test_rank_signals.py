"""Every signal a cluster or a terminal sends ends every rank of a multi-rank run promptly, with the record saying
which signal: sent to the job's process (SLURM, a closed terminal, Ctrl-C) or to one rank alone, at a moment drawn
anew each try (the race: a rank blocked in a collective runs no Python until it returns), and a SIGKILL of the job's
process (its ranks get SIGTERM from the kernel). No try may hang, leave a rank alive, or leave the record unmarked.

The default suite sends SIGTERM to the job and to a rank once each; `make test-slow` repeats each case 10 times."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir


RUN = ["experiment=smoke", "init=naive", "eval.num_windows=2", "logger=none", "save_student=false", "trainer=ddp",
       "stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=8192",
       "stage.eval_every_tokens=1024"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
ENDS_WITHIN_S = 60  # the job's process and its ranks, after the signal (KILL_AFTER_S and RANK_EXIT_GRACE_S are less)


def rank_pids(job: int) -> dict[int, int]:
    """{rank: pid} of the job's rank processes alive now."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        rank = next((item.split(b"=", 1)[1] for item in environ if item.startswith(b"RANK=")), None)
        if ppid == job and rank is not None and b"tcal.cli.rank" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found[int(rank)] = int(pid)
    return found


def alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def record(run_dir: Path) -> dict:
    path = run_dir / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def signal_a_training_run(tmp_path: Path, target: str, signum: int, seed: int) -> tuple[int | None, dict, list[int]]:
    """Start the 2-rank run, wait until both ranks train, wait a random moment, send `signum` to `target` (job,
    rank0, rank1); (the job's exit code or None if it hung, its record, the rank pids still alive after)."""
    run_dir = tmp_path / f"run_{target}_{signum}_{seed}"
    job = subprocess.Popen([sys.executable, "-m", "tcal.cli.app", *RUN, f"hydra.run.dir={run_dir}",
                            f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}"],
                           cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while record(run_dir).get("status") != "initialized" or len(rank_pids(job.pid)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the run ended or stalled before training"
            time.sleep(0.2)
        ranks = rank_pids(job.pid)
        time.sleep(random.Random(seed).uniform(0.0, 3.0))
        os.kill(job.pid if target == "job" else ranks[int(target[-1])], signum)
        try:
            code = job.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        end = time.monotonic() + 30
        while any(map(alive, ranks.values())) and time.monotonic() < end:
            time.sleep(0.2)
        return code, record(run_dir), [pid for pid in ranks.values() if alive(pid)]
    finally:
        if job.poll() is None:
            job.kill()
        for pid in rank_pids(job.pid).values():
            os.kill(pid, signal.SIGKILL)


def check(code, recorded: dict, left: list[int], signum: int, recorded_signal: int) -> None:
    assert code is not None, "the job's process hung"
    assert not left, f"ranks {left} still alive"
    assert recorded.get("status") in ("failed", "complete"), recorded.get("status")
    if recorded["status"] == "failed":
        name = signal.Signals(recorded_signal).name
        assert recorded["error"] == f"interrupted by {name} (signal {recorded_signal})", recorded["error"]
    if signum != signal.SIGKILL and recorded["status"] == "failed":
        assert code == 128 + recorded_signal, code


@pytest.mark.parametrize("target", ["job", "rank1"])
def test_sigterm_to_the_job_or_a_rank_ends_every_rank_and_the_record_says_so(target, tmp_path):
    code, recorded, left = signal_a_training_run(tmp_path, target, signal.SIGTERM, seed=0)
    check(code, recorded, left, signal.SIGTERM, signal.SIGTERM)


CASES = [(target, signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
         for target in ("job", "rank0", "rank1")] + [("job", signal.SIGKILL)]


@pytest.mark.slow
@pytest.mark.parametrize("target,signum", CASES, ids=[f"{t}-{s.name}" for t, s in CASES])
def test_every_signal_to_the_job_or_a_rank_ten_times(target, signum, tmp_path):
    """SIGKILL of the job's process: its ranks get SIGTERM (the parent-death signal) and record that."""
    recorded_signal = signal.SIGTERM if signum == signal.SIGKILL else signum
    for seed in range(10):
        code, recorded, left = signal_a_training_run(tmp_path, target, signum, seed)
        check(code, recorded, left, signum, recorded_signal)
