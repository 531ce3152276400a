"""One run: teacher -> keep list -> student -> init -> training stages -> eval -> export (docs/method.md, section
"One run").

`run(cfg, run_dir)` is what the `tcal` entry calls; tests call it with composed configs. Bad settings fail
before anything is written; results.json is rewritten atomically after each step ("status" says how far
the run got) and at every curve point, so a crash leaves a readable record. With `stage=none` the evaluation
is zero-shot. A multi-device run starts its ranks first (`tcal.distributed`); every rank then holds the teacher
and the student on its own device, the per-layer work is split across ranks, the evaluations are Lightning
validation over all ranks, and rank 0 writes results.json and exports.
A resumed run keeps what its record held, and a failure marks the record "failed" (`tcal.record`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tcal.convert import build_student
from tcal.data import Splits, load_splits
from tcal.distributed import Ranks
from tcal.evaluate.suite import evaluate, format_table
from tcal.fingerprint import weights_digest
from tcal.gdn import kernel_path
from tcal.init import init_student
from tcal.record import RESULTS, new_record, read_record, records_failure, write_record
from tcal.rerun import check_checkpoints
from tcal.results import write_folder_atomic
from tcal.retention import select_layers
from tcal.teachers.load import load_teacher
from tcal.tracking import finish, log_figures, make_logger
from tcal.training.run import plan_stages, run_stage
from tcal.validate import validate_config, validate_loaded

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What the pluggable steps (retention policies, init modes) may read."""

    cfg: object
    teacher: torch.nn.Module
    tokenizer: object
    splits: Splits
    cache_dir: Path
    run_dir: Path
    extra_callbacks: list = field(default_factory=list)  # Lightning callbacks added to every stage's Trainer
    ranks: Ranks = field(default_factory=Ranks)

    @property
    def num_layers(self) -> int:
        return self.teacher.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.ranks.device


@contextmanager
def timed(timings: dict, step: str):
    start = time.perf_counter()
    yield
    timings[step] = round(time.perf_counter() - start, 3)


def prepare(cfg, run_dir: Path, timings: dict, ranks: Ranks | None = None) -> RunContext:
    torch.manual_seed(int(cfg.seed))
    torch.set_flush_denormal(True)  # strongly decaying GDN states underflow; denormals slow CPU math ~10x
    if cfg.eval.harness.name == "paper":
        from tcal.evaluate.local_tasks import check_paper_tasks_available

        check_paper_tasks_available()  # fail before any work when the dataset hub is unreachable
    ranks = ranks or Ranks()
    with timed(timings, "load_teacher"):
        teacher, tokenizer = load_teacher(cfg.teacher, cfg.paths.cache_dir)
        teacher.to(ranks.device)
    with timed(timings, "load_data"):
        splits = load_splits(cfg.data)
    return RunContext(cfg, teacher, tokenizer, splits, Path(cfg.paths.cache_dir), Path(run_dir), ranks=ranks)


def is_mixed(precision) -> bool:
    """Mixed precision: float32 weights (and optimizer states), reduced-precision compute."""
    return str(precision).endswith("-mixed")


def save_student(student, tokenizer, folder: Path) -> None:
    """save_pretrained into a temporary folder, then rename: a checkpoint is whole or absent."""
    def write(tmp: Path) -> None:
        student.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    write_folder_atomic(folder, write)


@records_failure
def run(cfg, run_dir: str | Path, resume: bool = False, callbacks: list | None = None,
        ranks: Ranks | None = None) -> dict:
    """The whole job; `resume=True` continues the run in `run_dir` from its last stage checkpoint. `ranks`: this
    process's place among the run's launched processes (`tcal.distributed.launch`); None is one process."""
    run_dir = Path(run_dir)
    validate_config(cfg)
    if resume:
        check_checkpoints(run_dir)  # a damaged one is named before any work
    timings: dict[str, float] = {}
    ctx = prepare(cfg, run_dir, timings, ranks)
    validate_loaded(ctx)
    ctx.extra_callbacks = list(callbacks or [])
    with timed(timings, "load_training_data"):
        plans = plan_stages(ctx)
    writer = ctx.ranks.is_main
    with timed(timings, "retention"):
        selection = select_layers(cfg.retention, ctx)
    with timed(timings, "convert"):
        student = build_student(ctx.teacher, selection.keep_layers, cfg.init.gqa_expansion, int(cfg.seed))
        student.to(ctx.device)
    device = ctx.device
    results = new_record(
        teacher=cfg.teacher.name, num_layers=ctx.num_layers, retention=cfg.retention.name,
        ratio=cfg.retention.get("ratio"), keep_layers=selection.keep_layers, retention_scores=selection.scores,
        init_mode=cfg.init.name, gqa_expansion=cfg.init.gqa_expansion, stage=cfg.stage.name,
        kernel_path=kernel_path(device), config=OmegaConf.to_container(cfg, resolve=True), timings=timings)
    results_path = run_dir / RESULTS
    earlier = read_record(run_dir) if resume else None

    def save_results() -> None:
        if writer:
            write_record(results_path, results, earlier)

    save_results()
    log.info("keep layers (%s): %s; GDN kernel path: %s", cfg.retention.name, selection.keep_layers, kernel_path(device))

    with timed(timings, "init"):
        results["calibration"] = init_student(student, cfg.init, ctx)
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
    with timed(timings, "evaluate"):
        results.update(evaluate(ctx, student))
    if not writer:
        return results
    print(format_table(results), flush=True)
    log_figures(logger, {"eval": {k: results[k] for k in ("metrics", "harness", "ruler") if k in results}}, tokens_seen)
    finish(logger)
    if cfg.save_student:
        with timed(timings, "save"):
            save_student(student, ctx.tokenizer, run_dir / "student")
        results["student_path"] = str(run_dir / "student")
    results["status"] = "complete"
    save_results()
    print(f"results: {results_path}", flush=True)
    return results
