"""Perplexity on token windows: exp of the mean next-token negative log-likelihood over all windows.

The logits are computed from the final hidden states in chunks of `NLL_CHUNK_ROWS` positions and upcast to
float32 one chunk at a time, so a 152k vocabulary never holds a [batch, tokens, vocab] float32 tensor.
"""

from __future__ import annotations

import math
from sys import float_info

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

NLL_CHUNK_ROWS = 1024


def _chunked_head(model) -> bool:
    """Whether logits are a plain linear head on the decoder's output (true of every supported family)."""
    return (hasattr(model, "get_decoder") and model.get_output_embeddings() is not None
            and not getattr(model.config, "final_logit_softcapping", None))


@torch.no_grad()
def batch_nll(model, batch: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token NLL, number of predicted tokens) of `batch` [B, T], each window weighted by `weights`
    [B] (None = 1): float64 scalars on the batch's device."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    targets = batch[:, 1:]
    if _chunked_head(model):
        hidden = model.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state[:, :-1]
        head = model.get_output_embeddings()
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        token_nll = torch.cat([F.cross_entropy(head(flat[start:start + NLL_CHUNK_ROWS]).float(),
                                               flat_targets[start:start + NLL_CHUNK_ROWS], reduction="none")
                               for start in range(0, flat.shape[0], NLL_CHUNK_ROWS)]).view_as(targets)
    else:
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        token_nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_window = token_nll.double().sum(-1)
    if weights is None:
        return per_window.sum(), torch.tensor(float(targets.numel()), dtype=torch.float64, device=device)
    weights = weights.to(device=device, dtype=torch.float64)
    return (per_window * weights).sum(), weights.sum() * targets.shape[1]


def window_nll(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> tuple[float, int]:
    """(summed next-token NLL, number of predicted tokens) over `windows` [N, T]."""
    total, count = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc=desc, disable=desc is None, leave=False):
        nll, tokens = batch_nll(model, windows[start:start + batch_size])
        total += float(nll)
        count += int(tokens)
    return total, count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> float:
    """exp(mean NLL); infinite when it overflows, NaN when the NLL is (a diverged model), never an error."""
    total, count = window_nll(model, windows, batch_size, desc)
    mean = total / count
    return math.inf if mean > math.log(float_info.max) else math.exp(mean)
