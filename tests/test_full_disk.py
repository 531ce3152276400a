"""A full disk, from the first file a run writes (Hydra's log file and .hydra/*.yaml) to the last (the record's
final update): `tcal` prints one line naming the file and ENOSPC and exits with code 1, and the record either exists
and says `failed`, or the line says what it is (none written, or one its failure could not be written to). The disk
is made full for the files matching a pattern by tests/full_disk.py, in a process of its own."""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir

FULL_DISK = str(Path(__file__).resolve().parent / "full_disk.py")

# (the files the disk is full for, under the test's folder; open: creating them fails, write: writing them fails;
# how many of them are written first; the file the line names, under the test's folder)
POINTS = {
    "log_file_opened": ("run/app.log", "open", 0, "run/app.log"),
    "hydra_config": ("run/.hydra/config.yaml", "open", 0, "run/.hydra/config.yaml"),
    "hydra_overrides": ("run/.hydra/overrides.yaml", "write", 0, "run/.hydra/overrides.yaml"),
    "log_file_written": ("run/app.log", "write", 0, "run/app.log"),
    "first_record": ("run/.results.json.*", "open", 0, "run/results.json"),
    "cache_lock": ("cache/calibration/*.lock", "open", 0, "cache/calibration/*.lock"),
    "training_metrics": ("run/logs/metrics.csv", "write", 0,  # Lightning's write: its error names no file
                         "a file its error does not name (a library's write in the run {run})"),
    "last_record": ("run/.results.json.*", "write", 5, "run/results.json"),
}
SLOW = {"cache_lock", "last_record"}


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in POINTS])
def test_a_full_disk_is_one_line_exit_1_and_a_record_that_says_failed_or_none(point, tmp_path):
    pattern, when, written, named = POINTS[point]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "FULL_DISK_SKIP": str(written)}
    done = subprocess.run([sys.executable, FULL_DISK, str(tmp_path / pattern), when, "experiment=smoke",
                           "save_student=false", "hydra.run.dir=run", f"paths.cache_dir={tmp_path / 'cache'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("full_disk: ") and int(lines[-1].split()[1]) > written, done.stderr[-3000:]
    line = lines[-2]
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Logging error" not in done.stderr, \
        done.stderr[-3000:]
    head = "tcal: run failed: cannot write "
    assert line.startswith(head) and ": No space left on device (ENOSPC)" in line, line
    expected = named.format(run=tmp_path / "run") if "{run}" in named else str(tmp_path / named)
    assert fnmatch.fnmatch(line[len(head):line.index(": No space left")], expected), line
    record = tmp_path / "run" / "results.json"
    status = json.loads(record.read_text())["status"] if record.is_file() else None
    if status == "failed":
        assert line.endswith(f"(record: {record})")
    elif status is None:
        assert line.endswith(f"(no record: {record} was not written)")
    else:  # the record's own last write met the full disk
        assert line.endswith(f"(the record {record} still says {status!r}: its failure could not be written)")
