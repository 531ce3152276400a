"""The library from Python, without Hydra: typed settings (`tcal.settings`) and objects in, objects out.

    teacher = api.load_teacher(default_teacher())            # or tiny_teacher(): 4 random layers, for a quick try
    splits = api.load_data(DataSettings())
    keep = api.select_layers(teacher, splits, RetentionSettings(ratio=0.5)).keep_layers
    student = api.build_student(teacher, keep)
    api.initialize(student, teacher, splits, init_settings("full_plus"))
    student, record = api.distill(student, teacher, splits, DistillSettings(), tokens=100_000)
    results = api.evaluate(student, teacher, splits, EvalSettings())
    api.save(student, teacher.tokenizer, "student")

These are the steps `tcal` runs (`tcal.pipeline` calls them); on-disk caches (calibrated layers, retention scores,
Stage 1) live under `cache_dir`, $TCAL_CACHE_DIR or .cache/tcal as for `tcal`.

Every step is the CLI's equal (`step`): its arguments are checked against its annotations first (a wrong type is a
TypeError naming the step, the argument and what it expected); its settings checked themselves when they were built
(`tcal.settings`), and the step checks what they need of the machine and the loaded teacher as `tcal` does
(`tcal.preflight`, a ConfigError naming the key: also lengths past the teacher's context); a signal stops it with
`tcal.runtime.signals.Interrupted` (SIGINT: a KeyboardInterrupt, never SystemExit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import numbers
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from tcal.context import RunContext
from tcal.data.documents import Splits, load_splits
from tcal.preflight import (
    check_budgets,
    check_fit,
    check_keep_list,
    check_ruler_room,
    check_split_tokens,
    check_trainer,
)
from tcal.retention import Selection
from tcal.runtime.distributed import Ranks
from tcal.runtime.signals import handling
from tcal.settings import (
    CalibrationSettings,
    DataSettings,
    DistillSettings,
    EvalSettings,
    ExplicitRetentionSettings,
    InitSettings,
    RetentionSettings,
    RunSettings,
    StageSequenceSettings,
    StageSettings,
    TeacherSettings,
    TrainerSettings,
    default_teacher,
)

PathLike = typing.Union[str, os.PathLike]


@dataclass
class Teacher:
    """A loaded teacher: the model (eval mode, frozen), its tokenizer and the settings it came from."""

    model: torch.nn.Module
    tokenizer: object
    settings: TeacherSettings

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


def expected(hint) -> str:
    """An annotation in words: `TeacherSettings or None`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(expected(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return "an integer" if hint is int else getattr(hint, "__name__", str(hint))


def fits(value, hint) -> bool:
    """Whether `value` is of the annotated type (a union: any of its members; ints: any integer but a bool)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    origin = typing.get_origin(hint) or hint
    return not isinstance(origin, type) or isinstance(value, origin)


def shown(value) -> str:
    """A value as an error message shows it: its repr when short and on one line, else `<...>`."""
    text = repr(value)
    return text if len(text) <= 60 and "\n" not in text else "<...>"


def step(function):
    """A public step of the library: arguments checked against its annotations (TypeError naming the argument),
    signals handled (`tcal.runtime.signals`)."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"api.{function.__name__}: {err}") from None
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            if hint is not None and not fits(value, hint):
                raise TypeError(f"api.{function.__name__}: {name}={shown(value)} (a {type(value).__name__}); "
                                f"expected {expected(hint)}")
        with handling():
            return function(*args, **kwargs)

    return wrapper


def context_length(teacher: Teacher) -> int | None:
    return getattr(teacher.model.config, "max_position_embeddings", None)


def default_cache_dir() -> Path:
    """Where `tcal` keeps its caches (conf/paths/default.yaml): $TCAL_CACHE_DIR, else .cache/tcal."""
    return Path(os.environ.get("TCAL_CACHE_DIR") or ".cache/tcal")


def step_settings(teacher: Teacher, **groups) -> RunSettings:
    """The complete settings of one step: the teacher's, the groups the step was given (None: the group's default)
    and the defaults of the rest. A step derives every cache key it reads or writes from these
    (`tcal.settings.relevance.cache_settings`), and each step takes every group whose fields enter its keys (a test
    checks it for every cached product), so the API and `tcal` use the same keys under the same settings."""
    return RunSettings(teacher=teacher.settings, **{name: value for name, value in groups.items() if value is not None})


def context(teacher: Teacher, splits: Splits, settings: RunSettings, cache_dir=None, run_dir=None,
            ranks: Ranks | None = None) -> RunContext:
    """The `RunContext` the library's steps read, for one call (`settings` from `step_settings`)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = Path(run_dir) if run_dir is not None else Path("outputs") / "python_api"  # stage checkpoints only
    return RunContext(settings, teacher.model, teacher.tokenizer, splits, cache, folder, ranks=ranks or Ranks())


@step
def load_teacher(settings: TeacherSettings | None = None, cache_dir: PathLike | None = None,
                 device: str | torch.device | None = None) -> Teacher:
    """The teacher `settings` name, on `device` (default: the CPU)."""
    from tcal.teachers.load import load_teacher as load

    settings = settings or default_teacher()
    model, tokenizer = load(settings, cache_dir if cache_dir is not None else default_cache_dir())
    if device is not None:
        model.to(device)
    return Teacher(model, tokenizer, settings)


@step
def load_data(settings: DataSettings | None = None) -> Splits:
    """The documents of `settings`, split by document into train / calibration / evaluation."""
    return load_splits(settings or DataSettings())


@step
def select_layers(teacher: Teacher, splits: Splits, retention: RetentionSettings | ExplicitRetentionSettings,
                  init: InitSettings | None = None, calibration: CalibrationSettings | None = None, seed: int = 0,
                  cache_dir: PathLike | None = None, ranks: Ranks | None = None, data: DataSettings | None = None,
                  trainer: TrainerSettings | None = None) -> Selection:
    """The layers that keep softmax attention (`Selection.keep_layers`) by `retention`'s policy; `ga_s2` scores
    students initialized with `init` (and `calibration`). `data` (the settings `splits` came from) and `trainer`
    enter the score cache's key as they enter `tcal`'s."""
    from tcal.retention import select_layers as select

    settings = step_settings(teacher, retention=retention, init=init or InitSettings(), calibration=calibration,
                             seed=seed, data=data, trainer=trainer)
    check_keep_list(settings, teacher.num_layers)
    lengths = retention.teacher_lengths()
    if retention.initializes_layers():
        lengths.append(("calibration.seq_len", settings.calibration.seq_len))
    check_fit(lengths, context_length(teacher))
    ctx = context(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(ctx, ("retention", "init") if "calibration.seq_len" in dict(lengths) else ("retention",))
    return select(retention, ctx)


@step
def build_student(teacher: Teacher | torch.nn.Module, keep_layers: list | tuple, gqa_expansion: str = "whole_head",
                  seed: int = 0):
    """The hybrid student: `keep_layers` keep the teacher's attention, every other layer is a naive GDN."""
    from tcal.student.convert import build_student as build

    model = teacher.model if isinstance(teacher, Teacher) else teacher
    return build(model, list(keep_layers), gqa_expansion, int(seed))


@step
def initialize(student: torch.nn.Module, teacher: Teacher, splits: Splits, init: InitSettings,
               calibration: CalibrationSettings | None = None, seed: int = 0, cache_dir: PathLike | None = None,
               ranks: Ranks | None = None, data: DataSettings | None = None,
               trainer: TrainerSettings | None = None) -> dict:
    """Initialize the student's GDN layers in place by init mode `init.name`; returns the calibration record.
    `data` (the settings `splits` came from) and `trainer` enter the calibration cache's key as they enter `tcal`'s."""
    from tcal.init import init_student

    settings = step_settings(teacher, init=init, calibration=calibration, seed=seed, data=data, trainer=trainer)
    if settings.calibrates():
        check_fit([("calibration.seq_len", settings.calibration.seq_len)], context_length(teacher))
    ctx = context(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(ctx, ("init",))  # the CLI's message naming the key, not a bare ValueError mid-init
    return init_student(student, init, ctx)


@step
def distill(student: torch.nn.Module, teacher: Teacher, splits: Splits, stage: StageSettings | None = None,
            tokens: int | None = None, eval: EvalSettings | None = None, data: DataSettings | None = None,
            trainer: TrainerSettings | None = None, seed: int = 0, run_dir: PathLike | None = None,
            cache_dir: PathLike | None = None, ranks: Ranks | None = None, resume: bool = False, logger: object = None,
            callbacks: list | None = None):
    """Train the student for one stage (or a sequence) of `stage` (default: Stage 2 distillation), `tokens`
    replacing its token budget; returns (the trained student, the stage records with their perplexity curves on
    the eval sets of `data`). Under a mixed precision the student trains on float32 weights. A Lightning `logger`
    and `callbacks` join every stage's Trainer; `resume` continues each stage from its last checkpoint in `run_dir`.
    This is the training `tcal` runs (`tcal.pipeline`, with the stages planned once with its other checks)."""
    from tcal.store.rerun import holding_folder
    from tcal.training.run import plan_stages, train_stages

    stage = stage or DistillSettings()
    if tokens is not None:
        stage = with_budget(stage, int(tokens))
    settings = step_settings(teacher, data=data, stage=stage, eval=eval, trainer=trainer, seed=seed)
    check_trainer(settings.trainer)
    check_budgets(settings)
    check_fit([*((f"{key}.seq_len", node.seq_len) for key, node in settings.stage.stages()),
               *settings.eval.lengths()], context_length(teacher))
    ctx = context(teacher, splits, settings, cache_dir, run_dir, ranks)
    check_split_tokens(ctx, ("eval",))  # the stages' curves are measured on these windows
    ctx.extra_callbacks = list(callbacks or [])
    # its checkpoints: one live run per folder (held by rank 0), as for `tcal`
    with holding_folder(ctx.run_dir) if ctx.ranks.is_main else contextlib.nullcontext():
        return train_stages(plan_stages(ctx), ctx, student, logger, resume)


def with_budget(stage, tokens: int):
    """`stage` with a budget of `tokens` (each stage of a sequence), evaluated at least at its start and end."""
    if isinstance(stage, StageSequenceSettings):
        stages = {kind: with_budget(getattr(stage, kind), tokens) for kind in stage.sequence}
        return dataclasses.replace(stage, **stages)
    return dataclasses.replace(stage, max_tokens=tokens, eval_every_tokens=min(stage.eval_every_tokens, tokens))


@step
def evaluate(student: torch.nn.Module, teacher: Teacher, splits: Splits, eval: EvalSettings | None = None,
             data: DataSettings | None = None, trainer: TrainerSettings | None = None,
             cache_dir: PathLike | None = None, ranks: Ranks | None = None) -> dict:
    """Teacher and student perplexity on the eval sets of `data` (plus the harness and RULER that `eval` names):
    the `metrics`, `harness` and `ruler` entries of a results.json."""
    from tcal.evaluate.suite import evaluate as run_evaluation

    settings = step_settings(teacher, data=data, eval=eval, trainer=trainer)
    check_trainer(settings.trainer)
    check_fit(settings.eval.lengths(), context_length(teacher))  # the same check as `tcal`'s, on the loaded teacher
    ctx = context(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(ctx, ("eval",))
    check_ruler_room(ctx)
    student.eval()
    return run_evaluation(ctx, student)


@step
def save(student: torch.nn.Module, tokenizer, folder: PathLike) -> Path:
    """save_pretrained of the student and tokenizer into `folder`, written whole or not at all. `folder` must be new,
    empty, or an earlier export of tcal (its manifest lists every file there): anything else there (a user's
    notes.txt, the working folder) is refused, naming it, and nothing is deleted (`tcal.student.export`)."""
    from tcal.student.export import export_student

    return export_student(student, tokenizer, Path(folder))


__all__ = ["Teacher", "load_teacher", "load_data", "select_layers", "build_student", "initialize",
           "distill", "evaluate", "save"]
