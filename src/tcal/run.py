"""`Run`: one run's complete settings, its loaded teacher and documents, its GDN kernel, and its steps as methods.

There is one way to make one, `Run.build(settings, steps, ...)`, taken by `tcal` (`tcal.pipeline.run`: every step,
the teacher and documents loaded here) and by each function of the Python API (`tcal.api`: one step, on the teacher
and documents it was given). It makes the checks those steps need, from one table (`tcal.preflight.STEP_NEEDS`), and
chooses the delta rule's kernel for this run (`trainer.gdn_kernel`), which every student it touches then runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tcal.context import RunContext
from tcal.data.documents import Splits, changed_inputs, input_digests, load_splits
from tcal.errors import ConfigError
from tcal.init import init_student
from tcal.preflight import STEPS, check_loaded, check_machine, check_steps, configured_shape
from tcal.retention import Selection
from tcal.retention import select_layers as policy_selection
from tcal.runtime.distributed import Ranks
from tcal.settings import RunSettings, TeacherSettings
from tcal.store.files import check_folder_target
from tcal.store.record import Record, read_record
from tcal.store.rerun import check_checkpoints, check_same_inputs
from tcal.student.gdn import kernel_path, use_gdn_kernel

log = logging.getLogger(__name__)
# what a student's config records of its teacher and a teacher of other values cannot run (`check_student_teacher`)
TEACHER_SHAPE = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size")


@dataclass
class Teacher:
    """A loaded teacher: the model (eval mode, frozen), its tokenizer and the settings it came from."""

    model: torch.nn.Module
    tokenizer: object
    settings: TeacherSettings

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


def load_teacher(settings: TeacherSettings, cache_dir, device=None) -> Teacher:
    """The teacher `settings` name, on `device` (default: the CPU)."""
    from tcal.teachers.load import load_teacher as load

    model, tokenizer = load(settings, cache_dir)
    if device is not None:
        model.to(device)
    return Teacher(model, tokenizer, settings)


def check_student_teacher(student, teacher: torch.nn.Module) -> None:
    """The student was converted from a teacher of `teacher`'s family and shape (its config records that teacher):
    a student of another teacher would calibrate or distill against the wrong one without a word."""
    recorded, given = student.config.teacher_config, teacher.config
    for key in TEACHER_SHAPE:
        if getattr(recorded, key, None) != getattr(given, key, None):
            raise ConfigError(f"student: converted from a teacher with {key}={getattr(recorded, key, None)!r}, but "
                              f"the teacher given has {key}={getattr(given, key, None)!r}; expected the teacher the "
                              f"student was converted from (its config.teacher_config)")


@dataclass
class Run(RunContext):
    """One run: complete settings, the loaded teacher and documents, the GDN kernel, and the steps as methods
    (select, build the student, initialize, train, evaluate, save), each reading the settings it needs from
    `settings`. Made by `Run.build` alone."""

    plans: list | None = None  # the stages (`tcal.training.run.StagePlan`), planned once: by `build` or training
    resume: bool = False  # each stage continues from its checkpoint in `run_dir`
    inputs: dict = field(default_factory=dict)  # what it reads, as digests (`tcal.data.documents.input_digests`)
    record: Record | None = None  # `tcal`'s record, from `build` (its timings from the start)
    logger: object = None  # a Lightning logger on every stage's Trainer

    @classmethod
    def build(cls, settings: RunSettings, steps: tuple[str, ...] = STEPS, teacher: Teacher | None = None,
              splits: Splits | None = None, run_dir=None, resume: bool = False, ranks: Ranks | None = None,
              **fields) -> Run:
        """The run of `steps`, every check they need made before any work (a refusal on any rank stops every rank
        alike). Without a `teacher` it is `tcal`'s: the machine and files checked, the documents and the teacher (on
        this rank's device) loaded, the stages planned and its record begun (a resume's continues the one on disk).
        With the `teacher` and `splits` of the Python API, it checks the steps against them."""
        ranks = ranks or Ranks()
        run_dir = Path(run_dir) if run_dir is not None else Path("outputs") / "python_api"  # stage checkpoints
        with ranks.together():
            if teacher is None:
                return cls.loaded(settings, steps, run_dir, resume, ranks, **fields)
            on_cuda = next(teacher.model.parameters()).is_cuda
            this_run = cls(settings, teacher.model, teacher.tokenizer, splits, Path(settings.paths.cache_dir), run_dir,
                           ranks=ranks, gdn_kernel=check_steps(settings, steps, on_cuda), resume=resume, **fields)
            check_loaded(this_run, steps)
        return this_run

    @classmethod
    def loaded(cls, settings: RunSettings, steps, run_dir: Path, resume: bool, ranks: Ranks, **fields) -> Run:
        """`tcal`'s road of `build`: what the files and this machine hold checked, then loaded and checked."""
        from tcal.training.run import plan_stages

        kernel = check_machine(settings, steps)
        if settings.save_student:
            check_folder_target(run_dir / "student")  # a `student/` tcal did not write is refused before any work
        if resume:
            check_checkpoints(run_dir)  # a damaged one is named before any work
        record = Record(run_dir, read_record(run_dir) if resume else None, writer=ranks.is_main)
        torch.manual_seed(int(settings.seed))
        torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
        with record.timed("load_data"):
            splits = load_splits(settings.data)
            inputs = input_digests(settings.data, splits)
        recorded = (record.earlier or {}).get("inputs")
        if recorded:  # a run continues on the data it started with (a record older than `inputs`: unchecked)
            check_same_inputs(run_dir, changed_inputs(recorded, inputs, settings.data))
        with record.timed("load_teacher"):
            teacher = load_teacher(settings.teacher, settings.paths.cache_dir, ranks.device)
        this_run = cls(settings, teacher.model, teacher.tokenizer, splits, Path(settings.paths.cache_dir), run_dir,
                       ranks=ranks, gdn_kernel=kernel, resume=resume, inputs=inputs, record=record, **fields)
        check_loaded(this_run, steps, configured_shape(settings.teacher))
        with record.timed("load_training_data"):
            this_run.plans = plan_stages(this_run)
        return this_run

    @property
    def kernel_path(self) -> str:
        """The delta rule's implementation on this run's device (recorded as `kernel_path`)."""
        return kernel_path(self.device, self.gdn_kernel)

    def student_of(self, student):
        """`student`, of this run's teacher, running this run's kernel."""
        check_student_teacher(student, self.teacher)
        return use_gdn_kernel(student, self.gdn_kernel)

    def select(self) -> Selection:
        """The layers that keep softmax attention, by the `retention` policy."""
        return policy_selection(self.settings.retention, self)

    def build_student(self, keep_layers: list[int]):
        """The hybrid student on this rank's device (`init.gqa_expansion`, `seed`)."""
        from tcal.student.convert import build_student as build

        if not isinstance(keep_layers, (list, tuple)):
            raise ConfigError(f"keep_layers={keep_layers!r}; expected a list of layer indices")
        student = build(self.teacher, list(keep_layers), self.settings.init.gqa_expansion, int(self.settings.seed))
        return use_gdn_kernel(student.to(self.device), self.gdn_kernel)

    def initialize(self, student) -> dict:
        """The student's GDN layers initialized in place by `init`; returns what the mode measured."""
        return init_student(self.student_of(student), self.settings.init, self)

    def train(self, student, stage_finished=None):
        """The stages of `stage` (planned once), `logger` and `extra_callbacks` on every stage's Trainer; returns (the
        trained student, the stage records). `stage_finished(kind, stage record, seconds)` hears each stage end.
        Under a mixed precision the student trains on float32 weights."""
        from tcal.training.run import plan_stages, run_stage

        student = self.student_of(student)
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

        return evaluate(self, self.student_of(student).eval())

    def save(self, student) -> Path:
        """The student and tokenizer exported to `run_dir/student` (`save`)."""
        from tcal.student.export import export_student

        return export_student(student, self.tokenizer, self.run_dir / "student")
