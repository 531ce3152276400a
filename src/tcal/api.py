"""The library from Python, without Hydra: typed settings (`tcal.settings`) and objects in, objects out.

    teacher = api.load_teacher(default_teacher())            # or tiny_teacher(): 4 random layers, for a quick try
    splits = api.load_data(DataSettings())
    keep = api.select_layers(teacher, splits, RetentionSettings(ratio=0.5)).keep_layers
    student = api.build_student(teacher, keep)
    api.initialize(student, teacher, splits, init_settings("full_plus"))
    student, record = api.distill(student, teacher, splits, DistillSettings(), tokens=100_000)
    results = api.evaluate(student, teacher, splits, EvalSettings())
    api.save(student, teacher.tokenizer, "student")

These are the steps `tcal` runs: each is a method of one `Run` (its complete settings, the loaded teacher and data),
which `tcal.pipeline` calls in order on the `Run` it prepared; each function here builds a `Run` from the settings it
was given and the defaults of the rest, and calls its step. On-disk caches (calibrated layers, retention scores,
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
import logging
import numbers
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tcal.context import RunContext
from tcal.data.documents import Splits, changed_inputs, input_digests, load_splits
from tcal.init import init_student
from tcal.preflight import (
    check_budgets,
    check_fit,
    check_keep_list,
    check_loaded,
    check_machine,
    check_ruler_room,
    check_split_tokens,
    check_trainer,
)
from tcal.retention import Selection
from tcal.retention import select_layers as policy_selection
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
from tcal.store.files import check_folder_target
from tcal.store.record import Record, read_record
from tcal.store.rerun import check_checkpoints, check_same_inputs, holding_folder

log = logging.getLogger(__name__)
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


@dataclass
class Run(RunContext):
    """One run: complete settings, the loaded teacher and documents, and the steps as methods (select, build the
    student, initialize, train, evaluate, save), each reading the settings it needs from `settings`. `tcal` builds
    one with `Run.prepare` (every check before any work) and runs its steps (`tcal.pipeline.run`); each function
    below builds one with `Run.of` for its one step and makes that step's checks."""

    plans: list | None = None  # the stages (`tcal.training.run.StagePlan`), planned once: by `prepare` or training
    resume: bool = False  # each stage continues from its checkpoint in `run_dir`
    inputs: dict = field(default_factory=dict)  # what it reads, as digests (`tcal.data.documents.input_digests`)
    record: Record | None = None  # `tcal`'s record, from `prepare` (its timings from the start)
    logger: object = None  # a Lightning logger on every stage's Trainer

    @classmethod
    def prepare(cls, settings: RunSettings, run_dir: Path, resume: bool = False, ranks: Ranks | None = None) -> Run:
        """`tcal`'s run: every check before any work, the teacher (on this rank's device) and splits loaded, the
        stages planned, its record (a resume's continues the one on disk): a refusal or a failed load on any rank (a
        training split too short for one sequence) stops every rank alike."""
        from tcal.training.run import plan_stages

        ranks = ranks or Ranks()
        with ranks.together():
            check_machine(settings)
            if settings.save_student:
                check_folder_target(run_dir / "student")  # a `student/` tcal did not write is refused before any work
            if resume:
                check_checkpoints(run_dir)  # a damaged one is named before any work
            record = Record(run_dir, read_record(run_dir) if resume else None, writer=ranks.is_main)
            torch.manual_seed(int(settings.seed))
            torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
            with record.timed("load_data"):
                splits = load_data(settings.data)
                inputs = input_digests(settings.data, splits)
            recorded = (record.earlier or {}).get("inputs")
            if recorded:  # a run continues on the data it started with (a record older than `inputs`: unchecked)
                check_same_inputs(run_dir, changed_inputs(recorded, inputs, settings.data))
            with record.timed("load_teacher"):
                teacher = load_teacher(settings.teacher, settings.paths.cache_dir, ranks.device)
            this_run = cls(settings, teacher.model, teacher.tokenizer, splits, Path(settings.paths.cache_dir),
                           run_dir, ranks=ranks, resume=resume, inputs=inputs, record=record)
            check_loaded(this_run)
            with record.timed("load_training_data"):
                this_run.plans = plan_stages(this_run)
        return this_run

    @classmethod
    def of(cls, teacher: Teacher, splits: Splits, settings: RunSettings, cache_dir=None, run_dir=None,
           ranks: Ranks | None = None, **fields) -> Run:
        """A run for one step of the library (`settings` from `step_settings`); the step's checks are the caller's."""
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        folder = Path(run_dir) if run_dir is not None else Path("outputs") / "python_api"  # stage checkpoints only
        return cls(settings, teacher.model, teacher.tokenizer, splits, cache, folder, ranks=ranks or Ranks(), **fields)

    def select(self) -> Selection:
        """The layers that keep softmax attention, by the `retention` policy."""
        return policy_selection(self.settings.retention, self)

    def build_student(self, keep_layers: list[int]):
        """The hybrid student on this rank's device (`init.gqa_expansion`, `seed`)."""
        from tcal.student.convert import build_student as build

        return build(self.teacher, list(keep_layers), self.settings.init.gqa_expansion,
                     int(self.settings.seed)).to(self.device)

    def initialize(self, student) -> dict:
        """The student's GDN layers initialized in place by `init`; returns what the mode measured."""
        return init_student(student, self.settings.init, self)

    def train(self, student, stage_finished=None):
        """The stages of `stage` (planned once), `logger` and `extra_callbacks` on every stage's Trainer; returns (the
        trained student, the stage records). `stage_finished(kind, stage record, seconds)` hears each stage end.
        Under a mixed precision the student trains on float32 weights."""
        from tcal.training.run import plan_stages, run_stage

        if self.plans is None:
            self.plans = plan_stages(self)
        if self.plans and self.settings.trainer.mixed and student.dtype != torch.float32:
            log.info("trainer.precision=%s: the student trains on float32 weights (it was %s); compute is autocast",
                     self.settings.trainer.precision, student.dtype)
            student.float()
        records = {}
        for plan in self.plans:
            start = time.perf_counter()
            records[plan.kind], student = run_stage(plan, self, student, self.logger, self.resume)
            if stage_finished is not None:
                stage_finished(plan.kind, records[plan.kind], round(time.perf_counter() - start, 3))
        return student, records

    def evaluate(self, student) -> dict:
        """The `metrics` (and `harness`, `ruler`) of `eval` on the student, in eval mode."""
        from tcal.evaluate.suite import evaluate

        return evaluate(self, student.eval())

    def save(self, student) -> Path:
        """The student and tokenizer exported to `run_dir/student` (`save`)."""
        return save(student, self.tokenizer, self.run_dir / "student")


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
    settings = step_settings(teacher, retention=retention, init=init or InitSettings(), calibration=calibration,
                             seed=seed, data=data, trainer=trainer)
    check_keep_list(settings, teacher.num_layers)
    initializes = retention.initializes_layers()
    check_fit([*retention.teacher_lengths(), *([("calibration.seq_len", settings.calibration.seq_len)]
                                               if initializes else [])], context_length(teacher))
    this_run = Run.of(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(this_run, ("retention", "init") if initializes else ("retention",))
    return this_run.select()


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
    settings = step_settings(teacher, init=init, calibration=calibration, seed=seed, data=data, trainer=trainer)
    if settings.calibrates():
        check_fit([("calibration.seq_len", settings.calibration.seq_len)], context_length(teacher))
    this_run = Run.of(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(this_run, ("init",))  # the CLI's message naming the key, not a bare ValueError mid-init
    return this_run.initialize(student)


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
    This is the training `tcal` runs (`Run.train`)."""
    stage = stage or DistillSettings()
    if tokens is not None:
        stage = with_budget(stage, int(tokens))
    settings = step_settings(teacher, data=data, stage=stage, eval=eval, trainer=trainer, seed=seed)
    check_trainer(settings.trainer)
    check_budgets(settings)
    check_fit([*((f"{key}.seq_len", node.seq_len) for key, node in settings.stage.stages()),
               *settings.eval.lengths()], context_length(teacher))
    this_run = Run.of(teacher, splits, settings, cache_dir, run_dir, ranks, resume=resume, logger=logger,
                      extra_callbacks=list(callbacks or []))
    check_split_tokens(this_run, ("eval",))  # the stages' curves are measured on these windows
    # its checkpoints: one live run per folder (held by rank 0), as for `tcal`
    with holding_folder(this_run.run_dir) if this_run.ranks.is_main else contextlib.nullcontext():
        return this_run.train(student)


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
    settings = step_settings(teacher, data=data, eval=eval, trainer=trainer)
    check_trainer(settings.trainer)
    check_fit(settings.eval.lengths(), context_length(teacher))  # the same check as `tcal`'s, on the loaded teacher
    this_run = Run.of(teacher, splits, settings, cache_dir, ranks=ranks)
    check_split_tokens(this_run, ("eval",))
    check_ruler_room(this_run)
    return this_run.evaluate(student)


@step
def save(student: torch.nn.Module, tokenizer, folder: PathLike) -> Path:
    """save_pretrained of the student and tokenizer into `folder`, written whole or not at all. `folder` must be new,
    empty, or an earlier export of tcal (its manifest lists every file there): anything else there (a user's
    notes.txt, the working folder) is refused, naming it, and nothing is deleted (`tcal.student.export`)."""
    from tcal.student.export import export_student

    return export_student(student, tokenizer, Path(folder))


__all__ = ["Teacher", "Run", "load_teacher", "load_data", "select_layers", "build_student", "initialize",
           "distill", "evaluate", "save"]
