"""The one logging layer: Lightning's loggers (`logger=csv`, the default, or `logger=wandb`; `logger=none`).

The training stages hand the logger to their Trainer and log with `tokens_seen` as the step; the zero-shot
path and `tcal-report` call the same logger object directly, so every figure goes through one layer.

A resumed run continues `logs/metrics.csv` (Lightning's CSV logger would delete it): the rows of earlier
stages stay, and those of the resumed stage after its checkpoint are dropped, since they are logged again.
"""

from __future__ import annotations

import csv
import io
import os
import uuid
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from tcal.store.files import flatten, is_number, write_text_atomic


def tokens_metric(kind: str) -> str:
    """The key of a training stage's token count, logged with every row of that stage (the curves' x axis)."""
    return f"{kind}/tokens_seen"


def curve_metric(kind: str, eval_set: str) -> str:
    """The key of a training stage's perplexity on `eval_set` (one point per evaluation)."""
    return f"{kind}/ppl/{eval_set}"


def wandb_has_credentials() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())


def wandb_logger(project: str, run_dir: Path, name: str, group: str | None = None, tags=(), config=None,
                 run_id: str | None = None):
    """A WandbLogger writing under run_dir; offline (sync later with `wandb sync`) when no API key is set. With
    `run_id` it logs to that W&B run, continuing it when it exists (a resumed run)."""
    from lightning.pytorch.loggers import WandbLogger

    offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_has_credentials()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    continued = {"id": run_id, "resume": "allow"} if run_id else {}
    return WandbLogger(project=project, name=name, group=group, tags=list(tags), save_dir=str(run_dir),
                       offline=offline, config=config, **continued)


def wandb_identity(settings, earlier: dict | None = None) -> dict:
    """The W&B run a run logs to, as results.json keeps it (`wandb`): its id, drawn once and kept by the record so
    that every resume and requeue continues the same W&B run, its project, and its group (`logger.group`, or the
    run's own init mode when that is null: a resume's command cannot regroup it)."""
    kept = (earlier or {}).get("wandb") or {}
    return {"id": kept.get("id") or uuid.uuid4().hex[:16], "project": settings.logger.project,
            "group": settings.logger.group or settings.init.name}


class ContinuedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing metrics.csv is continued rather than deleted."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = list(csv.DictReader(handle).fieldnames or [])

    def drop_rows_after(self, kind: str, tokens: int | None) -> None:
        """Drop the rows of stage `kind` logged after `tokens` (all of its rows with None)."""
        self.save()
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
            rows = list(csv.DictReader(handle))
        column = tokens_metric(kind)
        kept = [row for row in rows if not row.get(column) or tokens is not None and float(row[column]) <= tokens]
        if len(kept) < len(rows):
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(kept)
            write_text_atomic(self.metrics_file_path, text.getvalue())


class ContinuedCSVLogger(CSVLogger):
    """`CSVLogger` writing through `ContinuedExperimentWriter`."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedExperimentWriter(log_dir=self.log_dir)
        return self._experiment


def drop_rows_after(logger, kind: str, tokens: int | None) -> None:
    """Before stage `kind` (re)starts at `tokens` (None: from its start), forget what it logged beyond them."""
    if isinstance(logger, ContinuedCSVLogger):
        logger.experiment.drop_rows_after(kind, tokens)


def make_logger(settings, run_dir: Path, wandb: dict | None = None):
    """The Lightning logger `settings.logger` names (a `RunSettings`), or None for `none`; `wandb`: the W&B run
    (`wandb_identity`) a `wandb` logger logs to."""
    name = settings.logger.name
    if name == "none":
        return None
    if name == "csv":
        return ContinuedCSVLogger(save_dir=str(run_dir), name="logs", version="", flush_logs_every_n_steps=1)
    if name == "wandb":
        tags = [settings.teacher.name, settings.retention.name, settings.init.name, settings.stage.label()]
        wandb = wandb or wandb_identity(settings)
        return wandb_logger(wandb["project"], run_dir, "-".join(tags), wandb["group"], tags, settings.tree(),
                            wandb["id"])
    raise ValueError(f"logger={name!r}; expected none, csv or wandb")


def log_curve(logger, kind: str, curve: dict) -> None:
    """A stage's curve ({eval set: [{tokens, ppl}]}) to `logger` as its evaluations log it (`curve_metric` against
    `tokens_metric`): a stage taken from the cache has the same panels as one computed (rows it logged before, when
    the run is continued, are dropped first)."""
    if logger is None:
        return
    drop_rows_after(logger, kind, None)
    points: dict[int, dict] = {}
    for eval_set, series in curve.items():
        for point in series:
            points.setdefault(int(point["tokens"]), {})[curve_metric(kind, eval_set)] = point["ppl"]
    for tokens, values in sorted(points.items()):
        logger.log_metrics({**values, tokens_metric(kind): float(tokens)}, step=tokens)
    logger.save()


def log_figures(logger, figures: dict, tokens_seen: int = 0) -> None:
    """Numbers of a (nested) results dict, flattened, at step `tokens_seen`."""
    if logger is not None:
        logger.log_metrics({**flatten(figures, "/", is_number), "tokens_seen": tokens_seen}, step=tokens_seen)


def log_table(logger, name: str, columns: list[str], rows: list[list]) -> None:
    """A table to loggers that hold tables (W&B); others ignore it."""
    if logger is not None and hasattr(logger, "log_table"):
        logger.log_table(key=name, columns=columns, data=rows)


def finish(logger) -> None:
    if logger is not None:
        logger.finalize("success")
        if hasattr(logger, "experiment") and hasattr(logger.experiment, "finish"):
            logger.experiment.finish()
