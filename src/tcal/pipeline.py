"""One run: teacher -> keep list -> student -> init -> training stages -> eval -> export (docs/method.md, section
"One run").

`run(settings, run_dir)`, what the `tcal` entry calls with the settings it converted (`tcal.settings`), is the recipe:
the steps of the Python API (`tcal.api`) on one `Run`, whose settings are checked against the machine, the files
and the teacher (`tcal.preflight`) and whose stages are planned, once, before anything is written. Its `Record`
rewrites results.json atomically after each step ("status") and at every curve point, so a crash leaves a readable
record. With `stage=none` the evaluation is zero-shot. A multi-device run starts its ranks first
(`tcal.runtime.distributed`); every rank holds the teacher and the student on its own device, the per-layer work is
split across ranks, the evaluations are Lightning validation over all ranks, and rank 0 writes results.json and
exports. A resumed run keeps what its record held; a failure or a signal (`tcal.runtime.signals`) marks it failed.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tcal import api
from tcal.context import RunContext
from tcal.data.documents import changed_inputs, input_digests
from tcal.evaluate.suite import evaluate, format_table
from tcal.preflight import check_loaded, check_machine
from tcal.runtime.distributed import Ranks
from tcal.runtime.signals import handling
from tcal.settings import RunSettings
from tcal.store.files import check_folder_target
from tcal.store.fingerprint import weights_digest
from tcal.store.record import Record, new_record, read_record, records_failure
from tcal.store.rerun import check_checkpoints, check_same_inputs, holds_folder
from tcal.student.gdn import kernel_path
from tcal.tracking import finish, log_figures, make_logger, wandb_identity
from tcal.training.run import RecordCallback, StagePlan, data_record, plan_stages, train_stages

log = logging.getLogger(__name__)


@contextmanager
def timed(timings: dict, step: str):
    start = time.perf_counter()
    yield
    timings[step] = round(time.perf_counter() - start, 3)


@dataclass
class Run(RunContext):
    """One run, built once from complete settings (`Run.prepare`): what its steps read (its `RunContext`), the stages
    planned, the steps' timings, and from the conversion on its record and metrics logger."""

    plans: list[StagePlan] = field(default_factory=list)
    resume: bool = False
    inputs: dict = field(default_factory=dict)  # what it reads, as digests (`tcal.data.documents.input_digests`)
    timings: dict = field(default_factory=dict)
    record: Record | None = None
    logger: object = None

    @classmethod
    def prepare(cls, settings: RunSettings, run_dir: Path, resume: bool = False, ranks: Ranks | None = None) -> Run:
        """Every check before any work, the teacher (on this rank's device) and splits loaded, the stages planned: a
        refusal or a failed load on any rank (a training split too short for one sequence) stops every rank alike."""
        timings: dict[str, float] = {}
        ranks = ranks or Ranks()
        with ranks.together():
            check_machine(settings)
            if settings.save_student:
                check_folder_target(run_dir / "student")  # a `student/` tcal did not write is refused before any work
            if resume:
                check_checkpoints(run_dir)  # a damaged one is named before any work
            torch.manual_seed(int(settings.seed))
            torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
            with timed(timings, "load_data"):
                splits = api.load_data(settings.data)
                inputs = input_digests(settings.data, splits)
            recorded = (read_record(run_dir) or {}).get("inputs") if resume else None
            if recorded:  # a run continues on the data it started with (a record older than `inputs`: unchecked)
                check_same_inputs(run_dir, changed_inputs(recorded, inputs, settings.data))
            with timed(timings, "load_teacher"):
                teacher = api.load_teacher(settings.teacher, settings.paths.cache_dir, ranks.device)
            this_run = cls(settings, teacher.model, teacher.tokenizer, splits, Path(settings.paths.cache_dir),
                           run_dir, ranks=ranks, resume=resume, timings=timings, inputs=inputs)
            check_loaded(this_run)
            with timed(timings, "load_training_data"):
                this_run.plans = plan_stages(this_run)
        return this_run

    def begin_record(self, selection) -> Record:
        """The record of the converted student, written; a resume continues the one on disk."""
        earlier = read_record(self.run_dir) if self.resume else None
        wandb = wandb_identity(self.settings, earlier) if self.settings.logger.name == "wandb" else None
        fields = new_record(self.settings.tree(), self.num_layers, selection.keep_layers, selection.scores,
                            kernel_path(self.device), self.timings, retention_details=selection.details or None,
                            data=data_record(self.plans), wandb=wandb, inputs=self.inputs or None)
        self.record = Record(self.run_dir, fields, earlier, writer=self.ranks.is_main)
        self.record.save()
        log.info("keep layers (%s): %s; GDN kernel path: %s", self.settings.retention.name, selection.keep_layers,
                 kernel_path(self.device))
        return self.record

    def train(self, student, callbacks: list):
        """The planned stages; the record takes each curve point and finished stage first (`RecordCallback`)."""
        self.logger = make_logger(self.settings, self.run_dir, self.record.fields.get("wandb"))
        self.extra_callbacks = [RecordCallback(self.record), *callbacks]
        return train_stages(self.plans, self, student, self.logger, self.resume)[0]

    def finish(self, student) -> dict:
        """On rank 0: the table, the logger's last figures, the export, and the record complete."""
        fields = self.record.fields
        if not self.ranks.is_main:
            return fields
        print(format_table(fields), flush=True)
        figures = {"eval": {k: fields[k] for k in ("metrics", "harness", "ruler") if k in fields}}
        log_figures(self.logger, figures, fields["stages"][self.plans[-1].kind]["tokens_seen"] if self.plans else 0)
        finish(self.logger)
        if self.settings.save_student:
            with timed(self.timings, "save"):
                api.save(student, self.tokenizer, self.run_dir / "student")
            fields["student_path"] = str(self.run_dir / "student")
        self.record.save(status="complete")
        print(f"results: {self.record.path}", flush=True)
        return fields


@records_failure
@handling
@holds_folder
def run(settings: RunSettings, run_dir: str | Path, resume: bool = False, callbacks: list | None = None,
        ranks: Ranks | None = None) -> dict:
    """The whole job in the recipe's seven steps: prepare and check, select layers, build the student (the record
    begins), initialize, train the stages, evaluate, export and complete the record; returns the record. `resume`
    continues the run in `run_dir` from its last stage checkpoint; `ranks`: this process's place among the run's
    launched processes (`tcal.runtime.distributed.launch`), None for one process."""
    this_run = Run.prepare(settings, Path(run_dir), resume, ranks)
    timings, teacher = this_run.timings, api.Teacher(this_run.teacher, this_run.tokenizer, settings.teacher)
    with timed(timings, "retention"):
        selection = api.select_layers(teacher, this_run.splits, settings.retention, settings.init,
                                      settings.calibration, settings.seed, this_run.cache_dir, this_run.ranks,
                                      settings.data, settings.trainer)
    with timed(timings, "convert"):
        student = api.build_student(teacher, selection.keep_layers, settings.init.gqa_expansion,
                                    settings.seed).to(this_run.device)
    record = this_run.begin_record(selection)
    with timed(timings, "init"):
        calibration = api.initialize(student, teacher, this_run.splits, settings.init, settings.calibration,
                                     settings.seed, this_run.cache_dir, this_run.ranks, settings.data, settings.trainer)
    record.save(status="initialized", calibration=calibration, init_weights_digest=weights_digest(student))
    student = this_run.train(student, list(callbacks or [])).eval()
    log.info("final evaluation: %s", ", ".join(name for name, on in (("perplexity", True), (
        "harness", settings.eval.harness.name != "none"), ("RULER", settings.eval.ruler.name != "none")) if on))
    with timed(timings, "evaluate"):
        record.fields.update(evaluate(this_run, student))
    return this_run.finish(student)
