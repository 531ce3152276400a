"""Perplexity on token windows: exp of the mean next-token negative log-likelihood over all windows.

The logits are computed from the final hidden states in chunks of `NLL_CHUNK_ROWS` positions and upcast to
float32 one chunk at a time, so a 152k vocabulary never holds a [batch, tokens, vocab] float32 tensor.
The same per-token NLL also sums per bucket of positions within the window (`position_nll_sums`): where along
the context a converted model loses its teacher.
"""

from __future__ import annotations

import math
from sys import float_info

import torch
import torch.nn.functional as F

from tcal.runtime.progress import progress

NLL_CHUNK_ROWS = 1024


def chunked_head(model) -> bool:
    """Whether logits are a plain linear head on the decoder's output (true of every supported family)."""
    return (hasattr(model, "get_decoder") and model.get_output_embeddings() is not None
            and not getattr(model.config, "final_logit_softcapping", None))


@torch.no_grad()
def token_nll(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token NLL [B, T - 1] (float32, on the model's device) of `batch` [B, T]: column j is the NLL of token
    j + 1 given tokens 0..j."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    targets = batch[:, 1:]
    if not chunked_head(model):
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    hidden = model.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    return torch.cat([F.cross_entropy(head(flat[start:start + NLL_CHUNK_ROWS]).float(),
                                      flat_targets[start:start + NLL_CHUNK_ROWS], reduction="none")
                      for start in range(0, flat.shape[0], NLL_CHUNK_ROWS)]).view_as(targets)


def _window_weights(nll: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return torch.ones(nll.shape[0], dtype=torch.float64, device=nll.device)
    return weights.to(device=nll.device, dtype=torch.float64)


def nll_sums(nll: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL, number of predicted tokens) of a `token_nll` result, each window weighted by `weights` [B]
    (None = 1): float64 scalars."""
    weights = _window_weights(nll, weights)
    return (nll.double().sum(-1) * weights).sum(), weights.sum() * nll.shape[1]


def position_nll_sums(nll: torch.Tensor, bucket_starts, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[len(bucket_starts), 2] float64: per bucket of token positions within the window, (summed NLL, number of
    predicted tokens) of a `token_nll` result. Bucket i holds the tokens at positions bucket_starts[i] up to the
    next start (the last one to the window's end); the position is the predicted token's, so token 0, never
    predicted, counts nowhere. Summed over the buckets these are `nll_sums`."""
    weights = _window_weights(nll, weights)
    positions = torch.arange(1, nll.shape[1] + 1, device=nll.device)
    starts = torch.as_tensor(list(bucket_starts), device=nll.device)
    bucket = torch.bucketize(positions, starts, right=True) - 1  # -1: before the first start (not counted)
    counted = bucket >= 0
    per_position = (nll.double() * weights[:, None]).sum(0)
    sums = torch.zeros(len(starts), 2, dtype=torch.float64, device=nll.device)
    sums[:, 0].index_add_(0, bucket[counted], per_position[counted])
    sums[:, 1] = torch.bincount(bucket[counted], minlength=len(starts)).double() * weights.sum()
    return sums


def batch_nll(model, batch: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token NLL, number of predicted tokens) of `batch` [B, T], each window weighted by `weights`
    [B] (None = 1): float64 scalars on the batch's device."""
    return nll_sums(token_nll(model, batch), weights)


def window_nll(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> tuple[float, int]:
    """(summed next-token NLL, number of predicted tokens) over `windows` [N, T]."""
    total, count = 0.0, 0
    for start in progress(range(0, len(windows), batch_size), desc=desc, disable=desc is None, leave=False):
        nll, tokens = batch_nll(model, windows[start:start + batch_size])
        total += float(nll)
        count += int(tokens)
    return total, count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> float:
    """exp(mean NLL); infinite when it overflows, NaN when the NLL is (a diverged model), never an error."""
    total, count = window_nll(model, windows, batch_size, desc)
    mean = total / count
    return math.inf if mean > math.log(float_info.max) else math.exp(mean)
