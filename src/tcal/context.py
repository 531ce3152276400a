"""`RunContext`: what one run's steps share (typed settings and loaded objects); `tcal.run.Run`, whose methods are
the steps, extends it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tcal.data.documents import Splits
from tcal.runtime.distributed import Ranks
from tcal.settings import RunSettings


@dataclass
class RunContext:
    """What the pluggable steps (retention policies, init modes, stages, evaluation) may read: typed settings and
    the loaded objects, never the Hydra config."""

    settings: RunSettings
    teacher: torch.nn.Module
    tokenizer: object
    splits: Splits
    cache_dir: Path
    run_dir: Path
    extra_callbacks: list = field(default_factory=list)  # Lightning callbacks added to every stage's Trainer
    ranks: Ranks = field(default_factory=Ranks)
    gdn_kernel: str | None = None  # fla or torch, the run's (`Run.build`); None: `auto`, decided by each layer on CUDA

    @property
    def num_layers(self) -> int:
        return self.teacher.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.ranks.device
