"""One live run per folder: a run holds its folder while it works; a second run into it (the same command twice,
a requeue while the old job lives, the library's `distill` into a run's folder) is refused with one line naming
the holder and writes nothing there; a hold left by a process that died is taken over. A run waiting on a cache
entry that another live job builds says what it waits for."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import REPO, compose, isolated_cache_dir

from tcal.errors import FolderInUse
from tcal.pipeline import run
from tcal.store.cache import key_lock
from tcal.store.rerun import RUN_LOCK, holding_folder

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tcal.store.rerun import holding_folder
    from tcal.store.cache import key_lock
    hold = holding_folder if sys.argv[1] == "folder" else key_lock
    with hold(Path(sys.argv[2])):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def holder():
    """`holder(kind, path)`: a live process holding a run folder ("folder") or a cache entry ("entry")."""
    procs = []

    def start(kind: str, path: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, kind, str(path)], env={**os.environ, "PYTHONPATH": SRC},
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_run_into_a_folder_a_live_run_holds_is_refused_naming_it(holder, tmp_path):
    run_dir = tmp_path / "run"
    proc = holder("folder", run_dir)
    cfg = compose("experiment=smoke", "init=naive", f"paths.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(FolderInUse, match=rf"{run_dir} is in use by a live run: pid {proc.pid} on host \S+ \(since"):
        run(cfg, run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [RUN_LOCK]  # nothing written beside it
    with pytest.raises(FolderInUse, match=f"pid {proc.pid}"):  # the same through a resume
        run(cfg, run_dir, resume=True)


def test_the_library_s_distill_into_a_held_folder_is_refused(holder, tmp_path):
    from conftest import repo_cache_dir

    from tcal import api
    from tcal.settings import DataSettings, DistillSettings, tiny_teacher

    proc = holder("folder", tmp_path / "run")
    teacher = api.load_teacher(tiny_teacher(), repo_cache_dir())
    with pytest.raises(FolderInUse, match=f"pid {proc.pid}"):
        api.distill(api.build_student(teacher, [0, 2]), teacher, api.load_data(DataSettings()),
                    DistillSettings(batch_size=2, seq_len=32, eval_every_tokens=64), tokens=64,
                    run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("death", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_hold_left_by_a_dead_process_is_taken_over(death, holder, tmp_path, caplog):
    run_dir = tmp_path / "run"
    proc = holder("folder", run_dir)
    proc.send_signal(death)
    proc.wait()
    with caplog.at_level(logging.INFO, logger="tcal.store.locks"):
        with holding_folder(run_dir):
            held = json.loads((run_dir / RUN_LOCK).read_text())
            assert held["pid"] == os.getpid()
    if death == signal.SIGKILL:  # its claim was still written there
        assert f"taking over the stale hold of pid {proc.pid}" in caplog.text


def test_a_hold_is_released_when_the_run_ends_even_by_an_error(tmp_path):
    with pytest.raises(RuntimeError):
        with holding_folder(tmp_path):
            raise RuntimeError("crash")
    with holding_folder(tmp_path):  # free again, in this process and any other
        pass


def test_waiting_for_a_cache_entry_another_job_builds_says_what_it_waits_for(holder, tmp_path, caplog):
    entry = tmp_path / "cache" / "calibration" / "abc.safetensors"
    proc = holder("entry", entry)
    got = []
    with caplog.at_level(logging.WARNING, logger="tcal.store.cache"):
        waiter = threading.Thread(target=lambda: got.append(key_lock(entry).__enter__()))
        waiter.start()
        waiter.join(timeout=3)
        assert waiter.is_alive()  # still waiting
        assert f"cache: waiting for {entry}, being built by pid {proc.pid} on host" in caplog.text
        proc.kill()
        proc.wait()
        waiter.join(timeout=30)
    assert got == [True]


@pytest.mark.slow
def test_the_same_command_twice_refuses_the_second_while_the_first_trains(tmp_path):
    """Two `tcal` processes into one folder: the second (started while the first, paused by SIGSTOP, is mid-stage)
    exits 2 naming the first's pid; the first completes with no metrics row twice."""
    cache = isolated_cache_dir(tmp_path / "cache")
    args = [sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "init=naive", "eval.num_windows=2",
            "stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=1024",
            "stage.eval_every_tokens=256", f"paths.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in first.stdout:
        if "distill at 0 tokens" in line:
            break
    first.send_signal(signal.SIGSTOP)  # paused mid-training: alive, holding its folder, however slow the second
    try:
        second = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=600)
    finally:
        first.send_signal(signal.SIGCONT)
    first_out = first.communicate(timeout=600)[0]
    assert second.returncode == 2, second.stderr[-2000:]
    lines = [line for line in second.stderr.splitlines() if line.startswith("tcal: ")]
    assert len(lines) == 1 and f"is in use by a live run: pid {first.pid} on host" in lines[0], second.stderr[-2000:]
    assert first.returncode == 0, first_out[-2000:]
    rows = (tmp_path / "run" / "logs" / "metrics.csv").read_text().splitlines()
    assert len(rows) > 1 and len(rows) == len(set(rows))  # no row twice


def test_a_refused_second_run_announces_nothing_about_the_folder(tmp_path, capsys):
    """The second `tcal` into a live run's unfinished folder is refused before it says "continuing it"."""
    from tcal.cli.app import run_in
    from tcal.store.locks import locked
    from conftest import example_record

    settings = compose("experiment=smoke", "init=naive")
    (tmp_path / "results.json").write_text(json.dumps(example_record("initialized", config=settings.tree())))
    with locked(tmp_path / RUN_LOCK):
        with pytest.raises(FolderInUse, match=rf"^{tmp_path} is in use by a live run: pid {os.getpid()}"):
            run_in(settings, tmp_path)
    assert "continuing" not in capsys.readouterr().out


def test_save_student_on_a_complete_run_without_its_student_is_one_line(tmp_path, capsys):
    """A complete zero-shot run kept no weights: asking it again with save_student=true cannot export anything and
    says so; the same run asked without the export has nothing to do."""
    from tcal.cli.app import run_in
    from tcal.errors import ConfigError
    from conftest import example_record

    recorded = compose("experiment=smoke", "init=naive", "save_student=false")
    (tmp_path / "results.json").write_text(json.dumps(example_record("complete", config=recorded.tree())))
    with pytest.raises(ConfigError, match=rf"^{tmp_path} holds this run, complete, without its student .*"
                                          r"save_student=true has nothing to export there"):
        run_in(compose("experiment=smoke", "init=naive", "save_student=true"), tmp_path)
    run_in(recorded, tmp_path)
    assert "already holds this run, complete; nothing to do" in capsys.readouterr().out
