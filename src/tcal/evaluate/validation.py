"""Perplexity as Lightning validation: one dataloader per eval set, NLL and token counts summed per rank and
reduced over ranks, so every rank evaluates its share of the windows under the run's strategy.

The training stages validate at token 0, every `eval_every_tokens` and at the end (their curve); the zero-shot
and final evaluation run the same step through `validate_windows`. On one process the windows are read
in order in batches of `eval.batch_size`, exactly as `tcal.evaluate.perplexity.perplexity` reads them.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from tcal.evaluate.perplexity import nll_sums, position_nll_sums, token_nll
from tcal.runtime.lightning_output import trainer_callbacks


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


def is_sharded(module: torch.nn.Module) -> bool:
    """An FSDP2 (`fully_shard`) module: its parameters are shards between forwards."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _ppl(nll: float, tokens: float) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")


class PerplexityValidation(L.LightningModule):
    """`validation_step` for the model `evaluated()` returns: per eval set (dataloader), the summed next-token NLL
    and token count, reduced over ranks at the end of the epoch and handed to `on_perplexities`. With
    `position_buckets` (the first position of each bucket) the same sums are also kept per bucket of positions
    within the window, reduced alike, and left in `by_position`."""

    eval_names: list[str] = []
    position_buckets: tuple[int, ...] | None = None

    def evaluated(self) -> torch.nn.Module:
        raise NotImplementedError

    def on_perplexities(self, ppl: dict[str, float]) -> None:
        raise NotImplementedError

    def on_validation_epoch_start(self) -> None:
        sets = len(self.eval_names)
        self._nll_sums = torch.zeros(sets, 2, dtype=torch.float64, device=self.device)
        self._window_lengths = [0] * sets
        if self.position_buckets:
            self._bucket_sums = torch.zeros(sets, len(self.position_buckets), 2, dtype=torch.float64,
                                            device=self.device)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        windows, weights = batch
        model = self.evaluated()
        if is_sharded(model):  # token_nll may call the decoder and the head apart: gather the root's weights
            model.unshard()
        nll = token_nll(model, windows)
        if is_sharded(model):
            model.reshard()
        total, count = nll_sums(nll, weights)
        self._nll_sums[dataloader_idx, 0] += total
        self._nll_sums[dataloader_idx, 1] += count
        self._window_lengths[dataloader_idx] = windows.shape[1]
        if self.position_buckets:
            self._bucket_sums[dataloader_idx] += position_nll_sums(nll, self.position_buckets, weights)

    def on_validation_epoch_end(self) -> None:
        reduce = self.trainer.strategy.reduce
        sums = reduce(self._nll_sums, reduce_op="sum")
        ppl = {name: _ppl(float(sums[i, 0]), float(sums[i, 1])) for i, name in enumerate(self.eval_names)}
        if self.position_buckets:
            self.by_position = self._position_perplexities(reduce(self._bucket_sums, reduce_op="sum"))
        self.on_perplexities(ppl)

    def _position_perplexities(self, sums: torch.Tensor) -> dict[str, list[dict]]:
        """{eval set: [{"start", "end", "tokens", "ppl"}, ...]}: each bucket's positions [start, end) and the
        perplexity of its tokens; buckets past the window's end are left out."""
        out = {}
        for i, name in enumerate(self.eval_names):
            length = self._window_lengths[i]
            ends = [*self.position_buckets[1:], length]
            out[name] = [{"start": start, "end": min(end, length), "tokens": round(float(tokens)),
                          "ppl": _ppl(float(nll), float(tokens))}
                         for (nll, tokens), start, end in zip(sums[i].tolist(), self.position_buckets, ends) if tokens]
        return out


class EvaluatedModel(PerplexityValidation):
    """A frozen model (teacher or student) to validate; held outside the module tree, so Lightning neither
    wraps it nor moves it back to the CPU when the loop ends."""

    def __init__(self, model: torch.nn.Module, eval_names: list[str], position_buckets=None):
        super().__init__()
        self._frozen = {"model": model}
        self.eval_names = list(eval_names)
        self.position_buckets = tuple(int(start) for start in position_buckets) if position_buckets else None
        self.perplexities: dict[str, float] = {}
        self.by_position: dict[str, list[dict]] = {}

    def evaluated(self) -> torch.nn.Module:
        return self._frozen["model"]

    def on_perplexities(self, ppl: dict[str, float]) -> None:
        self.perplexities = ppl


def eval_trainer(trainer_settings, world: int) -> L.Trainer:
    """A Trainer that only validates, on the run's devices and precision (data parallel over the run's ranks)."""
    return L.Trainer(accelerator=trainer_settings.accelerator, devices=trainer_settings.devices,
                     num_nodes=trainer_settings.num_nodes, strategy="ddp" if world > 1 else "auto",
                     precision=trainer_settings.precision, logger=False, use_distributed_sampler=False,
                     enable_model_summary=False, enable_checkpointing=False, inference_mode=False,
                     callbacks=trainer_callbacks([]))


def validate_windows(model: torch.nn.Module, eval_windows: dict[str, torch.Tensor], batch_size: int, trainer_settings,
                     ranks, position_buckets=None) -> EvaluatedModel:
    """Validate `model` (already on this rank's device) on every eval set, each rank its share; the result holds
    `perplexities` ({eval set: perplexity}) and, with `position_buckets`, `by_position`."""
    module = EvaluatedModel(model, list(eval_windows), position_buckets)
    was_training = model.training
    model.eval()
    trainer = eval_trainer(trainer_settings, ranks.world_size)
    trainer.validate(module, dataloaders=eval_dataloaders(eval_windows, batch_size, ranks.rank, ranks.world_size),
                     verbose=False)
    model.train(was_training)
    return module

