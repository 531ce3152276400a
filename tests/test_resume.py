"""Resume is idempotent: a run killed at any point (before training, mid-stage, with a checkpoint at the last step,
during the final evaluation, after completion) and resumed ends with the record, curve, weights and logged
metrics of the uninterrupted run; a damaged checkpoint is named and leaves the record as it was; a resume may
change only the keys safe to change."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, example_record, isolated_cache_dir
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from tcal.cli import app
from tcal.cli.app import check_arguments, run_in
from tcal.errors import DamagedCheckpoint, FolderInUse
from tcal.pipeline import run
from tcal.store.record import recorded_setting
from tcal.store.rerun import resumed_settings

TINY = ("experiment=smoke", "init=naive", "eval.num_windows=2")
DISTILL = ("stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=256",
           "stage.eval_every_tokens=128")
ALIGN_DISTILL = ("stage=align_distill", "stage.align.cache=false", *(f"stage.{kind}.{key}={value}" for kind in
                 ("align", "distill") for key, value in (("batch_size", 2), ("seq_len", 32), ("max_tokens", 128),
                                                         ("eval_every_tokens", 64))))
LOGGED = ("step", "distill/loss", "distill/ppl/shakespeare", "align/loss", "align/ppl/shakespeare")


class Kill(BaseException):
    """Like SIGKILL: nothing after it runs, and no handler records a failure."""


class KillAt(Callback):
    """Kill in stage `kind` after `step` optimizer steps (step None: as training starts)."""

    def __init__(self, kind: str, step: int | None):
        self.kind, self.step = kind, step

    def on_train_start(self, trainer, module):
        if module.kind == self.kind and self.step is None:
            raise Kill(f"killed as {self.kind} starts")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if module.kind == self.kind and trainer.global_step == self.step:
            raise Kill(f"killed at {self.kind} step {self.step}")


def cfg_of(cache: str, stage: tuple):
    return compose(*TINY, *stage, f"paths.cache_dir={cache}")


def read(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def logged(run_dir: Path) -> list[tuple]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return [tuple(row.get(k, "") for k in LOGGED) for row in csv.DictReader(handle)
                if any(row.get(k) for k in LOGGED[1:])]


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "student" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs of each stage setting, and the shared cache."""
    root = tmp_path_factory.mktemp("straight")
    cache = isolated_cache_dir(root / "cache")
    runs = {}
    for name, stage in (("distill", DISTILL), ("align_distill", ALIGN_DISTILL)):
        run(cfg_of(cache, stage), root / name)
        runs[name] = root / name
    return cache, runs


def resume(run_dir: Path) -> None:
    """What `tcal resume=RUN_DIR` does."""
    run_in(app.recorded_run(run_dir), run_dir)


def assert_same_as(resumed: Path, uninterrupted: Path) -> None:
    a, b = read(resumed), read(uninterrupted)
    assert a["status"] == "complete" and "error" not in a
    for key in ("curve", "metrics", "keep_layers", "init_weights_digest"):
        assert a[key] == b[key], key
    for kind, record in b["stages"].items():
        for key in ("steps", "tokens_seen", "curve", "loss_first", "loss_last", "rank_weight_digests"):
            assert a["stages"][kind][key] == record[key], (kind, key)
    wa, wb = weights(resumed), weights(uninterrupted)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert logged(resumed) == logged(uninterrupted) and logged(resumed)  # earlier rows kept, none twice


@pytest.mark.parametrize("setting,kill,status", [
    ("distill", ("distill", None), "initialized"),  # before training: no checkpoint yet
    ("distill", ("distill", 3), "initialized"),  # mid-stage: checkpoint at step 2
    ("distill", ("evaluate", None), "trained_distill"),  # final evaluation: checkpoint at the last step
    ("align_distill", ("distill", 1), "trained_align"),  # Stage 2, uncached Stage 1 checkpoint at its last step
], ids=["before_training", "mid_stage", "final_evaluation", "stage2_after_uncached_stage1"])
def test_a_killed_run_resumes_to_the_uninterrupted_record(setting, kill, status, straight, tmp_path, monkeypatch):
    cache, runs = straight
    run_dir = tmp_path / "killed"
    stage = DISTILL if setting == "distill" else ALIGN_DISTILL
    if kill[0] == "evaluate":
        with monkeypatch.context() as patch:
            patch.setattr("tcal.run.Run.evaluate", lambda *args: (_ for _ in ()).throw(Kill("killed in evaluation")))
            with pytest.raises(Kill):
                run(cfg_of(cache, stage), run_dir)
    else:
        with pytest.raises(Kill):
            run(cfg_of(cache, stage), run_dir, callbacks=[KillAt(*kill)])
    assert read(run_dir)["status"] == status
    resume(run_dir)
    assert_same_as(run_dir, runs[setting])


def test_resuming_a_complete_run_does_nothing(straight, capsys):
    _, runs = straight
    results = runs["distill"] / "results.json"
    before = (results.read_bytes(), results.stat().st_mtime_ns,
              (runs["distill"] / "logs" / "metrics.csv").read_bytes())
    resume(runs["distill"])
    assert "already holds this run, complete; nothing to do" in capsys.readouterr().out
    assert (results.read_bytes(), results.stat().st_mtime_ns,
            (runs["distill"] / "logs" / "metrics.csv").read_bytes()) == before


@pytest.mark.slow  # the default suite resumes from last-step checkpoints in the kill tests above
def test_a_resume_after_a_checkpoint_at_the_last_step_completes(straight, tmp_path):
    """A run whose record was lost after its last checkpoint (only "initialized" on disk) resumes without training."""
    cache, runs = straight
    run_dir = tmp_path / "run"
    run(cfg_of(cache, DISTILL), run_dir)
    record = read(run_dir)
    (run_dir / "results.json").write_text(json.dumps({**record, "status": "initialized", "stages": {}, "curve": {}}))
    resume(run_dir)
    assert_same_as(run_dir, runs["distill"])
    assert read(run_dir)["stages"]["distill"]["resumed"]


def test_a_damaged_checkpoint_is_named_and_the_record_keeps_what_it_held(straight, tmp_path):
    cache, _ = straight
    run_dir = tmp_path / "killed"
    with pytest.raises(Kill):
        run(cfg_of(cache, DISTILL), run_dir, callbacks=[KillAt("distill", 3)])
    checkpoint = run_dir / "checkpoints" / "distill" / "last.ckpt"
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    kept = {p: p.read_bytes() for p in (run_dir / "results.json", run_dir / "logs" / "metrics.csv")}
    assert read(run_dir)["curve"]["shakespeare"]  # the curve so far is part of what is kept
    with pytest.raises(DamagedCheckpoint, match=rf"^checkpoint {checkpoint} cannot be read \(RuntimeError: .*\); "
                                                rf"expected a whole checkpoint"):
        resume(run_dir)
    assert {p: p.read_bytes() for p in kept} == kept

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'log'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"tcal: configuration error: checkpoint {checkpoint} cannot be read")
    assert {p: p.read_bytes() for p in kept} == kept


# ----------------------------------------------------------------------------------------------------------
def test_a_resume_whose_data_changed_is_refused_naming_the_file(tmp_path):
    """A data.source=files run killed in Stage 2, its training file rewritten: the resume is refused before any work
    naming the file (here and at the `tcal` entry: one line, exit code 2), the record as it was; the file put back,
    the same resume completes."""
    from tcal.data.documents import shakespeare_documents

    text = shakespeare_documents()[0].text
    docs = tmp_path / "docs.jsonl"
    original = "".join(json.dumps({"text": text[i * 3000:(i + 1) * 3000]}) + "\n" for i in range(12))
    docs.write_text(original)
    data = ("data.source=files", f"data.files=[{docs}]", "data.calibration_docs=2", "data.evaluation_docs=2")
    cfg = compose(*TINY, *DISTILL, *data, f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    killed = tmp_path / "killed"
    with pytest.raises(Kill):
        run(cfg, killed, callbacks=[KillAt("distill", 3)])
    docs.write_text(original.replace("the", "a"))
    record = (killed / "results.json").read_bytes()
    with pytest.raises(FolderInUse, match=rf"^{killed} holds a run that read other data than this command would: "
                                          rf"{docs} \(its content\) changed since it started; expected the data it "
                                          rf"started with \(put it back\), or a new run"):
        resume(killed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", f"resume={killed}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and f"{docs} (its content) changed" in lines[0], done.stderr[-2000:]
    assert (killed / "results.json").read_bytes() == record
    docs.write_text(original)
    resume(killed)
    assert read(killed)["status"] == "complete" and set(read(killed)["inputs"]["files"]) == {str(docs)}


# Overrides on resume


@pytest.fixture
def recorded_run(tmp_path):
    """A folder whose results.json records a distill run's config (what `tcal resume=` reads)."""
    cfg = compose(*TINY, *DISTILL, "paths.cache_dir=/cache/a")
    (tmp_path / "results.json").write_text(json.dumps(example_record("initialized", config=cfg.tree())))
    return tmp_path


def chosen_groups(overrides: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the config groups the overrides choose, the keys they set), as the entry passes them."""
    keys = [o.split("=")[0] for o in overrides]
    return tuple(k for k in keys if "." not in k), tuple(k for k in keys if "." in k)


@pytest.mark.parametrize("overrides,match", [
    (["seed=7", *DISTILL, "stage.lr_mixer=0.5"],
     r"the run was started with other settings \(seed=7 \(that run: 0\), stage.lr_mixer=0.5 \(that run: 0.0001\)\); "
     r"expected only settings that change nothing \(paths, logger, save_student, task_name, cache switches\)"),
    (["experiment=smoke", "eval.num_windows=2", "init=full"],
     r"the run was started with other settings \(init.name='full' \(that run: 'naive'\)\); expected"),
    (["experiment=smoke", "eval.num_windows=3"],
     r"the run was started with other settings \(eval.num_windows=3 \(that run: 2\)\); expected"),
    # a group counts by every key its option holds, not by its name: the same option with other values is refused
    (["stage=distill"], r"the run was started with other settings \(stage.batch_size=4 \(that run: 2\), "),
    (["trainer=ddp"], r"the run was started with other settings \(trainer.accelerator='auto' \(that run: 'cpu'\), "
                      r"trainer.devices=2 \(that run: 1\), "),
    (["teacher=tiny_qwen3"], r"the run was started with other settings \(teacher.config="),
])
def test_resume_refuses_overrides_that_change_the_run(overrides, match, recorded_run):
    cfg = compose(f"resume={recorded_run}", *overrides)
    record = json.loads((recorded_run / "results.json").read_text())
    with pytest.raises(FolderInUse, match=rf"^resume={recorded_run}: {match}"):
        resumed_settings(recorded_run, record, cfg, compose(), *chosen_groups(overrides))
    with pytest.raises(FolderInUse, match=rf"^resume={recorded_run}: {match}"):
        check_arguments([f"resume={recorded_run}", *overrides])


def test_resume_takes_safe_overrides_and_the_run_s_own_settings(recorded_run):
    overrides = [*TINY, *DISTILL, "paths.cache_dir=/cache/b", "logger=none", "save_student=false",
                 "stage.lr_mixer=0.0001"]
    cfg = compose(f"resume={recorded_run}", *overrides)
    check_arguments([f"resume={recorded_run}", *overrides])
    record = json.loads((recorded_run / "results.json").read_text())
    resumed = resumed_settings(recorded_run, record, cfg, compose(), *chosen_groups(overrides))
    expected = {**record["config"], "resume": str(recorded_run), "save_student": False}
    expected["paths"] = {**expected["paths"], "cache_dir": "/cache/b"}
    expected["logger"] = {"name": "none", "project": None, "group": None}
    assert resumed.tree() == expected


@pytest.mark.parametrize("stage,safe,changing,match", [
    (DISTILL, ["stage.cache_tokens=false"], ["stage.lr_mixer=1e-5"], r"stage.lr_mixer=1e-05 \(that run: 0.0001\)"),
    (("stage=align", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=64"),
     ["stage.cache=false", "stage.cache_tokens=false"], ["stage.lr=0.5"], r"stage.lr=0.5 \(that run: 0.001\)"),
    (ALIGN_DISTILL, ["stage.align.cache=true", "stage.distill.cache_tokens=false"], ["stage.distill.kl_chunk_size=8"],
     r"stage.distill.kl_chunk_size=8 \(that run: 256\)"),
], ids=["distill", "align", "align_distill"])
def test_a_resume_reads_stage_overrides_against_the_run_s_own_stage(stage, safe, changing, match, tmp_path):
    """`tcal resume=DIR stage.<key>=...` is read against the run's stage, not the default `stage=none` (which has none
    of these keys): the settings that change nothing are taken, one that changes the run is refused, naming it."""
    recorded = compose(*TINY, *stage)
    (tmp_path / "results.json").write_text(json.dumps(example_record("initialized", config=recorded.tree())))
    check_arguments([f"resume={tmp_path}", *safe])
    with pytest.raises(FolderInUse, match=rf"^resume={tmp_path}: the run was started with other settings "
                                          rf"\({match}\); expected only settings that change nothing"):
        check_arguments([f"resume={tmp_path}", *changing])
    with app.hydra_configs():
        choices = app.run_choices([f"resume={tmp_path}", *safe], app.run_settings(app.compose_here([])))
        # each group whose settings are of another class than the defaults' (the smoke run's harness and init too)
        assert choices == ["eval/harness=none", "init=naive", f"stage={recorded.stage.name}"]
        command = app.run_settings(app.compose_here([*choices, f"resume={tmp_path}", *safe]))
        resumed = app.resumed(command, app.run_settings(app.compose_here(choices)), [*choices, f"resume={tmp_path}",
                                                                                     *safe], choices)
    expected = {**recorded.tree(), "resume": str(tmp_path)}
    for arg in safe:  # each a switch of a cache, true or false
        key, value = arg.split("=")
        *parents, leaf = key.split(".")
        node = expected
        for parent in parents:
            node = node[parent]
        node[leaf] = value == "true"
    assert resumed.tree() == expected


def test_tcal_resume_with_a_stage_setting_is_read_against_the_run(straight):
    """At the `tcal` entry: a safe stage setting on a complete run's resume says there is nothing to do (exit 0); one
    that changes the run is one line naming it (exit 2)."""
    _, runs = straight
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    tcal = [sys.executable, "-m", "tcal.cli.app", f"resume={runs['distill']}"]
    safe = subprocess.run([*tcal, "stage.cache_tokens=false"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert safe.returncode == 0 and "complete; nothing to do" in safe.stdout, safe.stderr[-2000:]
    changing = subprocess.run([*tcal, "stage.lr_mixer=1e-5"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    lines = changing.stderr.strip().splitlines()
    assert changing.returncode == 2 and len(lines) == 1, changing.stderr[-2000:]
    assert "stage.lr_mixer=1e-05 (that run: 0.0001)" in lines[0]


def test_a_bare_resume_continues_the_run_as_recorded(tmp_path):
    """`tcal resume=DIR` with nothing else keeps every setting of the run, those that change nothing included: its
    teacher's name, task name, logger and paths are the run's, not the resume command's defaults."""
    recorded = compose(*TINY, *DISTILL, "teacher.name=my_teacher", "task_name=my_task", "logger=wandb",
                       "logger.project=p", "paths.cache_dir=/cache/a", "paths.output_dir=/runs")
    (tmp_path / "results.json").write_text(json.dumps(example_record("initialized", config=recorded.tree())))
    resumed = resumed_settings(tmp_path, json.loads((tmp_path / "results.json").read_text()),
                               compose(f"resume={tmp_path}"), compose())
    assert resumed.tree() == {**recorded.tree(), "resume": str(tmp_path)}
    logger_only = resumed_settings(tmp_path, json.loads((tmp_path / "results.json").read_text()),
                                   compose(f"resume={tmp_path}", "logger=csv"), compose(), ("logger",))
    assert logger_only.logger.name == "csv" and logger_only.task_name == "my_task"


def test_a_bare_resume_keeps_the_teacher_and_task_name_and_recalibrates_nothing(tmp_path):
    """A Stage 2 run of a renamed teacher and task, killed after its first checkpoint, continued as the `tcal` entry
    continues `tcal resume=DIR` (nothing else on the command): the record keeps the teacher's and the task's names,
    every calibrated layer comes from the cache the run wrote (under its teacher's name), and the curve is the
    uninterrupted run's."""
    cache = isolated_cache_dir(tmp_path / "cache")
    named = (*TINY, "init=phase2", *DISTILL, "teacher.name=renamed_llama", "task_name=my_task",
             f"paths.cache_dir={cache}")
    run(compose(*named), tmp_path / "straight")
    killed = tmp_path / "killed"
    with pytest.raises(Kill):
        run(compose(*named), killed, callbacks=[KillAt("distill", 3)])
    assert (killed / "checkpoints" / "distill" / "last.ckpt").is_file()
    settings = app.resumed(compose(f"resume={killed}"), compose(), [f"resume={killed}"])
    run_in(settings, killed)
    record, straight = read(killed), read(tmp_path / "straight")
    assert record["status"] == "complete"
    assert recorded_setting(record, "teacher.name") == "renamed_llama" and record["config"]["task_name"] == "my_task"
    assert record["config"]["paths"]["cache_dir"] == cache
    assert record["calibration"]["layers"] and all(layer["cached"] for layer in record["calibration"]["layers"].values())
    assert record["curve"] == straight["curve"] and record["stages"]["distill"]["resumed"]
