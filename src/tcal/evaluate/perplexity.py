"""Perplexity on token windows: exp of the mean next-token negative log-likelihood over all windows."""

from __future__ import annotations

import math
from sys import float_info

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> tuple[float, int]:
    """(summed next-token NLL, number of predicted tokens) over `windows` [N, T]."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc=desc, disable=desc is None, leave=False):
        batch = windows[start:start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        targets = batch[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    return total, count


def perplexity(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> float:
    """exp(mean NLL); infinite when it overflows, NaN when the NLL is (a diverged model), never an error."""
    total, count = window_nll(model, windows, batch_size, desc)
    mean = total / count
    return math.inf if mean > math.log(float_info.max) else math.exp(mean)
