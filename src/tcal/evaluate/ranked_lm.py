"""lm-eval's own data parallelism over the run's ranks, for a model already in memory.

lm-eval splits a task's documents over processes (`Task.build_all_requests(rank, world_size)`: every
`world_size`-th document from `rank`), pads every rank to the same number of requests, and gathers the per-document
metrics to rank 0, which aggregates them. It learns the ranks from `accelerate`, and only when it loads the model
itself; given a model object, `HFLM` runs as one process. `RankedHFLM` gives it the run's ranks and the collectives
it calls (`all_gather`, `gather_object`, `barrier`) on the run's process group (gloo or NCCL), so each rank scores
its share of the documents on its own device. A document's requests (all choices of a multiple-choice item) stay
on one rank, and with `batch_size=1` each request is computed as one process computes it: the figures are those of
one process, up to the order of the final sums.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from lm_eval.models.huggingface import HFLM

from tcal.runtime.distributed import Ranks

log = logging.getLogger(__name__)


class RankedHFLM(HFLM):
    """`HFLM` over an in-memory model on `ranks` (every rank constructs one and calls `simple_evaluate`; the
    results come back on rank 0, None on the others)."""

    def __init__(self, ranks: Ranks, **kwargs):
        super().__init__(**kwargs)
        self._rank, self._world_size = ranks.rank, ranks.world_size

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._log_share("loglikelihood", requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        self._log_share("generate_until", requests)
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _log_share(self, kind: str, requests) -> None:
        if self.world_size > 1:
            log.info("harness: rank %d of %d scores %d %s requests", self.rank, self.world_size, len(requests), kind)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along dim 0 (a 0-d tensor gives one entry per rank)."""
        if self.world_size <= 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size <= 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
