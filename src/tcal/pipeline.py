"""One run: teacher -> keep list -> student -> init -> training stages -> eval -> export (docs/method.md, section
"One run").

`run(settings, run_dir)`, what the `tcal` entry calls with the settings it converted (`tcal.settings`), is the recipe:
the steps of one `tcal.run.Run` (`Run.build`), whose settings are checked against the machine, the files and the teacher
(`tcal.preflight`) and whose stages are planned, once, before anything is written. Its `Record` takes what each step
found and rewrites results.json atomically ("status"), and at every curve point (`RecordCallback`), so a crash leaves
a readable record. With `stage=none` the evaluation is zero-shot. A multi-device run starts its ranks first
(`tcal.runtime.distributed`); every rank holds the teacher and the student on its own device, the per-layer work is
split across ranks, the evaluations are Lightning validation over all ranks, and rank 0 writes results.json and
exports. A resumed run keeps what its record held; a failure or a signal (`tcal.runtime.signals`) marks it failed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from tcal.evaluate.suite import format_table
from tcal.runtime.distributed import Ranks
from tcal.run import Run
from tcal.runtime.signals import handling
from tcal.settings import RunSettings
from tcal.store.fingerprint import weights_digest
from tcal.store.record import Record, records_failure
from tcal.store.rerun import holds_folder
from tcal.tracking import finish, log_figures, make_logger, wandb_identity
from tcal.training.run import data_record

log = logging.getLogger(__name__)


class RecordCallback(L.Callback):
    """Hands the run's `Record` the stage's curve so far at every evaluation's end (rank 0 holds the curve)."""

    def __init__(self, record: Record):
        self.record = record

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.record.stage_point(pl_module.kind, pl_module.curve)


@records_failure
@handling
@holds_folder
def run(settings: RunSettings, run_dir: str | Path, resume: bool = False, callbacks: list | None = None,
        ranks: Ranks | None = None) -> dict:
    """The whole job in the recipe's seven steps: prepare and check, select layers, build the student (the record
    begins), initialize, train the stages, evaluate, export and complete the record; returns the record. `resume`
    continues the run in `run_dir` from its last stage checkpoint; `ranks`: this process's place among the run's
    launched processes (`tcal.runtime.distributed.launch`), None for one process."""
    this_run = Run.build(settings, run_dir=Path(run_dir), resume=resume, ranks=ranks)
    record = this_run.record
    with record.timed("retention"):
        selection = this_run.select()
    with record.timed("convert"):
        student = this_run.build_student(selection.keep_layers)
    wandb = wandb_identity(settings, record.earlier) if settings.logger.name == "wandb" else None
    record.converted(settings.tree(), this_run.num_layers, selection.keep_layers, selection.scores,
                     this_run.kernel_path, retention_details=selection.details or None,
                     data=data_record(this_run.plans), wandb=wandb, inputs=this_run.inputs or None)
    log.info("keep layers (%s): %s; GDN kernel path: %s", settings.retention.name, selection.keep_layers,
             this_run.kernel_path)
    with record.timed("init"):
        calibration = this_run.initialize(student)
    record.initialized(calibration, weights_digest(student))
    this_run.logger = make_logger(settings, this_run.run_dir, wandb)
    this_run.extra_callbacks = [RecordCallback(record), *(callbacks or [])]
    student = this_run.train(student, record.stage_finished)[0]
    log.info("final evaluation: %s", ", ".join(name for name, on in (("perplexity", True), (
        "harness", settings.eval.harness.name != "none"), ("RULER", settings.eval.ruler.name != "none")) if on))
    with record.timed("evaluate"):
        record.evaluated(this_run.evaluate(student))
    if not this_run.ranks.is_main:
        return record.fields
    print(format_table(record.fields), flush=True)
    figures = {"eval": {k: record.fields[k] for k in ("metrics", "harness", "ruler") if k in record.fields}}
    plans = this_run.plans
    log_figures(this_run.logger, figures, record.fields["stages"][plans[-1].kind]["tokens_seen"] if plans else 0)
    finish(this_run.logger)
    if settings.save_student:
        with record.timed("save"):
            record.saved(this_run.save(student))
    record.complete()
    print(f"results: {record.path}", flush=True)
    return record.fields
