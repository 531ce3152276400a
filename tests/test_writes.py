"""Writes never destroy: an export replaces only a folder tcal wrote (a user's file in the way is refused, naming
it, and kept), never the working folder; a write killed midway leaves the previous file or folder whole and its
temporary sibling is removed by the next write; a checkpoint on another filesystem than the temporary folder
(a small tmpfs) is written beside itself, so a full disk leaves the previous checkpoint whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_teacher

from tcal import api
from tcal.store.files import (
    MANIFEST,
    WriteFailed,
    WriteRefused,
    atomic_checkpoint_io,
    write_folder_atomic,
    write_text_atomic,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


class Tokenizer:
    """Stands in for a tokenizer: `save_pretrained` writes one file."""

    def save_pretrained(self, folder):
        (Path(folder) / "tokenizer.json").write_text("{}")


@pytest.fixture(scope="module")
def student():
    return api.build_student(make_teacher("llama", num_hidden_layers=2), [0])


def exported(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("foreign", ["notes.txt", "sub/data.csv", "model.safetensors"])
def test_an_export_into_a_folder_holding_other_files_is_refused_and_keeps_them(foreign, student, tmp_path):
    folder = tmp_path / "myproject"
    (folder / foreign).parent.mkdir(parents=True, exist_ok=True)
    (folder / foreign).write_text("mine")
    with pytest.raises(WriteRefused, match=rf"{folder} holds files tcal did not write \({foreign}\)"):
        api.save(student, Tokenizer(), folder)
    assert exported(folder) == {foreign} and (folder / foreign).read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myproject"]  # no temporary folder left


def test_an_export_replaces_its_own_folder_but_not_a_file_added_to_it(student, tmp_path):
    folder = tmp_path / "student"
    api.save(student, Tokenizer(), folder)
    first = exported(folder)
    assert MANIFEST in first and "model.safetensors" in first
    (folder / "old_shard.bin").unlink(missing_ok=True)
    api.save(student, Tokenizer(), folder)  # its own export: replaced whole
    assert exported(folder) == first
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(WriteRefused, match="notes.txt"):
        api.save(student, Tokenizer(), folder)
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", [".", "..", "cwd_absolute"])
def test_an_export_into_the_working_folder_is_refused_and_deletes_nothing(where, student, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print()")
    monkeypatch.chdir(work)
    target = str(work) if where == "cwd_absolute" else where
    with pytest.raises(WriteRefused):
        api.save(student, Tokenizer(), target)
    assert (work / "train.py").read_text() == "print()"
    assert sorted(p.name for p in work.iterdir()) == ["train.py"]


def test_a_file_where_a_folder_should_be_is_named(student, tmp_path):
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(WriteRefused, match=rf"{tmp_path / 'runs'} is a file; expected a folder"):
        api.save(student, Tokenizer(), tmp_path / "runs" / "student")
    with pytest.raises(WriteRefused, match="is a file; expected a folder"):
        write_text_atomic(tmp_path / "runs" / "results.json", "{}")
    (tmp_path / "results.json").mkdir()
    with pytest.raises(WriteRefused, match="is a folder; expected a file"):
        write_text_atomic(tmp_path / "results.json", "{}")


KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from tcal.store.files import write_atomic, write_folder_atomic

    def half_then_killed(tmp):
        tmp = Path(tmp)
        if tmp.is_dir():
            (tmp / "model.safetensors").write_text("half")
        else:
            tmp.write_text("half")
        os.kill(os.getpid(), signal.SIGKILL)

    target = Path(sys.argv[2])
    (write_folder_atomic if sys.argv[1] == "folder" else write_atomic)(target, half_then_killed)
""")


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_killed_write_keeps_the_previous_content_and_the_next_write_cleans_up(kind, tmp_path):
    target = tmp_path / ("student" if kind == "folder" else "results.json")
    if kind == "folder":
        write_folder_atomic(target, lambda tmp: (tmp / "model.safetensors").write_text("first"))
    else:
        write_text_atomic(target, "first")
    done = subprocess.run([sys.executable, "-c", KILLED_WRITE, kind, str(target)], env={**os.environ,
                          "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    stray = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stray) == 1  # what the killed writer left
    content = (target / "model.safetensors") if kind == "folder" else target
    assert content.read_text() == "first"
    if kind == "folder":
        write_folder_atomic(target, lambda tmp: (tmp / "model.safetensors").write_text("second"))
    else:
        write_text_atomic(target, "second")
    assert content.read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_replace_killed_between_its_two_renames_is_undone_by_the_next_write(tmp_path):
    """The old export moved aside (`.old`) by a writer that died before the new one took its place is put back."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket
    aside = tmp_path / f".student.tcal-{socket.gethostname()}-{dead.pid}-abc123.old"
    write_folder_atomic(aside, lambda tmp: (tmp / "model.safetensors").write_text("first"))
    from tcal.store.files import clean_stale
    clean_stale(tmp_path / "student")
    assert (tmp_path / "student" / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


def test_a_live_writer_s_temporary_file_is_left_alone(tmp_path):
    import socket
    live = tmp_path / f".results.json.tcal-{socket.gethostname()}-{os.getppid()}-abc123.tmp"
    live.write_text("a parallel job writing")
    write_text_atomic(tmp_path / "results.json", "{}")
    assert live.read_text() == "a parallel job writing"


# ---------------------------------------------------------------------------------------------------------------
# A second filesystem: a small tmpfs


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, another filesystem than the system's temporary folder (root only)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the checkpoint write on a second filesystem is not tested here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def checkpoint(numbers: int) -> dict:
    return {"state_dict": {"w": torch.arange(numbers, dtype=torch.float32)}, "global_step": numbers}


def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_whole(small_tmpfs):
    io = atomic_checkpoint_io()()
    path = small_tmpfs / "checkpoints" / "distill" / "last.ckpt"
    io.save_checkpoint(checkpoint(50_000), path)  # 200 kB of a 1 MiB disk
    before = path.read_bytes()
    with pytest.raises(WriteFailed, match=rf"cannot write {path}: No space left on device \(ENOSPC\)"):
        io.save_checkpoint(checkpoint(400_000), path)  # 1.6 MB: the disk fills midway
    assert path.read_bytes() == before
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], checkpoint(50_000)["state_dict"]["w"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_an_export_that_does_not_fit_leaves_the_previous_one_whole(small_tmpfs):
    folder = small_tmpfs / "student"
    write_folder_atomic(folder, lambda tmp: (tmp / "model.safetensors").write_bytes(b"1" * 300_000))
    with pytest.raises(WriteFailed, match=rf"cannot write {folder}: No space left on device"):
        write_folder_atomic(folder, lambda tmp: (tmp / "model.safetensors").write_bytes(b"2" * 900_000))
    assert (folder / "model.safetensors").read_bytes() == b"1" * 300_000
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["student"]


def test_the_trainer_writes_checkpoints_with_the_atomic_io(tmp_path):
    """make_trainer's checkpoints go through `atomic_checkpoint_io` (not Lightning's temporary-folder copy)."""
    from types import SimpleNamespace

    from tcal.settings import TrainerSettings
    from tcal.training.run import make_trainer

    plan = SimpleNamespace(kind="distill", total_steps=1, eval_every_steps=1, settings=SimpleNamespace(grad_clip=1.0))
    trainer = make_trainer(TrainerSettings(), plan, tmp_path, None, [])
    assert isinstance(trainer.strategy.checkpoint_io, atomic_checkpoint_io())


@pytest.mark.parametrize("raised", [
    Exception("No space left on device (os error 28)"),  # the tokenizers library's writer
    RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors'
])
def test_a_library_s_full_disk_is_one_write_failure_naming_the_path(raised, tmp_path):
    """Libraries with Rust writers report a full disk as their own exception with the OS error in its text: it is a
    WriteFailed naming the path and ENOSPC (one line from `tcal`), and the target keeps its content."""
    from tcal.store.files import WriteFailed, write_atomic, write_folder_atomic

    def full(tmp):
        raise raised

    (tmp_path / "entry.bin").write_bytes(b"kept")
    with pytest.raises(WriteFailed, match=rf"^cannot write {tmp_path / 'entry.bin'}: No space left on device "
                                          r"\(ENOSPC\); the previous content is kept$"):
        write_atomic(tmp_path / "entry.bin", full)
    assert (tmp_path / "entry.bin").read_bytes() == b"kept"
    with pytest.raises(WriteFailed, match=r"No space left on device \(ENOSPC\)"):
        write_folder_atomic(tmp_path / "folder", full, replace=False)
    assert not (tmp_path / "folder").exists()
    with pytest.raises(ValueError, match="not a disk"):  # other errors pass as they are
        write_atomic(tmp_path / "other.bin", lambda tmp: (_ for _ in ()).throw(ValueError("not a disk")))
