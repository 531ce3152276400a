"""Perplexity as Lightning validation: one dataloader per eval set, NLL and token counts summed per rank and
reduced over ranks, so every rank evaluates its share of the windows under the run's strategy.

The training stages validate at token 0, every `eval_every_tokens` and at the end (their curve); the zero-shot
and final evaluation run the same step through `validated_perplexities`. On one process the windows are read
in order in batches of `eval.batch_size`, exactly as `tcal.evaluate.perplexity.perplexity` reads them.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from tcal.evaluate.perplexity import batch_nll


class RankWindows(Dataset):
    """Rank `rank`'s windows of an eval set (every `world`-th from `rank`), with weight 1; ranks with one window
    fewer repeat window 0 with weight 0, so every rank runs the same number of batches (sharded models need it)."""

    def __init__(self, windows: torch.Tensor, rank: int = 0, world: int = 1):
        self.windows = windows
        self.positions = list(range(rank, len(windows), world))
        self.length = -(-len(windows) // world)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < len(self.positions):
            return self.windows[self.positions[index]], torch.tensor(1.0, dtype=torch.float64)
        return self.windows[0], torch.tensor(0.0, dtype=torch.float64)


def eval_dataloaders(eval_windows: dict[str, torch.Tensor], batch_size: int, rank: int, world: int) -> list[DataLoader]:
    return [DataLoader(RankWindows(windows, rank, world), batch_size=int(batch_size), shuffle=False, num_workers=0)
            for windows in eval_windows.values()]


class PerplexityValidation(L.LightningModule):
    """`validation_step` for the model `evaluated()` returns: per eval set (dataloader), the summed next-token NLL
    and token count, reduced over ranks at the end of the epoch and handed to `on_perplexities`."""

    eval_names: list[str] = []

    def evaluated(self) -> torch.nn.Module:
        raise NotImplementedError

    def on_perplexities(self, ppl: dict[str, float]) -> None:
        raise NotImplementedError

    def on_validation_epoch_start(self) -> None:
        self._nll_sums = torch.zeros(len(self.eval_names), 2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        windows, weights = batch
        nll, count = batch_nll(self.evaluated(), windows, weights)
        self._nll_sums[dataloader_idx, 0] += nll
        self._nll_sums[dataloader_idx, 1] += count

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._nll_sums, reduce_op="sum")
        ppl = {name: math.exp(float(sums[i, 0]) / float(sums[i, 1])) if float(sums[i, 1]) else float("nan")
               for i, name in enumerate(self.eval_names)}
        self.on_perplexities(ppl)


class EvaluatedModel(PerplexityValidation):
    """A frozen model (teacher or student) to validate; held outside the module tree, so Lightning neither
    wraps it nor moves it back to the CPU when the loop ends."""

    def __init__(self, model: torch.nn.Module, eval_names: list[str]):
        super().__init__()
        self._frozen = {"model": model}
        self.eval_names = list(eval_names)
        self.perplexities: dict[str, float] = {}

    def evaluated(self) -> torch.nn.Module:
        return self._frozen["model"]

    def on_perplexities(self, ppl: dict[str, float]) -> None:
        self.perplexities = ppl


def eval_trainer(trainer_cfg, world: int) -> L.Trainer:
    """A Trainer that only validates, on the run's devices and precision (data parallel over the run's ranks)."""
    return L.Trainer(accelerator=trainer_cfg.accelerator, devices=trainer_cfg.devices,
                     num_nodes=trainer_cfg.get("num_nodes", 1), strategy="ddp" if world > 1 else "auto",
                     precision=trainer_cfg.precision, logger=False, use_distributed_sampler=False,
                     enable_model_summary=False, enable_checkpointing=False, inference_mode=False)


def validated_perplexities(model: torch.nn.Module, eval_windows: dict[str, torch.Tensor], batch_size: int,
                           trainer_cfg, ranks) -> dict[str, float]:
    """{eval set: perplexity} of `model` (already on this rank's device), every rank evaluating its share."""
    module = EvaluatedModel(model, list(eval_windows))
    was_training = model.training
    model.eval()
    trainer = eval_trainer(trainer_cfg, ranks.world_size)
    trainer.validate(module, dataloaders=eval_dataloaders(eval_windows, batch_size, ranks.rank, ranks.world_size),
                     verbose=False)
    model.train(was_training)
    return module.perplexities
