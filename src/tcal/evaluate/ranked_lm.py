"""lm-eval's own data parallelism over the run's ranks, for a model already in memory.

lm-eval splits a task's documents over processes (`Task.build_all_requests(rank, world_size)`: every
`world_size`-th document from `rank`), pads every rank to the same number of requests, and gathers the per-document
metrics to rank 0, which aggregates them. It learns the ranks from `accelerate`, and only when it loads the model
itself; given a model object, `HFLM` runs as one process. `RankedHFLM` gives it the run's ranks and the collectives
it calls (`all_gather`, `gather_object`, `barrier`) on the run's process group (gloo or NCCL), so each rank scores
its share of the documents on its own device. A document's requests (all choices of a multiple-choice item) stay
on one rank, and with `batch_size=1` each request is computed as one process computes it: the figures are those of
one process, up to the order of the final sums.

Scoring (`loglikelihood`) holds the log-probabilities of one request's continuation at a time, never the batch's
[batch, length, vocab] logits (`RankedHFLM._model_call`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from tcal.evaluate.perplexity import chunked_head
from tcal.runtime.distributed import Ranks

log = logging.getLogger(__name__)


class RankedHFLM(HFLM):
    """`HFLM` over an in-memory model on `ranks` (every rank constructs one and calls `simple_evaluate`; the
    results come back on rank 0, None on the others)."""

    def __init__(self, ranks: Ranks, **kwargs):
        super().__init__(**kwargs)
        self._rank, self._world_size = ranks.rank, ranks.world_size
        self._scoring = False
        self._hidden: torch.Tensor | None = None
        self._row = 0

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """lm-eval's loop, with the logits bounded by one request's continuation (see `_model_call`)."""
        chunked = self.backend == "causal" and chunked_head(self.model)
        if not chunked:
            log.info("harness: %s has no plain output head on its decoder; lm-eval's full-batch logits are used",
                     type(self.model).__name__)
        self._scoring = chunked
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._scoring, self._hidden = False, None

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """While scoring requests: the decoder's final hidden states [batch, length, hidden] are kept, and a
        [batch, length, 1] placeholder of zeros goes back to lm-eval's loop (its log-softmax over one entry is 0,
        and costs nothing). Each row's log-probabilities are computed by `_select_cont_toks` over that row's
        continuation positions only, so no [batch, length, vocab] tensor ever exists: at most one request's
        [continuation, vocab] (lm-eval's own path holds the batch's logits and their log-softmax, 2 x 8 x 2048 x
        152k floats for the paper's harness on Qwen3-8B). The values are lm-eval's: the same head on the same
        hidden states (up to the rounding of a GEMM over fewer rows), the log-softmax in its `softmax_dtype`."""
        if not self._scoring or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask, labels)
        with torch.no_grad(), self._autocast():
            self._hidden = self.model.get_decoder()(input_ids=inps, use_cache=False).last_hidden_state
        self._row = 0
        return self._hidden.new_zeros(*inps.shape, 1)

    def _select_cont_toks(self, logits: torch.Tensor, contlen: int | None = None, inplen: int | None = None):
        """While scoring: the log-probabilities [contlen, vocab] of the next row's continuation positions
        (`inplen - contlen` up to `inplen`, as lm-eval selects them), computed from that row's hidden states."""
        if not self._scoring:
            return super()._select_cont_toks(logits, contlen=contlen, inplen=inplen)
        hidden = self._hidden[self._row, inplen - contlen:inplen]
        self._row += 1
        with torch.no_grad(), self._autocast():
            row_logits = self.model.get_output_embeddings()(hidden)
        return F.log_softmax(row_logits, dim=-1, dtype=self.softmax_dtype)

    def _autocast(self):
        """The autocast lm-eval's `_model_call` computes under (off unless the model was given a mixed dtype)."""
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

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
