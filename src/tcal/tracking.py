"""The one logging layer: Lightning's loggers (`logger=csv`, the default, or `logger=wandb`; `logger=none`).

The training stages hand the logger to their Trainer and log with `tokens_seen` as the step; the zero-shot
path and `tcal-report` call the same logger object directly, so every figure goes through one layer.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}, numbers only."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
    return flat


def wandb_has_credentials() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text())


def wandb_logger(project: str, run_dir: Path, name: str, group: str | None = None, tags=(), config=None):
    """A WandbLogger writing under run_dir; offline (sync later with `wandb sync`) when no API key is set."""
    from lightning.pytorch.loggers import WandbLogger

    offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_has_credentials()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(project=project, name=name, group=group, tags=list(tags), save_dir=str(run_dir),
                       offline=offline, config=config)


def make_logger(cfg, run_dir: Path):
    """The Lightning logger named by `cfg.logger.name`, or None for `none`."""
    name = cfg.logger.name
    if name == "none":
        return None
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(run_dir), name="logs", version="", flush_logs_every_n_steps=1)
    if name == "wandb":
        tags = [cfg.teacher.name, cfg.retention.name, cfg.init.name, cfg.stage.name]
        return wandb_logger(cfg.logger.project, run_dir, "-".join(tags), cfg.logger.get("group"), tags,
                            OmegaConf.to_container(cfg, resolve=True))
    raise ValueError(f"logger={name!r}; expected none, csv or wandb")


def log_figures(logger, figures: dict, tokens_seen: int = 0) -> None:
    """Numbers of a (nested) results dict, flattened, at step `tokens_seen`."""
    if logger is not None:
        logger.log_metrics({**flatten(figures), "tokens_seen": tokens_seen}, step=tokens_seen)


def log_table(logger, name: str, columns: list[str], rows: list[list]) -> None:
    """A table to loggers that hold tables (W&B); others ignore it."""
    if logger is not None and hasattr(logger, "log_table"):
        logger.log_table(key=name, columns=columns, data=rows)


def finish(logger) -> None:
    if logger is not None:
        logger.finalize("success")
        if hasattr(logger, "experiment") and hasattr(logger.experiment, "finish"):
            logger.experiment.finish()
