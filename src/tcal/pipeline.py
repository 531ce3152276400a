"""One run: teacher -> keep list -> student -> init -> training stages -> eval -> export (docs/method.md, section
"One run").

`run(settings, run_dir)` is what the `tcal` entry calls with the settings it converted (`tcal.settings`); it runs
the steps of the Python API (`tcal.api`). What the settings need of the machine, the files and the teacher is
checked once before anything is written (`tcal.preflight`); results.json is rewritten atomically after each step ("status" says how far
the run got) and at every curve point, so a crash leaves a readable record. With `stage=none` the evaluation
is zero-shot. A multi-device run starts its ranks first (`tcal.runtime.distributed`); every rank then holds the teacher
and the student on its own device, the per-layer work is split across ranks, the evaluations are Lightning
validation over all ranks, and rank 0 writes results.json and exports.
A resumed run keeps what its record held, and a failure or a signal (`tcal.runtime.signals`) marks the record "failed"
(`tcal.store.record`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tcal import api
from tcal.context import RunContext
from tcal.evaluate.suite import format_table
from tcal.preflight import check_loaded, check_machine
from tcal.runtime.distributed import Ranks
from tcal.runtime.signals import handling
from tcal.settings import RunSettings
from tcal.store.files import check_folder_target
from tcal.store.fingerprint import weights_digest
from tcal.store.record import RESULTS, new_record, read_record, records_failure, write_record
from tcal.store.rerun import check_checkpoints, holds_folder
from tcal.student.gdn import kernel_path
from tcal.tracking import finish, log_figures, make_logger, wandb_identity
from tcal.training.run import data_record, plan_stages

log = logging.getLogger(__name__)


@contextmanager
def timed(timings: dict, step: str):
    start = time.perf_counter()
    yield
    timings[step] = round(time.perf_counter() - start, 3)


def prepare(settings: RunSettings, run_dir: Path, timings: dict, ranks: Ranks | None = None) -> RunContext:
    """The run's teacher (on this rank's device) and its splits."""
    torch.manual_seed(int(settings.seed))
    torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
    if settings.eval.harness.name == "paper":
        from tcal.evaluate.local_tasks import check_paper_tasks_available

        check_paper_tasks_available()  # fail before any work when the dataset hub is unreachable
    ranks = ranks or Ranks()
    with timed(timings, "load_teacher"):
        teacher = api.load_teacher(settings.teacher, settings.paths.cache_dir, ranks.device)
    with timed(timings, "load_data"):
        splits = api.load_data(settings.data)
    return RunContext(settings, teacher.model, teacher.tokenizer, splits, Path(settings.paths.cache_dir),
                      Path(run_dir), ranks=ranks)


@records_failure
@handling
@holds_folder
def run(settings: RunSettings, run_dir: str | Path, resume: bool = False, callbacks: list | None = None,
        ranks: Ranks | None = None) -> dict:
    """The whole job; `resume=True` continues the run in `run_dir` from its last stage checkpoint. `ranks`: this
    process's place among the run's launched processes (`tcal.runtime.distributed.launch`); None is one process."""
    run_dir = Path(run_dir)
    ranks = ranks or Ranks()
    with ranks.together():  # a refusal or a failed load on any rank stops every rank with the same error
        check_machine(settings)
        if settings.save_student:
            check_folder_target(run_dir / "student")  # a `student/` tcal did not write is refused before any work
        if resume:
            check_checkpoints(run_dir)  # a damaged one is named before any work
        timings: dict[str, float] = {}
        ctx = prepare(settings, run_dir, timings, ranks)
        check_loaded(ctx)
        with timed(timings, "load_training_data"):
            plans = plan_stages(ctx)  # a training split too short for one sequence fails here, before any work
    writer = ctx.ranks.is_main
    teacher = api.Teacher(ctx.teacher, ctx.tokenizer, settings.teacher)
    with timed(timings, "retention"):
        selection = api.select_layers(teacher, ctx.splits, settings.retention, settings.init, settings.calibration,
                                      settings.seed, ctx.cache_dir, ctx.ranks, settings.data, settings.trainer)
    with timed(timings, "convert"):
        student = api.build_student(ctx.teacher, selection.keep_layers, settings.init.gqa_expansion, settings.seed)
        student.to(ctx.device)
    device = ctx.device
    results = new_record(
        teacher=settings.teacher.name, num_layers=ctx.num_layers, retention=settings.retention.name,
        ratio=getattr(settings.retention, "ratio", None), keep_layers=selection.keep_layers,
        retention_scores=selection.scores, init_mode=settings.init.name, gqa_expansion=settings.init.gqa_expansion,
        stage=settings.stage.label(), kernel_path=kernel_path(device), config=settings.tree(),
        timings=timings)
    if selection.details:
        results["retention_details"] = selection.details
    if plans:
        results["data"] = data_record(plans)
    results_path = run_dir / RESULTS
    earlier = read_record(run_dir) if resume else None
    if settings.logger.name == "wandb":
        results["wandb"] = wandb_identity(settings, earlier)

    def save_results() -> None:
        if writer:
            write_record(results_path, results, earlier)

    save_results()
    log.info("keep layers (%s): %s; GDN kernel path: %s", settings.retention.name, selection.keep_layers, kernel_path(device))

    with timed(timings, "init"):
        results["calibration"] = api.initialize(student, teacher, ctx.splits, settings.init, settings.calibration,
                                                settings.seed, ctx.cache_dir, ctx.ranks, settings.data,
                                                settings.trainer)
    results["init_weights_digest"] = weights_digest(student)
    results["status"] = "initialized"
    save_results()

    logger = make_logger(settings, run_dir, results.get("wandb"))
    tokens_seen = 0
    if plans:
        def on_curve(kind: str, curve: dict) -> None:
            results.setdefault("stages", {}).setdefault(kind, {})["curve"] = curve
            results["curve"] = curve
            save_results()

        def on_stage(kind: str, record: dict, seconds: float) -> None:
            nonlocal tokens_seen
            timings[f"stage_{kind}"] = seconds
            results.setdefault("stages", {})[kind] = record
            results["curve"] = record["curve"]
            results["status"] = f"trained_{kind}"
            tokens_seen = record["tokens_seen"]
            save_results()

        progress = api.StageProgress(resume=resume, logger=logger, callbacks=list(callbacks or []),
                                     on_curve=on_curve, on_stage=on_stage)
        student, _ = api.distill(student, teacher, ctx.splits, settings.stage, eval=settings.eval,
                                 data=settings.data, trainer=settings.trainer, seed=settings.seed, run_dir=run_dir,
                                 cache_dir=ctx.cache_dir, ranks=ctx.ranks, progress=progress)

    student.eval()
    log.info("final evaluation: %s", ", ".join(n for n in ("perplexity", settings.eval.harness.name != "none" and
                                                           "harness", settings.eval.ruler.name != "none" and "RULER")
                                               if n))
    with timed(timings, "evaluate"):
        results.update(api.evaluate(student, teacher, ctx.splits, settings.eval, settings.data, settings.trainer,
                                    ctx.cache_dir, ctx.ranks))
    if not writer:
        return results
    print(format_table(results), flush=True)
    log_figures(logger, {"eval": {k: results[k] for k in ("metrics", "harness", "ruler") if k in results}}, tokens_seen)
    finish(logger)
    if settings.save_student:
        with timed(timings, "save"):
            api.save(student, ctx.tokenizer, run_dir / "student")
        results["student_path"] = str(run_dir / "student")
    results["status"] = "complete"
    save_results()
    print(f"results: {results_path}", flush=True)
    return results
