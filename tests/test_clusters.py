"""What a cluster does to a run that a laptop never does: a SLURM job with fewer tasks than the trainer's ranks, and
run or cache folders on a filesystem without file locks. Each is one line before any work."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest
from conftest import REPO, compose

from tcal.errors import ConfigError
from tcal.runtime.distributed import launch
from tcal.store import locks
from tcal.store.locks import LocksUnsupported, locked

ONE_TASK_SBATCH = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "node1",
                   "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "1"}


def test_a_one_task_sbatch_with_several_devices_is_told_what_to_run(monkeypatch):
    for key, value in ONE_TASK_SBATCH.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ConfigError, match=r"^trainer asks for 2 ranks .* this SLURM job has 1 task \(SLURM_NTASKS=1\);"
                                          r" expected one task per rank: #SBATCH --ntasks-per-node="):
        launch(compose("trainer=ddp").trainer)


def test_the_one_task_sbatch_is_one_line_from_tcal(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **ONE_TASK_SBATCH}
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "trainer=ddp",
                           f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and "this SLURM job has 1 task (SLURM_NTASKS=1)" in lines[0]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_is_named_in_one_line(code, tmp_path, monkeypatch):
    def no_locks(handle, operation):
        raise OSError(code, "no locks here")

    monkeypatch.setattr(locks.fcntl, "flock", no_locks)
    with pytest.raises(LocksUnsupported, match=rf"^{tmp_path / 'runs'}: its filesystem does not support file locks "
                                               rf"\(flock: .*\); expected run and cache folders on a filesystem with "
                                               rf"locks"):
        with locked(tmp_path / "runs" / ".lock"):
            pass
    assert isinstance(LocksUnsupported(tmp_path, OSError(code, "")), ConfigError)  # the CLI's one line, exit 2


def test_other_lock_failures_are_not_taken_for_a_filesystem_without_locks(tmp_path, monkeypatch):
    def broken(handle, operation):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(locks.fcntl, "flock", broken)
    with pytest.raises(OSError, match="input/output error") as caught:
        with locked(tmp_path / ".lock"):
            pass
    assert not isinstance(caught.value, LocksUnsupported)


def test_a_teacher_that_borrows_a_packaged_tokenizer_writes_no_teacher_weights(tmp_path):
    """The tiny teachers take SmolLM2's tokenizer from its GGUF: only the tokenizer is converted into the cache (a
    few MB), never the 517 MB of dequantized weights, and it is the tokenizer the converted teacher holds."""
    from conftest import repo_cache_dir

    from tcal.store.fingerprint import tokenizer_digest
    from tcal.teachers.load import load_tokenizer

    tokenizer = load_tokenizer(compose("teacher=tiny_llama").teacher, tmp_path)
    assert not (tmp_path / "teachers").exists()
    written = sum(p.stat().st_size for p in (tmp_path / "tokenizers").rglob("*") if p.is_file())
    assert 0 < written < 20 * 2**20
    shared = load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())
    assert tokenizer_digest(tokenizer) == tokenizer_digest(shared)
