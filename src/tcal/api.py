"""The library from Python, without Hydra: typed settings (`tcal.settings`) and objects in, objects out.

    teacher = api.load_teacher(default_teacher())            # or tiny_teacher(): 4 random layers, for a quick try
    splits = api.load_data(DataSettings())
    keep = api.select_layers(teacher, splits, RetentionSettings(ratio=0.5)).keep_layers
    student = api.build_student(teacher, keep)
    api.initialize(student, teacher, splits, init_settings("full_plus"))
    student, record = api.distill(student, teacher, splits, DistillSettings(), tokens=100_000)
    results = api.evaluate(student, teacher, splits, EvalSettings())
    api.save(student, teacher.tokenizer, "student")

These are the steps `tcal` runs, taken the same road: each function makes the complete settings of its step (the
settings it was given, the defaults of the rest: `step_settings`), builds the one `tcal.run.Run` of that step with
`Run.build` (the checks the step needs, from `tcal.preflight`'s table, against the loaded teacher and documents;
the GDN kernel of `trainer.gdn_kernel`, which the student then runs) and calls the step. Wrong arguments are refused
by the settings' own checks, in one line naming the key (a `ConfigError`); a student converted from another teacher
is refused. On-disk caches (calibrated layers, retention scores, Stage 1) live under `cache_dir`, $TCAL_CACHE_DIR or
.cache/tcal as for `tcal`. A signal stops a step with `tcal.runtime.signals.Interrupted` (SIGINT: a
KeyboardInterrupt, never SystemExit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from pathlib import Path

import torch

from tcal import run
from tcal.data.documents import Splits, load_splits
from tcal.errors import ConfigError
from tcal.retention import Selection
from tcal.run import Run, Teacher
from tcal.runtime.distributed import Ranks
from tcal.runtime.signals import handling
from tcal.settings import (
    CalibrationSettings,
    DataSettings,
    DistillSettings,
    EvalSettings,
    InitSettings,
    PathsSettings,
    RunSettings,
    StageSequenceSettings,
    StageSettings,
    TeacherSettings,
    TrainerSettings,
    default_teacher,
)
from tcal.settings.retention import PolicySettings
from tcal.store.rerun import holding_folder

PathLike = typing.Union[str, os.PathLike]


def step_settings(teacher: Teacher, cache_dir: PathLike | None = None, **groups) -> RunSettings:
    """The complete settings of one step: the teacher's, the groups the step was given (None: the group's default)
    and the defaults of the rest, its caches under `cache_dir`. A step derives every cache key it reads or writes
    from these (`tcal.settings.relevance.cache_settings`), and each step takes every group whose fields enter its
    keys (a test checks it for every cached product), so the API and `tcal` use the same keys under the same
    settings."""
    if not isinstance(teacher, Teacher):
        raise ConfigError(f"teacher: a {type(teacher).__name__}; expected a Teacher (api.load_teacher)")
    return RunSettings(teacher=teacher.settings, paths=cache_paths(cache_dir),
                       **{name: value for name, value in groups.items() if value is not None})


def cache_paths(cache_dir: PathLike | None) -> PathsSettings:
    """The caches under `cache_dir`, by default where `tcal` keeps them (conf/paths/default.yaml): $TCAL_CACHE_DIR,
    else .cache/tcal."""
    return PathsSettings(cache_dir=os.fspath(cache_dir if cache_dir is not None else
                                             os.environ.get("TCAL_CACHE_DIR") or ".cache/tcal"))


@handling
def load_teacher(settings: TeacherSettings | None = None, cache_dir: PathLike | None = None,
                 device: str | torch.device | None = None) -> Teacher:
    """The teacher `settings` name, on `device` (default: the CPU)."""
    settings = RunSettings(teacher=settings or default_teacher(), paths=cache_paths(cache_dir))
    return run.load_teacher(settings.teacher, settings.paths.cache_dir, device)


@handling
def load_data(settings: DataSettings | None = None) -> Splits:
    """The documents of `settings`, split by document into train / calibration / evaluation."""
    return load_splits(RunSettings(data=settings or DataSettings()).data)


@handling
def select_layers(teacher: Teacher, splits: Splits, retention: PolicySettings, init: InitSettings | None = None,
                  calibration: CalibrationSettings | None = None, seed: int = 0, cache_dir: PathLike | None = None,
                  ranks: Ranks | None = None, data: DataSettings | None = None,
                  trainer: TrainerSettings | None = None) -> Selection:
    """The layers that keep softmax attention (`Selection.keep_layers`) by `retention`'s policy; `ga_s2` scores
    students initialized with `init` (and `calibration`). `data` (the settings `splits` came from) and `trainer`
    enter the score cache's key as they enter `tcal`'s."""
    settings = step_settings(teacher, cache_dir, retention=retention, init=init or InitSettings(),
                             calibration=calibration, seed=seed, data=data, trainer=trainer)
    return Run.build(settings, ("select",), teacher, splits, ranks=ranks).select()


@handling
def build_student(teacher: Teacher | torch.nn.Module, keep_layers: list | tuple, gqa_expansion: str = "whole_head",
                  seed: int = 0, trainer: TrainerSettings | None = None):
    """The hybrid student: `keep_layers` keep the teacher's attention, every other layer is a naive GDN running the
    kernel of `trainer.gdn_kernel`. `teacher` may be a bare model (its settings then are the default teacher's)."""
    teacher = teacher if isinstance(teacher, Teacher) else Teacher(teacher, None, default_teacher())
    settings = step_settings(teacher, init=InitSettings(gqa_expansion=gqa_expansion), seed=seed, trainer=trainer)
    return Run.build(settings, ("build",), teacher).build_student(keep_layers)


@handling
def initialize(student: torch.nn.Module, teacher: Teacher, splits: Splits, init: InitSettings,
               calibration: CalibrationSettings | None = None, seed: int = 0, cache_dir: PathLike | None = None,
               ranks: Ranks | None = None, data: DataSettings | None = None,
               trainer: TrainerSettings | None = None) -> dict:
    """Initialize the student's GDN layers in place by init mode `init.name`; returns the calibration record.
    `data` (the settings `splits` came from) and `trainer` enter the calibration cache's key as they enter `tcal`'s."""
    settings = step_settings(teacher, cache_dir, init=init, calibration=calibration, seed=seed, data=data,
                             trainer=trainer)
    return Run.build(settings, ("initialize",), teacher, splits, ranks=ranks).initialize(student)


@handling
def distill(student: torch.nn.Module, teacher: Teacher, splits: Splits, stage: StageSettings | None = None,
            tokens: int | None = None, eval: EvalSettings | None = None, data: DataSettings | None = None,
            trainer: TrainerSettings | None = None, seed: int = 0, run_dir: PathLike | None = None,
            cache_dir: PathLike | None = None, ranks: Ranks | None = None, resume: bool = False, logger: object = None,
            callbacks: list | None = None):
    """`Run.train` of `stage` (default: Stage 2 distillation), `tokens` its budget: (trained student, stage records)."""
    settings = step_settings(teacher, cache_dir, data=data, stage=with_budget(stage or DistillSettings(), tokens),
                             eval=eval, trainer=trainer, seed=seed)
    this_run = Run.build(settings, ("train",), teacher, splits, run_dir, resume, ranks, logger=logger,
                         extra_callbacks=list(callbacks or []))
    with holding_folder(this_run.run_dir) if this_run.ranks.is_main else contextlib.nullcontext():  # as `tcal`'s
        return this_run.train(student)


def with_budget(stage, tokens: int | None):
    """`stage` with a budget of `tokens` (each stage of a sequence; None: its own), evaluated at least at its start
    and end. A stage of another class is left for the run's settings to refuse, naming `stage`."""
    if tokens is None or not isinstance(stage, (StageSettings, StageSequenceSettings)):
        return stage
    if isinstance(stage, StageSequenceSettings):
        stages = {kind: with_budget(getattr(stage, kind), tokens) for kind in stage.sequence}
        return dataclasses.replace(stage, **stages)
    return dataclasses.replace(stage, max_tokens=tokens, eval_every_tokens=min(stage.eval_every_tokens, tokens)
                               if isinstance(tokens, int) else stage.eval_every_tokens)


@handling
def evaluate(student: torch.nn.Module, teacher: Teacher, splits: Splits, eval: EvalSettings | None = None,
             data: DataSettings | None = None, trainer: TrainerSettings | None = None,
             cache_dir: PathLike | None = None, ranks: Ranks | None = None) -> dict:
    """Teacher and student perplexity on the eval sets of `data` (plus the harness and RULER that `eval` names):
    the `metrics`, `harness` and `ruler` entries of a results.json."""
    settings = step_settings(teacher, cache_dir, data=data, eval=eval, trainer=trainer)
    return Run.build(settings, ("evaluate",), teacher, splits, ranks=ranks).evaluate(student)


@handling
def save(student: torch.nn.Module, tokenizer, folder: PathLike) -> Path:
    """save_pretrained of the student and tokenizer into `folder`, written whole or not at all. `folder` must be new,
    empty, or an earlier export of tcal (its manifest lists every file there): anything else there (a user's
    notes.txt, the working folder) is refused, naming it, and nothing is deleted (`tcal.student.export`)."""
    from tcal.student.export import export_student

    return export_student(student, tokenizer, Path(folder))


__all__ = ["Teacher", "Run", "load_teacher", "load_data", "select_layers", "build_student", "initialize",
           "distill", "evaluate", "save"]
