"""Training data: the training split tokenized once, packed into fixed-length windows, served by token budget.

The token stream of a split is cached on disk (`tcal.data.documents.token_stream`, `paths.cache_dir/tokens/`), so the
runs of a sweep tokenize once. Only the training split is read here: calibration and evaluation documents never
reach a training batch.

Batches are a pure function of (seed, global step, rank): step s on rank r reads the windows
`(s * world + r) * batch_size ...` of a seeded sequence of shuffled epochs over the windows, and the sampler
starts at the trainer's global step whenever it is iterated. A resumed run therefore continues with exactly
the batches an uninterrupted run would have seen, with no sampler state to save.

The retrieval mix (`data.retrieval_mix` = f > 0, default 0: off) replaces the samples of global index g with
floor((g + 1) f) > floor(g f), exactly a fraction f of every run of samples (one in four of each batch of 4 at
f = 0.25), by synthetic retrieval sequences of the same length (`tcal.data.needles`: key-value statements in text of
the training split, then one asked back), sequence g drawn from the seed and g alone. They are ordinary samples to
the stages: trained on and counted in `tokens_seen` like any window.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tcal.data.documents import Document, token_stream
from tcal.data.needles import RetrievalSequences, key_words
from tcal.errors import ConfigError
from tcal.settings import derived_seed

log = logging.getLogger(__name__)


def pack(stream: torch.Tensor, seq_len: int, source: str = "training split") -> torch.Tensor:
    """[N, seq_len] consecutive non-overlapping windows of the stream (the tail shorter than a window is dropped)."""
    n = stream.numel() // seq_len
    if n < 1:
        raise ConfigError(f"the {source} has {stream.numel()} tokens, fewer than one sequence of "
                          f"stage.seq_len={seq_len}; expected more training text or a shorter stage.seq_len")
    return stream[: n * seq_len].view(n, seq_len)


class EpochWindows(Dataset):
    """Window number i of an endless sequence of epochs, each a seeded permutation of the packed windows."""

    def __init__(self, windows: torch.Tensor, seed: int):
        self.windows, self.seed = windows, int(seed)
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(derived_seed(self.seed, 1_000_003, epoch))
            self._orders[epoch] = torch.randperm(len(self.windows), generator=gen)
        return self._orders[epoch]

    def __len__(self) -> int:
        return 2**62  # endless; the sampler decides which indices are read

    def __getitem__(self, index: int) -> torch.Tensor:
        epoch, position = divmod(int(index), len(self.windows))
        return self.windows[self.order(epoch)[position]]


def is_retrieval(index: int, fraction: float) -> bool:
    """Whether global sample `index` is a retrieval sequence under mix `fraction` (see module doc)."""
    return fraction > 0 and int((index + 1) * fraction) > int(index * fraction)


class MixedWindows(Dataset):
    """`EpochWindows` with a fraction of its samples replaced by retrieval sequences over the same split."""

    def __init__(self, windows: EpochWindows, sequences: RetrievalSequences, fraction: float, seed: int):
        self.windows, self.sequences, self.fraction, self.seed = windows, sequences, float(fraction), int(seed)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        if is_retrieval(int(index), self.fraction):
            return self.sequences.make(random.Random(f"retrieval_mix:{self.seed}:{int(index)}")).ids
        return self.windows[index]


class StepSampler(Sampler):
    """Indices of this rank's samples for global steps `start_step()` .. total_steps - 1 (see module doc)."""

    def __init__(self, batch_size: int, total_steps: int, rank: int = 0, world_size: int = 1,
                 start_step: Callable[[], int] = lambda: 0):
        self.batch_size, self.total_steps = int(batch_size), int(total_steps)
        self.rank, self.world_size, self.start_step = int(rank), int(world_size), start_step

    def __iter__(self):
        for step in range(int(self.start_step()), self.total_steps):
            first = (step * self.world_size + self.rank) * self.batch_size
            yield from range(first, first + self.batch_size)

    def __len__(self) -> int:
        return max(self.total_steps - int(self.start_step()), 0) * self.batch_size


class PackedTextDataModule(L.LightningDataModule):
    """Packed training windows of the training split for one stage; batches are [batch_size, seq_len] token ids."""

    def __init__(self, train_docs: list[Document], tokenizer, seq_len: int, batch_size: int, total_steps: int,
                 seed: int, cache_dir: Path | None = None, retrieval_mix: float = 0.0):
        super().__init__()
        self.seq_len, self.batch_size, self.total_steps, self.seed = int(seq_len), int(batch_size), int(total_steps), seed
        stream = token_stream(train_docs, tokenizer, cache_dir)
        self.windows = pack(stream, self.seq_len)
        self.retrieval_mix = float(retrieval_mix)
        self.sequences = None
        if self.retrieval_mix > 0:
            self.sequences = RetrievalSequences(stream, key_words("\n".join(d.text for d in train_docs)), tokenizer,
                                                self.seq_len)
        self.eval_loaders: Callable[[], list[DataLoader]] = lambda: []  # the eval sets, set by the stage runner

    def val_dataloader(self) -> list[DataLoader]:
        return self.eval_loaders()

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        if trainer is None:
            sampler = StepSampler(self.batch_size, self.total_steps)
        else:
            sampler = StepSampler(self.batch_size, self.total_steps, trainer.global_rank, trainer.world_size,
                                  lambda: trainer.global_step)
        return DataLoader(self.dataset(), batch_size=self.batch_size, sampler=sampler, num_workers=0)

    def dataset(self) -> Dataset:
        """Sample g of the stage's endless sequence (the sampler picks which g a step reads)."""
        windows = EpochWindows(self.windows, self.seed)
        if self.sequences is None:
            return windows
        return MixedWindows(windows, self.sequences, self.retrieval_mix, self.seed)
