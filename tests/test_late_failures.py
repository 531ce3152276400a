"""Failures come before the work, or as one line naming the path and the cause: settings that used to pass every
check and fail after the work (trainer.devices=0, a seed beyond 64 bits, Stage 1 with every layer kept), a file
where a folder is expected, a cache disk that fills up during the run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import compose, isolated_cache_dir

from tcal.cli.app import check_arguments
from tcal.errors import ConfigError
from tcal.pipeline import run
from tcal.preflight import check_machine
from tcal.settings import derived_seed
from tcal.store.files import WriteFailed, WriteRefused
from tcal.student.convert import layer_generator

SMOKE = ("experiment=smoke", "init=naive", "eval.num_windows=2", "logger=none")


@pytest.mark.parametrize("override,match", [
    ("trainer.devices=0", r"trainer.devices=0; expected a number of devices >= 1"),
    ("trainer.devices=-2", r"trainer.devices=-2"),
    ("trainer.devices=[]", r"trainer.devices=\[\]"),
    ("trainer.devices=[0,0]", r"trainer.devices=\[0, 0\]"),
    ("trainer.devices='0'", r"trainer.devices='0'"),
    ("trainer.num_nodes=0", r"trainer.num_nodes=0"),
    ("seed=18446744073709551616", r"seed=18446744073709551616; expected an integer in \[0, 2\*\*64\)"),
    ("seed=-1", r"seed=-1"),
], ids=lambda value: value if isinstance(value, str) and "=" in value else None)
def test_settings_that_used_to_fail_after_the_work_fail_before_it(override, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        check_machine(compose(*SMOKE, override, f"paths.cache_dir={tmp_path}"))


@pytest.mark.parametrize("overrides", [
    ("stage=align", "retention.ratio=1.0"),
    ("stage=align_distill", "retention.ratio=0.9"),  # round(0.9 x 4) = 4
    ("stage=align", "retention=explicit", "retention.keep=[0,1,2,3]"),
], ids=["align_ratio_1", "align_distill_ratio_0.9", "align_explicit_all"])
def test_stage1_with_no_layer_left_to_align_is_refused_before_work(overrides, tmp_path):
    with pytest.raises(ConfigError, match=r"Stage 1 aligns the converted layers, but .* keeps all 4 layers"):
        check_machine(compose(*SMOKE, *overrides, f"paths.cache_dir={tmp_path}"))
    check_machine(compose(*SMOKE, "stage=distill", "retention.ratio=1.0", f"paths.cache_dir={tmp_path}"))


def test_every_64_bit_seed_gives_a_generator_and_small_seeds_keep_their_streams():
    for seed in (0, 7, 2 ** 44, 2 ** 63, 2 ** 64 - 1):
        layer_generator(seed, 31).initial_seed()  # torch refuses seeds outside [0, 2**64)
    assert derived_seed(12345, 100_003, 7) == 12345 * 100_003 + 7
    assert layer_generator(5, 3).initial_seed() == 5 * 100_003 + 3


@pytest.mark.parametrize("key", ["hydra.run.dir", "paths.output_dir", "hydra.sweep.dir"])
def test_a_file_where_an_output_folder_should_be_is_one_error_before_hydra(key, tmp_path):
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(ConfigError, match=rf"{key}='{tmp_path / 'runs' / 'x'}': {tmp_path / 'runs'} is a file; "
                                          r"expected a folder"):
        check_arguments(["experiment=smoke", f"{key}={tmp_path / 'runs' / 'x'}"])


def test_a_resume_given_a_file_is_named(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a file; expected a run folder"):
        check_arguments([f"resume={tmp_path / 'results.json'}"])


def test_a_student_path_taken_by_a_file_or_foreign_folder_is_refused_before_work(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "student").write_text("a file")
    with pytest.raises(WriteRefused, match="is a file; expected a folder"):
        run(compose(*SMOKE, f"paths.cache_dir={cache}"), tmp_path / "run")
    (tmp_path / "run" / "student").unlink()
    (tmp_path / "run" / "student").mkdir()
    (tmp_path / "run" / "student" / "notes.txt").write_text("mine")
    with pytest.raises(WriteRefused, match=r"holds files tcal did not write \(notes.txt\)"):
        run(compose(*SMOKE, f"paths.cache_dir={cache}"), tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["student"]  # no record, no hold left


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 256 kB tmpfs filled to the last byte (root only)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the full-disk test does not run here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_full_cache_disk_is_one_error_naming_the_entry_and_the_record_says_so(full_tmpfs, tmp_path):
    cache = Path(isolated_cache_dir(full_tmpfs / "cache"))
    fill(full_tmpfs)
    with pytest.raises(WriteFailed, match=rf"cannot write {cache}/\S+: No space left on device \(ENOSPC\)"):
        run(compose(*SMOKE, f"paths.cache_dir={cache}"), tmp_path / "run")
    record = json.loads((tmp_path / "run" / "results.json").read_text())  # the run dir is on another disk
    assert (record["status"], record["failed_after"]) == ("failed", "initialized")
    assert "No space left on device" in record["error"] and str(cache) in record["error"]
