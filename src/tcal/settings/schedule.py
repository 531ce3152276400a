"""The learning-rate schedules a `schedule` setting names (Phase 2 of full_plus, the training stages): each
group's learning-rate multiplier per step (for `torch.optim.lr_scheduler.LambdaLR`)."""

from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("constant", "cosine")



def lr_factor(name: str, total_steps: int, min_lr_ratio: float = 0.0,
              setting: str = "schedule") -> Callable[[int], float]:
    """`constant`, or `cosine` from 1 down to `min_lr_ratio` over `total_steps` (and held there after); `setting`
    names the config key in the error for another name."""
    if name == "constant":
        return lambda step: 1.0
    if name == "cosine":
        def factor(step: int) -> float:
            progress = min(step / max(total_steps, 1), 1.0)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return factor
    raise ValueError(f"{setting}={name!r}; expected one of {', '.join(SCHEDULES)}")
