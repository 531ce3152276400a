"""Crash safety: every cache entry is one file written whole; a truncated or foreign
entry is rebuilt with a warning, never trusted and never a crash; (slow) a sweep of 8 parallel `tcal`
processes sharing one cache directory builds every entry once and leaves it whole and readable. The cache's own
rules, entry by entry, are tested in test_cache.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, isolated_cache_dir
from safetensors.torch import save_file

from tcal.pipeline import run
from tcal.store.cache import get_or_build, load_json, load_tensors, save_json, save_tensors
from tcal.store.files import write_folder_atomic

# the kinds of cache entry, each in its folder under paths.cache_dir (the token store's damaged shards are prepared
# again: tests/test_token_store.py)
KINDS = ("calibration", "retention", "teacher_eval", "stage1")


def entries(cache: Path) -> dict[str, list[Path]]:
    """Every cache entry file by kind (the converted teacher, a symlink, is not an entry; nor are lock files)."""
    return {kind: sorted(p for p in (cache / kind).rglob("*") if p.is_file() and p.suffix != ".lock")
            for kind in KINDS}


def readable(path: Path) -> bool:
    """Whether the entry at `path` reads whole under its own key."""
    try:
        (load_json if path.suffix == ".json" else load_tensors)(path, path.name.split(".")[0])
    except Exception:  # noqa: BLE001
        return False
    return True



# ----------------------------------------------------------------------------------------------------------
# Every kind of cache entry, truncated or foreign, in a real run


def every_cache_cfg(cache: str):
    """A smoke run that fills the four caches of entries: AR scores, calibration artifacts, teacher perplexity and
    the Stage 1 result."""
    return compose("experiment=smoke", f"paths.cache_dir={cache}", "init=full", "retention=ar", "retention.seq_len=32",
                   "retention.num_windows=2", "retention.batch_size=2", "eval.num_windows=2", "stage=align",
                   "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=128",
                   "save_student=false", "logger=none")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def make_foreign(path: Path) -> None:
    if path.suffix == ".json":
        path.write_text(json.dumps({"something": "else"}))
    else:
        save_file({"x": torch.zeros(2)}, str(path))


SAME = ("keep_layers", "retention_scores", "metrics", "curve", "calibration")


def comparable(results: dict) -> dict:
    """What must not change when a cache is rebuilt (the `cached` flags of the records aside)."""
    text = json.dumps({k: results[k] for k in SAME}).replace('"cached": true', '"cached": false')
    return json.loads(text)


@pytest.mark.parametrize("damage", [truncate, pytest.param(make_foreign, marks=pytest.mark.slow)],
                         ids=["truncated", "foreign"])
def test_damaged_cache_entries_are_rebuilt_with_a_warning(damage, tmp_path, caplog):
    cache = Path(isolated_cache_dir(tmp_path / "cache"))
    first = run(every_cache_cfg(str(cache)), tmp_path / "first")
    written = entries(cache)
    assert all(written.values()), {k: len(v) for k, v in written.items()}
    for path in (p for paths in written.values() for p in paths):
        damage(path)
    with caplog.at_level(logging.WARNING):
        again = run(every_cache_cfg(str(cache)), tmp_path / "again")
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for kind in KINDS:
        assert all(f"cache {kind}: {p} " in warned for p in written[kind]), kind
    assert comparable(again) == comparable(first)
    assert entries(cache) == written  # rebuilt in place: one file per key, no temporary files
    assert all(readable(p) for paths in entries(cache).values() for p in paths)


# ----------------------------------------------------------------------------------------------------------
# Load: 8 parallel processes on one cache


ALIGN = ["stage=align", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=128"]
SWEEP = [[f"init={init}", *stage] for init in ("naive", "phase1", "phase2", "full") for stage in ([], ALIGN)]
TINY = ["experiment=smoke", "retention=ar", "retention.seq_len=32", "retention.num_windows=2", "retention.batch_size=2",
        "eval.num_windows=2", "save_student=false", "logger=none"]


def builds(log_files: list[Path]) -> dict[str, int]:
    """How often each cache entry was built, from the jobs' logs (`cache <kind>: built <key>` lines), by
    `<kind>/<key>`."""
    counts: dict[str, int] = {}
    for log_file in log_files:
        for kind, key in re.findall(r"cache (\w+): built (\S+)$", log_file.read_text(), flags=re.MULTILINE):
            counts[f"{kind}/{key}"] = counts.get(f"{kind}/{key}", 0) + 1
    return counts


@pytest.mark.slow
def test_parallel_sweep_shares_one_cache(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tcal.cli.app", *TINY, *job, f"paths.cache_dir={cache}",
                               f"hydra.run.dir={tmp_path / f'job{i}'}"], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i, job in enumerate(SWEEP)]
    errors = [proc.communicate(timeout=1500)[1] for proc in procs]
    assert [p.returncode for p in procs] == [0] * len(SWEEP), [e[-2000:] for e in errors]
    results = [json.loads((tmp_path / f"job{i}" / "results.json").read_text()) for i in range(len(SWEEP))]
    assert all(r["status"] == "complete" for r in results)
    assert len({json.dumps(r["retention_scores"]) for r in results}) == 1
    assert len({r["metrics"]["shakespeare"]["teacher_ppl"] for r in results}) == 1
    found = entries(Path(cache))
    stores = [p for p in (Path(cache) / "token_store").iterdir() if p.is_dir()]  # one store of the training split
    assert [len(found[k]) for k in ("retention", "teacher_eval", "stage1")] + [len(stores)] == [1, 1, 4, 1]
    assert len(found["calibration"]) == 3 * 2  # phase1, phase2, full x 2 GDN layers
    assert all(readable(p) for paths in found.values() for p in paths)
    assert not [p for p in Path(cache).rglob("*") if p.name.endswith(".tmp")]
    counts = builds([tmp_path / f"job{i}" / "app.log" for i in range(len(SWEEP))])
    # every key is built once under its lock and reused by the other jobs (Stage 1: one align job per init)
    once = [f"{kind}/{p.name.split('.')[0]}" for kind in KINDS for p in found[kind]]
    assert counts == {entry: 1 for entry in once}


# ----------------------------------------------------------------------------------------------------------
# Shared caches: files get the modes of the user's umask; an entry is checked against its own key


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of every file and folder below `root` (symlinks, such as the shared teachers, left out)."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")
            if not p.is_symlink() and not any(parent.is_symlink() for parent in p.parents)}


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o077])
def test_written_files_get_the_modes_of_the_umask(mask, tmp_path):
    with umask(mask):
        save_tensors(tmp_path / "cache" / "a.safetensors", {"w": torch.ones(2)}, {"n": 1}, "a")
        save_json(tmp_path / "cache" / "b.json", {"n": 2}, "b")
        write_folder_atomic(tmp_path / "student", lambda tmp: save_file({"w": torch.ones(2)},
                                                                         str(tmp / "model.safetensors")))
    found = modes(tmp_path)
    assert found == {name: (0o777 if (tmp_path / name).is_dir() else 0o666) & ~mask for name in found}
    assert set(found) == {"cache", "cache/a.safetensors", "cache/b.json", "student", "student/model.safetensors",
                          "student/.tcal-export.json"}  # the export lists the files it wrote


@pytest.fixture(scope="module")
def phase1_run(tmp_path_factory):
    """A smoke run with calibrated layers (phase1) and an exported student, under umask 002 (a team's group)."""
    root = tmp_path_factory.mktemp("shared")
    with umask(0o002):
        cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(root / 'cache')}", "init=phase1",
                      "eval.num_windows=2", "logger=none")
        results = run(cfg, root / "run")
    return cfg, root, results


def test_a_shared_cache_and_the_student_are_readable_by_the_group(phase1_run):
    _, root, _ = phase1_run
    found = {**{f"cache/{k}": v for k, v in modes(root / "cache").items()},
             **{f"student/{k}": v for k, v in modes(root / "run" / "student").items()}}
    assert any(name.startswith("cache/calibration/") and name.endswith(".safetensors") for name in found)
    assert any(name.startswith("student/") and name.endswith(".safetensors") for name in found)
    unreadable = {name: oct(mode) for name, mode in found.items()
                  if mode != (0o775 if (root / "run" / name if name.startswith("student/") else root / name).is_dir()
                              else 0o664)}
    assert not unreadable


def without_cached_flags(record) -> str:
    return json.dumps(record, sort_keys=True).replace('"cached": true', '"cached": false')


def test_an_entry_copied_under_another_key_is_rebuilt_with_a_warning(phase1_run, caplog):
    cfg, root, first = phase1_run
    artifacts = sorted((root / "cache" / "calibration").rglob("*.safetensors"))
    assert len(artifacts) == 2  # one per GDN layer
    source, target = artifacts
    target.write_bytes(source.read_bytes())  # layer A's calibration under layer B's key
    with caplog.at_level(logging.WARNING):
        again = run(cfg, root / "again")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"cache calibration: {target} is not the entry of its key: it was written under the key " \
           f"{source.stem!r}, not {target.stem!r} (copied or renamed); rebuilding it" in warned
    assert without_cached_flags(again["calibration"]) == without_cached_flags(first["calibration"])
    assert again["metrics"] == first["metrics"]
    assert readable(target)  # rewritten under its own key


def test_a_json_entry_copied_under_another_key_is_rebuilt(tmp_path, caplog):
    assert get_or_build("teacher_eval", "ppl-aaaa", lambda: 1.5, folder=tmp_path) == 1.5
    (tmp_path / "ppl-bbbb.json").write_text((tmp_path / "ppl-aaaa.json").read_text())
    with caplog.at_level(logging.WARNING):
        assert get_or_build("teacher_eval", "ppl-aaaa", lambda: pytest.fail("rebuilt"), folder=tmp_path) == 1.5
        assert get_or_build("teacher_eval", "ppl-bbbb", lambda: 2.5, folder=tmp_path) == 2.5
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"cache teacher_eval: {tmp_path / 'ppl-bbbb.json'} is not the entry of its key: it was written under the key "
        f"'ppl-aaaa', not 'ppl-bbbb' (copied or renamed); rebuilding it"]
    assert json.loads((tmp_path / "ppl-bbbb.json").read_text())["value"] == 2.5
