"""Perplexity against tokens seen: the curve a token-efficiency comparison reads (DESIGN section 7).

A Lightning callback evaluates every eval set at token 0, each time `tokens_seen` crosses a multiple of
`eval_every_tokens`, and at the end. The points live in the callback's state, which Lightning saves in each
checkpoint, so a resumed run continues the curve of its checkpoint: no duplicated or missing points.
A non-finite perplexity stops the stage on every rank (`Divergence`), before the point or a checkpoint is kept.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from lightning.pytorch.callbacks import Callback

from tcal.errors import Divergence
from tcal.evaluate.perplexity import perplexity

log = logging.getLogger(__name__)

Curve = dict[str, list[dict]]  # eval set -> [{"tokens": int, "ppl": float}, ...]


def first_non_finite(ppl: dict[str, float]) -> tuple[str, float] | None:
    return next(((name, value) for name, value in ppl.items() if not math.isfinite(value)), None)


def stop_if_diverged(trainer, module, diverged: tuple[str, float] | None, tokens: int) -> None:
    """Rank 0's verdict, shared with every rank so that all of them stop together."""
    diverged = trainer.strategy.broadcast(diverged, src=0)
    if diverged is not None:
        name, value = diverged
        raise Divergence.in_stage(module.kind, f"perplexity on eval set {name!r}", value, trainer.global_step,
                                  tokens)


class PerplexityCurve(Callback):
    def __init__(self, eval_windows: dict[str, torch.Tensor], every_tokens: int, batch_size: int,
                 on_point: Callable[[Curve], None] = lambda curve: None):
        self.eval_windows, self.every_tokens, self.batch_size = eval_windows, int(every_tokens), int(batch_size)
        self.on_point = on_point
        self.curve: Curve = {name: [] for name in eval_windows}  # filled on rank 0
        self.last_tokens: int | None = None  # kept on every rank, so all ranks agree on when to evaluate

    def state_dict(self) -> dict:
        return {"curve": self.curve, "last_tokens": self.last_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.curve, self.last_tokens = state["curve"], state["last_tokens"]

    def evaluate(self, trainer, module, tokens: int) -> None:
        """Perplexity of the student on every eval set (on rank 0; the other ranks wait), appended at `tokens`."""
        diverged = None
        if trainer.is_global_zero:
            student = module.student
            was_training = student.training
            student.eval()
            ppl = {name: perplexity(student, windows, self.batch_size) for name, windows in self.eval_windows.items()}
            student.train(was_training)
            diverged = first_non_finite(ppl)
        stop_if_diverged(trainer, module, diverged, tokens)
        if trainer.is_global_zero:
            for name, value in ppl.items():
                self.curve[name].append({"tokens": int(tokens), "ppl": value})
            metrics = {f"{module.kind}/ppl/{name}": value for name, value in ppl.items()}
            for logger in trainer.loggers:
                logger.log_metrics({**metrics, f"{module.kind}/tokens_seen": float(tokens)}, step=int(tokens))
            log.info("%s at %d tokens: %s", module.kind, tokens,
                     ", ".join(f"ppl {name} {value:.2f}" for name, value in ppl.items()))
            self.on_point(self.curve)
        self.last_tokens = int(tokens)
        trainer.strategy.barrier("perplexity_curve")

    def on_train_start(self, trainer, module) -> None:
        if self.last_tokens is None:
            self.evaluate(trainer, module, module.tokens_seen)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        last = self.last_tokens or 0
        if module.tokens_seen // self.every_tokens > last // self.every_tokens:
            self.evaluate(trainer, module, module.tokens_seen)

    def on_train_end(self, trainer, module) -> None:
        if self.last_tokens != module.tokens_seen:
            self.evaluate(trainer, module, module.tokens_seen)
