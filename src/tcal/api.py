"""The library from Python, without Hydra: typed settings (`tcal.config`) and objects in, objects out.

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
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tcal.config import (
    CalibrationSettings,
    DataSettings,
    DistillSettings,
    EvalSettings,
    InitSettings,
    RunSettings,
    StageSequenceSettings,
    StageSettings,
    TeacherSettings,
    TrainerSettings,
    default_teacher,
)
from tcal.context import RunContext
from tcal.data import Splits, load_splits
from tcal.distributed import Ranks
from tcal.retention import Selection


@dataclass
class Teacher:
    """A loaded teacher: the model (eval mode, frozen), its tokenizer and the settings it came from."""

    model: torch.nn.Module
    tokenizer: object
    settings: TeacherSettings

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


def default_cache_dir() -> Path:
    """Where `tcal` keeps its caches (conf/paths/default.yaml): $TCAL_CACHE_DIR, else .cache/tcal."""
    return Path(os.environ.get("TCAL_CACHE_DIR") or ".cache/tcal")


def context(teacher: Teacher, splits: Splits, settings: RunSettings, cache_dir=None, run_dir=None,
            ranks: Ranks | None = None) -> RunContext:
    """The `RunContext` the library's steps read, for one call."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = Path(run_dir) if run_dir is not None else Path("outputs") / "python_api"  # stage checkpoints only
    return RunContext(dataclasses.replace(settings, teacher=teacher.settings), teacher.model, teacher.tokenizer,
                      splits, cache, folder, ranks=ranks or Ranks())


def checked(check, settings: RunSettings) -> None:
    """Run one of `tcal.validate`'s checks on typed settings (the same messages as for `tcal`)."""
    check(OmegaConf.structured(settings))


def load_teacher(settings: TeacherSettings | None = None, cache_dir=None, device=None) -> Teacher:
    """The teacher `settings` name, on `device` (default: the CPU)."""
    from tcal.teachers.load import load_teacher as load

    settings = settings or default_teacher()
    model, tokenizer = load(settings, cache_dir if cache_dir is not None else default_cache_dir())
    if device is not None:
        model.to(device)
    return Teacher(model, tokenizer, settings)


def load_data(settings: DataSettings | None = None) -> Splits:
    """The documents of `settings`, split by document into train / calibration / evaluation."""
    return load_splits(settings or DataSettings())


def select_layers(teacher: Teacher, splits: Splits, retention, init: InitSettings | None = None,
                  calibration: CalibrationSettings | None = None, seed: int = 0, cache_dir=None,
                  ranks: Ranks | None = None) -> Selection:
    """The layers that keep softmax attention (`Selection.keep_layers`) by `retention`'s policy; `ga_s2` scores
    students initialized with `init` (and `calibration`)."""
    from tcal.retention import select_layers as select

    settings = RunSettings(retention=retention, init=init or InitSettings(),
                           calibration=calibration or CalibrationSettings(), seed=seed)
    return select(retention, context(teacher, splits, settings, cache_dir, ranks=ranks))


def build_student(teacher: Teacher | torch.nn.Module, keep_layers, gqa_expansion: str = "whole_head",
                  seed: int = 0):
    """The hybrid student: `keep_layers` keep the teacher's attention, every other layer is a naive GDN."""
    from tcal.convert import build_student as build

    model = teacher.model if isinstance(teacher, Teacher) else teacher
    return build(model, list(keep_layers), gqa_expansion, int(seed))


def initialize(student, teacher: Teacher, splits: Splits, init: InitSettings,
               calibration: CalibrationSettings | None = None, seed: int = 0, cache_dir=None,
               ranks: Ranks | None = None) -> dict:
    """Initialize the student's GDN layers in place by init mode `init.name`; returns the calibration record."""
    from tcal.init import init_student
    from tcal.validate import check_calibration, check_init

    settings = RunSettings(init=init, calibration=calibration or CalibrationSettings(), seed=seed)
    checked(check_init, settings)
    checked(check_calibration, settings)
    return init_student(student, init, context(teacher, splits, settings, cache_dir, ranks=ranks))


def distill(student, teacher: Teacher, splits: Splits, stage: StageSettings | None = None,
            tokens: int | None = None, eval: EvalSettings | None = None, data: DataSettings | None = None,
            trainer: TrainerSettings | None = None, seed: int = 0, run_dir=None, cache_dir=None):
    """Train the student for one stage (or a sequence) of `stage` (default: Stage 2 distillation), `tokens`
    replacing its token budget; returns (the trained student, the stage records with their perplexity curves on
    the eval sets of `data`)."""
    from tcal.training.run import plan_stages, run_stage
    from tcal.validate import check_stages

    stage = stage or DistillSettings()
    if tokens is not None:
        stage = with_budget(stage, int(tokens))
    settings = RunSettings(data=data or DataSettings(), stage=stage, eval=eval or EvalSettings(),
                           trainer=trainer or TrainerSettings(), seed=seed)
    checked(check_stages, settings)
    ctx = context(teacher, splits, settings, cache_dir, run_dir)
    records = {}
    for plan in plan_stages(ctx):
        records[plan.kind], student = run_stage(plan, ctx, student, None, lambda curve: None, resume=False)
    return student, records


def with_budget(stage, tokens: int):
    """`stage` with a budget of `tokens` (each stage of a sequence), evaluated at least at its start and end."""
    if isinstance(stage, StageSequenceSettings):
        stages = {kind: with_budget(getattr(stage, kind), tokens) for kind in stage.sequence}
        return dataclasses.replace(stage, **stages)
    return dataclasses.replace(stage, max_tokens=tokens, eval_every_tokens=min(stage.eval_every_tokens, tokens))


def evaluate(student, teacher: Teacher, splits: Splits, eval: EvalSettings | None = None,
             data: DataSettings | None = None, trainer: TrainerSettings | None = None, cache_dir=None,
             ranks: Ranks | None = None) -> dict:
    """Teacher and student perplexity on the eval sets of `data` (plus the harness and RULER that `eval` names):
    the `metrics`, `harness` and `ruler` entries of a results.json."""
    from tcal.evaluate.suite import evaluate as run_evaluation
    from tcal.validate import check_eval

    settings = RunSettings(data=data or DataSettings(), eval=eval or EvalSettings(),
                           trainer=trainer or TrainerSettings())
    checked(check_eval, settings)
    student.eval()
    return run_evaluation(context(teacher, splits, settings, cache_dir, ranks=ranks), student)


def save(student, tokenizer, folder) -> Path:
    """save_pretrained of the student and tokenizer into `folder`, written whole or not at all."""
    from tcal.results import write_folder_atomic

    def write(tmp: Path) -> None:
        student.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_folder_atomic(Path(folder), write)
    return Path(folder)


__all__ = ["Teacher", "load_teacher", "load_data", "select_layers", "build_student", "initialize",
           "distill", "evaluate", "save"]
