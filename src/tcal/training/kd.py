"""Forward KL(teacher || student) on next-token distributions, in chunks of tokens (DESIGN section 7).

The logits of a batch ([tokens, vocab] in float32) are the largest tensors of distillation: 2048 tokens of a
49k vocabulary are 400 MB per model. Here they exist one chunk at a time: each chunk's student logits are
recomputed in the backward pass from the final hidden state (activation checkpointing), so neither model's
full-batch logits are ever held, and memory grows with `chunk_size`, not with the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_sums(student_hidden, teacher_hidden, student_head, teacher_head, targets, ce_rows):
    """(summed KL, summed next-token CE over `ce_rows`) of one chunk: hidden [n, D], targets [n], ce_rows [n]."""
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher_head(teacher_hidden).float(), dim=-1)
    student_logp = F.log_softmax(student_head(student_hidden).float(), dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum()
    ce = -(student_logp.gather(-1, targets[:, None])[:, 0] * ce_rows).sum()
    return kl, ce


def chunked_kd_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head, teacher_head,
                    input_ids: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int = 1024,
                    ce_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean KL(teacher || student) over valid tokens + ce_weight * mean next-token CE.

    hidden: [B, T, D] final hidden states, mapped to logits by the heads; input_ids, mask: [B, T] (mask 1 =
    token, None = all). Every position of the sequence is distilled; CE skips positions whose next token is
    missing or padded. Returns (loss, {"kl": float, "ce": float}).
    """
    if chunk_size < 1:
        raise ValueError(f"stage.kl_chunk_size={chunk_size}; expected >= 1")
    B, T, _ = student_hidden.shape
    valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if mask is None else mask.bool()
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    has_next = torch.zeros_like(valid)
    has_next[:, :-1] = valid[:, :-1] & valid[:, 1:]
    rows = (student_hidden[valid], teacher_hidden[valid], targets[valid], has_next[valid].float())
    count, ce_count = rows[0].shape[0], int(has_next.sum())
    if count == 0:
        raise ValueError("the batch has no valid (unpadded) tokens to distill")
    kl_sum = ce_sum = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, count, chunk_size):
        s_h, t_h, tgt, ce_rows = (r[start:start + chunk_size] for r in rows)
        kl, ce = checkpoint(_chunk_sums, s_h, t_h, student_head, teacher_head, tgt, ce_rows, use_reentrant=False)
        kl_sum, ce_sum = kl_sum + kl, ce_sum + ce
    kl_mean, ce_mean = kl_sum / count, ce_sum / max(ce_count, 1)
    loss = kl_mean + ce_weight * ce_mean if ce_weight else kl_mean
    return loss, {"kl": kl_mean.item(), "ce": ce_mean.item()}
