"""One run: teacher -> keep list -> student -> init -> training stages -> eval -> export (docs/method.md, section
"One run").

`run(cfg, run_dir)` is what the `tcal` entry calls; tests call it with composed configs. It converts the config
into typed settings (`tcal.config.RunSettings`) and runs the steps of the Python API (`tcal.api`). Bad settings fail
before anything is written; results.json is rewritten atomically after each step ("status" says how far
the run got) and at every curve point, so a crash leaves a readable record. With `stage=none` the evaluation
is zero-shot. A multi-device run starts its ranks first (`tcal.distributed`); every rank then holds the teacher
and the student on its own device, the per-layer work is split across ranks, the evaluations are Lightning
validation over all ranks, and rank 0 writes results.json and exports.
A resumed run keeps what its record held, and a failure or a signal (`tcal.signals`) marks the record "failed"
(`tcal.record`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tcal import api
from tcal.config import run_settings
from tcal.context import RunContext
from tcal.distributed import Ranks
from tcal.evaluate.suite import format_table
from tcal.fingerprint import weights_digest
from tcal.gdn import kernel_path
from tcal.record import RESULTS, new_record, read_record, records_failure, write_record
from tcal.rerun import check_checkpoints, holds_folder
from tcal.signals import handling
from tcal.results import check_folder_target
from tcal.tracking import finish, log_figures, make_logger
from tcal.training.run import is_mixed, plan_stages, run_stage
from tcal.validate import validate_config, validate_loaded

log = logging.getLogger(__name__)


@contextmanager
def timed(timings: dict, step: str):
    start = time.perf_counter()
    yield
    timings[step] = round(time.perf_counter() - start, 3)


def prepare(cfg, run_dir: Path, timings: dict, ranks: Ranks | None = None) -> RunContext:
    """The composed config's settings, its teacher (on this rank's device) and its splits."""
    settings = run_settings(cfg)
    torch.manual_seed(int(settings.seed))
    torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
    if settings.eval.harness.name == "paper":
        from tcal.evaluate.local_tasks import check_paper_tasks_available

        check_paper_tasks_available()  # fail before any work when the dataset hub is unreachable
    ranks = ranks or Ranks()
    with timed(timings, "load_teacher"):
        teacher = api.load_teacher(settings.teacher, cfg.paths.cache_dir, ranks.device)
    with timed(timings, "load_data"):
        splits = api.load_data(settings.data)
    return RunContext(settings, teacher.model, teacher.tokenizer, splits, Path(cfg.paths.cache_dir), Path(run_dir),
                      ranks=ranks)


@records_failure
@handling
@holds_folder
def run(cfg, run_dir: str | Path, resume: bool = False, callbacks: list | None = None,
        ranks: Ranks | None = None) -> dict:
    """The whole job; `resume=True` continues the run in `run_dir` from its last stage checkpoint. `ranks`: this
    process's place among the run's launched processes (`tcal.distributed.launch`); None is one process."""
    run_dir = Path(run_dir)
    ranks = ranks or Ranks()
    with ranks.together():  # a refusal or a failed load on any rank stops every rank with the same error
        validate_config(cfg)
        if cfg.save_student:
            check_folder_target(run_dir / "student")  # a `student/` tcal did not write is refused before any work
        if resume:
            check_checkpoints(run_dir)  # a damaged one is named before any work
        timings: dict[str, float] = {}
        ctx = prepare(cfg, run_dir, timings, ranks)
        validate_loaded(ctx)
        ctx.extra_callbacks = list(callbacks or [])
        with timed(timings, "load_training_data"):
            plans = plan_stages(ctx)
    writer = ctx.ranks.is_main
    settings = ctx.settings
    teacher = api.Teacher(ctx.teacher, ctx.tokenizer, settings.teacher)
    with timed(timings, "retention"):
        selection = api.select_layers(teacher, ctx.splits, settings.retention, settings.init, settings.calibration,
                                      settings.seed, ctx.cache_dir, ctx.ranks)
    with timed(timings, "convert"):
        student = api.build_student(ctx.teacher, selection.keep_layers, settings.init.gqa_expansion, settings.seed)
        student.to(ctx.device)
    device = ctx.device
    results = new_record(
        teacher=cfg.teacher.name, num_layers=ctx.num_layers, retention=cfg.retention.name,
        ratio=cfg.retention.get("ratio"), keep_layers=selection.keep_layers, retention_scores=selection.scores,
        init_mode=cfg.init.name, gqa_expansion=cfg.init.gqa_expansion, stage=cfg.stage.name,
        kernel_path=kernel_path(device), config=OmegaConf.to_container(cfg, resolve=True), timings=timings)
    if selection.details:
        results["retention_details"] = selection.details
    results_path = run_dir / RESULTS
    earlier = read_record(run_dir) if resume else None

    def save_results() -> None:
        if writer:
            write_record(results_path, results, earlier)

    save_results()
    log.info("keep layers (%s): %s; GDN kernel path: %s", cfg.retention.name, selection.keep_layers, kernel_path(device))

    with timed(timings, "init"):
        results["calibration"] = api.initialize(student, teacher, ctx.splits, settings.init, settings.calibration,
                                                settings.seed, ctx.cache_dir, ctx.ranks)
    results["init_weights_digest"] = weights_digest(student)
    results["status"] = "initialized"
    save_results()

    logger = make_logger(cfg, run_dir)
    tokens_seen = 0
    if plans and is_mixed(cfg.trainer.precision) and student.dtype != torch.float32:
        log.info("trainer.precision=%s: the student trains on float32 weights (it was %s); compute is autocast",
                 cfg.trainer.precision, student.dtype)
        student.float()
    for plan in plans:
        def on_curve(curve, kind=plan.kind):
            results.setdefault("stages", {}).setdefault(kind, {})["curve"] = curve
            results["curve"] = curve
            save_results()

        with timed(timings, f"stage_{plan.kind}"):
            record, student = run_stage(plan, ctx, student, logger, on_curve, resume)
        results.setdefault("stages", {})[plan.kind] = record
        results["curve"] = record["curve"]
        results["status"] = f"trained_{plan.kind}"
        tokens_seen = record["tokens_seen"]
        save_results()

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
    if cfg.save_student:
        with timed(timings, "save"):
            api.save(student, ctx.tokenizer, run_dir / "student")
        results["student_path"] = str(run_dir / "student")
    results["status"] = "complete"
    save_results()
    print(f"results: {results_path}", flush=True)
    return results
