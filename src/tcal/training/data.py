"""Training data: the training split tokenized once, packed into fixed-length windows, served by token budget.

The training split's tokens come from the token store (`tcal.data.token_store`, `paths.cache_dir/token_store/`), so
the runs, ranks and jobs of a sweep tokenize once and map the same files. Only the training split is read here:
calibration and evaluation documents never reach a training batch.

A stage's windows are `seq_len` consecutive tokens of the store, window n at tokens [n * seq_len, (n + 1) * seq_len).
Which windows a stage reads (`plan_reading`), so that a run's stages read distinct data when the store has room:

- the first stage of a run (and so every single-stage run) reads from every window of the store;
- a later stage reads from the windows that hold no token an earlier stage of the run reads (its samples
  0 .. samples - 1, as the sampler below serves them), when those hold its samples at least once; otherwise from
  every window of the store (its passes say so).

So the first stage's windows do not depend on the stages after it (`stage=align` and the Stage 1 of
`stage=align_distill` read the same windows and share the Stage 1 cache), and with room every window is read at most
once by the run. Before any work the run states what it reads (`describe_reading`, `reading_line`): the store's
distinct tokens, each stage's tokens, the windows it reads from and its passes over them, and the run's passes over
the store; results.json keeps it under `data`.

Batches are a pure function of (seed, global step, rank): step s on rank r reads the windows
`(s * world + r) * batch_size ...` of a seeded sequence of shuffled epochs over the windows, and the sampler
starts at the trainer's global step whenever it is iterated. A resumed run therefore continues with exactly
the batches an uninterrupted run would have seen, with no sampler state to save.

The retrieval mix (`data.retrieval_mix` = f > 0, default 0: off) replaces the samples of global index g with
floor((g + 1) f) > floor(g f), exactly a fraction f of every run of samples (one in four of each batch of 4 at
f = 0.25), by synthetic retrieval sequences of the same length (`tcal.data.needles`: key-value statements in text of
the training split, then one asked back), sequence g drawn from the seed and g alone. They are ordinary samples to
the stages: trained on and counted in `tokens_seen` like any window. Their text and key words come from the whole
training split when its documents are in memory (and the store holds exactly them), and from the store's first
`data.retrieval_sample_tokens` tokens when the source is streamed, so memory does not grow with the corpus.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tcal.data.documents import Document, token_stream
from tcal.data.needles import RetrievalSequences, key_words
from tcal.data.token_store import MemoryTokens
from tcal.errors import ConfigError
from tcal.settings import DataSettings, derived_seed
from tcal.store.fingerprint import digest

log = logging.getLogger(__name__)


def check_one_window(num_tokens: int, seq_len: int, source: str = "training split") -> int:
    """How many whole windows of `seq_len` the tokens hold; a ConfigError when not one."""
    if num_tokens // seq_len < 1:
        raise ConfigError(f"the {source} has {num_tokens} tokens, fewer than one sequence of "
                          f"stage.seq_len={seq_len}; expected more training text or a shorter stage.seq_len")
    return num_tokens // seq_len


def pack(stream: torch.Tensor, seq_len: int, source: str = "training split") -> torch.Tensor:
    """[N, seq_len] consecutive non-overlapping windows of the stream (the tail shorter than a window is dropped)."""
    n = check_one_window(stream.numel(), seq_len, source)
    return stream[: n * seq_len].view(n, seq_len)


class Windows:
    """Windows of `seq_len` tokens of a token source (`TokenStore` or `MemoryTokens`): window j is store window
    `numbers[j]` (window j itself when `numbers` is None), each a [seq_len] LongTensor."""

    def __init__(self, tokens, seq_len: int, numbers: np.ndarray | None = None):
        self.tokens, self.seq_len, self.numbers = tokens, int(seq_len), numbers
        self.in_store = check_one_window(tokens.num_tokens, self.seq_len)

    def __len__(self) -> int:
        return self.in_store if self.numbers is None else len(self.numbers)

    def __getitem__(self, j) -> torch.Tensor:
        n = int(j) if self.numbers is None else int(self.numbers[int(j)])
        return self.tokens.tokens(n * self.seq_len, (n + 1) * self.seq_len)

    @property
    def key(self) -> str:
        """Digest of these windows: the store's key, the length and the window numbers (what a cache keys them by)."""
        numbers = "all" if self.numbers is None else np.asarray(self.numbers, dtype="<i8").tobytes()
        return digest(self.tokens.key, self.seq_len, numbers)


class EpochWindows(Dataset):
    """Window number i of an endless sequence of epochs, each a seeded permutation of the packed windows
    (`windows`: `Windows`, a [N, seq_len] tensor, or anything with a length whose items are windows)."""

    def __init__(self, windows, seed: int):
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
    """Packed training windows of the training split for one stage; batches are [batch_size, seq_len] token ids.
    `train`: the split's tokens (a `TokenStore` or `MemoryTokens`), or its documents (tokenized in memory);
    `reading`: the store windows this stage reads from (None: every one; `plan_reading`)."""

    def __init__(self, train, tokenizer, seq_len: int, batch_size: int, total_steps: int, seed: int,
                 cache_dir: Path | None = None, retrieval_mix: float = 0.0,
                 retrieval_sample_tokens: int | None = None, reading: StageReading | None = None,
                 eval_loaders: Callable[[], list[DataLoader]] = lambda: []):
        super().__init__()
        self.seq_len, self.batch_size, self.total_steps, self.seed = int(seq_len), int(batch_size), int(total_steps), seed
        tokens = memory_tokens(train, tokenizer, cache_dir) if isinstance(train, list) else train
        self.reading = reading
        self.windows = Windows(tokens, self.seq_len, reading.numbers if reading is not None else None)
        self.windows_key = self.windows.key
        self.retrieval_mix = float(retrieval_mix)
        self.sequences = None
        if self.retrieval_mix > 0:
            self.sequences = retrieval_sequences(tokens, tokenizer, self.seq_len, retrieval_sample_tokens)
        self.eval_loaders = eval_loaders  # the curve's eval sets, a loader each

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


def memory_tokens(docs: list[Document], tokenizer, cache_dir: Path | None = None) -> MemoryTokens:
    """In-memory documents tokenized as one stream (`token_stream`, cached on disk under `cache_dir`)."""
    return MemoryTokens(token_stream(docs, tokenizer, cache_dir), docs)


def retrieval_sequences(tokens, tokenizer, seq_len: int, sample_tokens: int | None = None) -> RetrievalSequences:
    """Retrieval sequences over the training split: its whole stream and the words of its documents when the tokens
    are exactly in-memory documents; else the first `sample_tokens` tokens and the words they decode to."""
    if tokens.documents is not None:
        words = key_words("\n".join(d.text for d in tokens.documents))
        return RetrievalSequences(tokens.tokens(0, tokens.num_tokens), words, tokenizer, seq_len)
    if sample_tokens is None:
        sample_tokens = DataSettings().retrieval_sample_tokens
    sample = tokens.tokens(0, min(int(sample_tokens), tokens.num_tokens))
    return RetrievalSequences(sample, key_words(tokenizer.decode(sample.tolist())), tokenizer, seq_len)


# ---------------------------------------------------------------------------------------------------------------
# Which windows each stage reads (module doc), and the statement of it


@dataclass(frozen=True)
class StageReading:
    """What one stage reads: `samples` samples of `seq_len` tokens from `windows` windows of the store (`numbers`:
    their window numbers; None: every window of the store), `region` `store` (every window) or `unread` (the
    windows no earlier stage reads); `read`: which of its windows its samples read (indices into them; None: every
    one)."""

    kind: str
    seq_len: int
    samples: int
    window_samples: int  # samples that are windows (the others: retrieval sequences)
    numbers: np.ndarray | None
    windows: int
    region: str
    read: np.ndarray | None

    @property
    def tokens(self) -> int:
        return self.samples * self.seq_len

    @property
    def passes(self) -> float:
        """Passes over the windows it reads from."""
        return self.window_samples / self.windows

    def read_starts(self) -> np.ndarray:
        """[k] first token of each store window its samples read."""
        numbers = np.arange(self.windows, dtype=np.int64) if self.numbers is None else self.numbers
        chosen = numbers if self.read is None else numbers[self.read]
        return np.asarray(chosen, dtype=np.int64) * self.seq_len


def window_sample_indices(samples: int, fraction: float) -> np.ndarray:
    """The sample indices g < samples that are windows (not retrieval sequences, `is_retrieval`)."""
    g = np.arange(samples, dtype=np.int64)
    if fraction <= 0:
        return g
    retrieval = np.floor((g + 1) * float(fraction)) > np.floor(g * float(fraction))
    return g[~retrieval]


def touched(reads: list[tuple[np.ndarray, int]], seq_len: int, count: int) -> np.ndarray:
    """[count] bool: which store windows of `seq_len` hold a token of the read windows (`reads`: (first tokens,
    length) of each earlier stage's read windows)."""
    marks = np.zeros(count + 1, dtype=np.int64)
    for starts, length in reads:
        first = starts // seq_len
        last = np.minimum((starts + length - 1) // seq_len, count - 1)
        keep = first < count
        np.add.at(marks, first[keep], 1)
        np.add.at(marks, last[keep] + 1, -1)
    return np.cumsum(marks[:count]) > 0


def plan_reading(num_tokens: int, stages: list[tuple[str, int, int]], seed: int,
                 fraction: float = 0.0) -> list[StageReading]:
    """Each stage's reading (module doc) for `stages` [(kind, seq_len, samples)] over a store of `num_tokens`."""
    readings: list[StageReading] = []
    for kind, seq_len, samples in stages:
        count = num_tokens // seq_len
        g = window_sample_indices(samples, fraction)
        numbers, region = None, "store"
        if readings and count:
            unread = np.flatnonzero(~touched([(r.read_starts(), r.seq_len) for r in readings], seq_len, count))
            if len(unread) >= len(g):
                numbers, region = unread, "unread"
        windows = count if numbers is None else len(numbers)
        read = None
        if windows and (len(g) == 0 or g[-1] < windows):
            read = EpochWindows(range(windows), seed).order(0).numpy()[g]
        readings.append(StageReading(kind, seq_len, samples, len(g), numbers, windows, region, read))
    return readings


def distinct_tokens(readings: list[StageReading]) -> int:
    """Tokens of the store that some stage's read windows hold (each counted once)."""
    spans = [(r.read_starts(), r.seq_len) for r in readings]
    if not spans:
        return 0
    starts = np.concatenate([s for s, _ in spans])
    ends = np.concatenate([s + length for s, length in spans])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    gaps = np.maximum(starts[1:] - ends[:-1], 0)
    return int(ends[-1] - starts[0] - gaps.sum()) if len(starts) else 0


def stage_samples(settings) -> list[tuple[str, int, int]]:
    """[(kind, seq_len, samples)] of the run's stages: each reads steps x batch_size x ranks samples."""
    from tcal.runtime.distributed import world_size

    world = world_size(settings.trainer)
    return [(node.kind, node.seq_len, node.steps(world).total * node.batch_size * world)
            for _, node in settings.stage.stages()]


def planned_reading(settings, store_tokens: int | None = None) -> dict:
    """The `data` record a run of `settings` would write, from its settings alone: over a store of `store_tokens`
    (default `data.max_tokens`, what a source longer than the cap gives). For docs/scale.md and plans."""
    store_tokens = int(store_tokens or settings.data.max_tokens)
    readings = plan_reading(store_tokens, stage_samples(settings), int(settings.seed),
                            float(settings.data.retrieval_mix))
    return describe_reading(None, store_tokens, readings)


def describe_reading(store_key: str | None, store_tokens: int, readings: list[StageReading]) -> dict:
    """The run's `data` record: the store (its key; None for a plan), each stage's reading and the run's passes
    over the store."""
    total = sum(r.tokens for r in readings)
    return {
        "store": {"key": store_key, "tokens": store_tokens},
        "stages": {r.kind: {"tokens": r.tokens, "seq_len": r.seq_len, "region": r.region,
                            "region_tokens": r.windows * r.seq_len, "passes": round(r.passes, 4)} for r in readings},
        "tokens": total, "distinct_tokens": distinct_tokens(readings),
        "passes": round(total / store_tokens, 4),
    }


def reading_line(record: dict) -> str:
    """The statement a run prints before work, from its `data` record."""
    store = record["store"]["tokens"]
    stages = "; ".join(
        f"{kind} reads {s['tokens']:,} tokens from {s['region_tokens']:,} "
        f"({'every window' if s['region'] == 'store' else 'windows no earlier stage reads'}): {s['passes']:.4g} passes"
        for kind, s in record["stages"].items())
    repeated = [kind for kind, s in record["stages"].items() if s["passes"] > 1]
    verdict = (f"the budget exceeds the distinct tokens: {', '.join(repeated)} read windows more than once"
               if repeated else "each window is read at most once")
    return (f"data: the token store holds {store:,} distinct training tokens; {stages}; the run reads "
            f"{record['tokens']:,} tokens ({record['distinct_tokens']:,} distinct), {record['passes']:.4g} passes over "
            f"the store; {verdict}")
