"""Experiment trackers: `logger=none` (default) or `logger=wandb`, with `tokens_seen` as the step metric.

Zero-shot figures are logged at tokens_seen=0; the training stages log their curves through the same call,
so a W&B dashboard grouped by init mode compares the curves directly.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf


class Tracker:
    """No tracker: every call is a no-op."""

    def log(self, metrics: dict, tokens_seen: int) -> None:
        pass

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, cfg, run_dir: Path, config: dict, name: str):
        import wandb

        self.wandb = wandb
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg["project"], group=cfg.get("group"), name=name, dir=str(run_dir),
                              config=config, reinit="finish_previous")
        self.run.define_metric("tokens_seen")
        self.run.define_metric("*", step_metric="tokens_seen")

    def log(self, metrics: dict, tokens_seen: int) -> None:
        self.run.log({**flatten(metrics), "tokens_seen": tokens_seen})

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)})

    def finish(self) -> None:
        self.run.finish()


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


def make_tracker(cfg, run_dir: Path) -> Tracker:
    """The tracker named by `cfg.logger.name`."""
    name = cfg.logger.name
    if name == "none":
        return Tracker()
    if name == "wandb":
        run_name = f"{cfg.teacher.name}-{cfg.retention.name}-{cfg.init.name}"
        return WandbTracker(cfg.logger, run_dir, OmegaConf.to_container(cfg, resolve=True), run_name)
    raise ValueError(f"logger.name={name!r}; expected none or wandb")
