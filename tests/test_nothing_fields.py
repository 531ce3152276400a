"""Every settings field declared to change nothing (`affects=NOTHING`: a resume takes it from the command, no cache
key holds it, `tcal-report` does not tell runs apart by it) does change nothing: a tiny run with another value of it
gives the same keep list, scores, initialized weights, curves, trained weights and figures as the run without it.
The fields a run holds change together, in one run against it (a change of any one of them fails it), except those
that run alone (`ALONE`). A new field declared so must be added here, with a run that holds it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import compose, isolated_cache_dir

from tcal.pipeline import run
from tcal.settings.compose import group_options
from tcal.settings.relevance import levels
from tcal.settings.run import GROUPS

BASE = ("experiment=smoke", "init=naive", "eval.num_windows=2", "save_student=false")
TRAIN = ("stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=64")
ALIGN_DISTILL = ("stage=align_distill", *(f"stage.{kind}.{key}={value}" for kind in ("align", "distill")
                                          for key, value in (("batch_size", 2), ("seq_len", 32), ("max_tokens", 64),
                                                             ("eval_every_tokens", 64))))
HOLDERS = {  # a run whose settings hold the field
    "plain": (),
    "distill": ("stage=distill", *TRAIN),
    "align_distill": ALIGN_DISTILL,
    "align": ("stage=align", *TRAIN),
    "phase2": ("init=phase2",),
    "full_plus": ("init=full_plus", "init.pool.tokens=1024", "calibration.seq_len=64"),
    "ar": ("retention=ar", "retention.seq_len=32", "retention.num_windows=2", "retention.batch_size=2"),
    "recall": ("retention=recall", "retention.seq_len=256", "retention.num_windows=1"),
}
# field -> (the run that holds it, its other value); {tmp} is the test's folder
CHANGED = {
    "teacher.name": ("plain", "renamed_teacher"),
    "teacher.tokenizer.name": ("plain", "renamed_tokenizer"),
    "teacher.architecture": ("plain", "{architecture}"),
    "calibration.check": ("phase2", "false"),
    "calibration.cache": ("phase2", "false"),
    "init.pool.layers_per_pass": ("full_plus", "1"),
    "logger.name": ("distill", "none"),
    "logger.project": ("distill", "another_project"),
    "logger.group": ("distill", "another_group"),
    "paths.output_dir": ("plain", "{tmp}/elsewhere"),
    "paths.cache_dir": ("distill", "{tmp}/another_cache"),
    "save_student": ("plain", "true"),
    "task_name": ("plain", "another_task"),
    "retention.cache": ("ar", "false"),
    "stage.cache_tokens": ("distill", "false"),
    "stage.align.cache": ("align_distill", "false"),
    "stage.align.cache_tokens": ("align_distill", "false"),
    "stage.distill.cache_tokens": ("align_distill", "false"),
    "stage.cache": ("align", "false"),
    "data.shard_tokens": ("distill", "1000"),
    "data.workers": ("distill", "2"),
}
# changed alone: another cache folder (everything computed again), no logger, and the in-memory tokens (with which
# the token store's fields would do nothing)
ALONE = {"paths.cache_dir", "logger.name", "stage.cache_tokens"}
# `resume` names the run to continue: that a resumed run's products equal the uninterrupted run's is tests/test_resume.py
COVERED_ELSEWHERE = {"resume"}
PRODUCTS = ("keep_layers", "retention_scores", "init_weights_digest", "curve", "metrics", "harness", "ruler")


def nothing_fields() -> set[str]:
    """Every dotted key declared to change nothing, over every option of every config group."""
    found = set()
    for group in (*GROUPS, "eval/harness", "eval/ruler"):
        for option in group_options(group) or []:
            extra = ("retention.keep=[0,2]",) if (group, option) == ("retention", "explicit") else ()
            settings = compose("teacher=tiny_llama", f"{group}={option}", *extra)
            found |= {key for key, level in levels(settings).items() if level == "none"}
    return found


def test_every_field_declared_to_change_nothing_has_a_run_here():
    assert nothing_fields() - COVERED_ELSEWHERE == set(CHANGED)


def products(record: dict) -> dict:
    found = {key: record.get(key) for key in PRODUCTS}
    found["stages"] = {kind: {k: stage.get(k) for k in ("curve", "rank_weight_digests", "loss_last")}
                       for kind, stage in (record.get("stages") or {}).items()}
    return found


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    root = tmp_path_factory.mktemp("nothing")
    cache = isolated_cache_dir(root / "cache")
    return root, cache, {}


def baseline(baselines, holder: str) -> dict:
    root, cache, done = baselines
    if holder not in done:
        done[holder] = products(run(compose(*BASE, *HOLDERS[holder], f"paths.cache_dir={cache}"), root / holder))
    return done[holder]


def changed_together() -> list[tuple[str, ...]]:
    """The fields each run changes: those its holder holds, but each of `ALONE` in a run of its own."""
    runs: dict[str, list[str]] = {}
    for key in sorted(CHANGED):
        runs.setdefault(key if key in ALONE else CHANGED[key][0], []).append(key)
    return [tuple(keys) for keys in runs.values()]


RUNS = changed_together()


def other_value(key: str, tmp_path: Path) -> str:
    value = CHANGED[key][1].format(tmp=tmp_path, architecture="{architecture}")
    if key == "teacher.architecture":
        architecture = compose("teacher=tiny_llama").teacher.config
        value = "{" + ",".join(f"{k}:{v}" for k, v in architecture.items()) + "}"
    return value


@pytest.mark.parametrize("keys", RUNS, ids=["+".join(keys) for keys in RUNS])
def test_fields_declared_to_change_nothing_change_no_product(keys, baselines, tmp_path, monkeypatch):
    root, cache, _ = baselines
    (holder,) = {CHANGED[key][0] for key in keys}
    expected = baseline(baselines, holder)
    changed = {key: other_value(key, tmp_path) for key in keys}
    cache_dir = isolated_cache_dir(Path(changed.pop("paths.cache_dir"))) if "paths.cache_dir" in changed else cache
    overrides = [*BASE, *HOLDERS[holder], f"paths.cache_dir={cache_dir}", *(f"{k}={v}" for k, v in changed.items())]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert products(run(compose(*overrides), tmp_path / "run")) == expected, keys
