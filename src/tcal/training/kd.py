"""Forward KL(teacher || student) on next-token distributions, fused with the output head, in chunks of tokens
(docs/method.md, section "Stage 2: distillation").

The logits of a batch ([tokens, vocab] in float32) are the largest tensors of distillation: 2048 tokens of a
49k vocabulary are 400 MB per model. Here they exist one chunk at a time. The gradient of the loss with respect
to a chunk's student logits has a closed form (softmax(student) - teacher probabilities, plus the CE term), so
each chunk's gradients with respect to the final hidden states and the head's weight are computed in the forward
pass and the logits are dropped at once: no recomputation, and memory grows with `chunk_size`, not the batch.

Precision. The head GEMMs (each chunk's student and teacher logits, the hidden-state gradient and the
head-gradient GEMM) run in the compute dtype: under autocast (`bf16-mixed`) its dtype, else each head's own
dtype. Only the chunk's logits are upcast, so the softmax, the KL and the logit gradients are float32. The head's
gradient accumulates over the chunks in float32 whenever the head is float32 or autocast is on: on CUDA the
head-gradient GEMM takes bfloat16 operands and adds into the float32 accumulator itself (`addmm` with
`out_dtype`); on other devices (no such kernel) each chunk's [vocab, hidden] product comes out in the compute
dtype and is added into the accumulator (`HEAD_GRAD_PATHS`; the path taken is logged once per device). A `-true`
reduced-precision run (bfloat16 heads, no autocast) accumulates in the head's dtype, as it computes.

Memory policy (per call, besides the caller's hidden states): the float32 head-gradient accumulator [vocab,
hidden]; under autocast one compute-dtype copy of each head that is not already in that dtype (autocast itself
would make one per matmul); a few [chunk, vocab] float32 tensors of one chunk; off CUDA, under autocast, one
[vocab, hidden] compute-dtype product per chunk (freed before the next); once the chunks are done, the
accumulator's copy in the head's dtype when that differs (FSDP's bfloat16 gathered head), which is what the
backward returns. A float32 run holds exactly what it held before this policy (no copies): its figures are
bit-identical.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

HEAD_GRAD_PATHS = {
    "same_dtype": "addmm_ in place in the accumulator's dtype (no autocast, or a head already in it)",
    "out_dtype": "addmm of compute-dtype operands into the float32 accumulator (CUDA, out_dtype)",
    "chunk_product": "a compute-dtype product per chunk added into the float32 accumulator (no out_dtype kernel)",
}
_logged_paths: set[tuple[str, str]] = set()


def compute_dtype(device_type: str, own: torch.dtype) -> torch.dtype:
    """The dtype a head GEMM runs in: autocast's on `device_type` when it is on, else the head's own `own`."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else own


def head_grad_path(accumulator: torch.dtype, compute: torch.dtype, device_type: str) -> str:
    """Which way the head-gradient GEMM accumulates (a key of `HEAD_GRAD_PATHS`)."""
    if accumulator == compute:
        return "same_dtype"
    return "out_dtype" if device_type == "cuda" else "chunk_product"


def add_head_grad(accumulator: torch.Tensor, grad_logits_t: torch.Tensor, h: torch.Tensor, path: str) -> None:
    """accumulator [V, D] += grad_logits_t [V, rows] @ h [rows, D], the way `path` names (`HEAD_GRAD_PATHS`):
    in place in one dtype, through CUDA's `addmm` with a float32 `out_dtype`, or via a product in the operands'
    dtype added into the accumulator."""
    if path == "same_dtype":
        accumulator.addmm_(grad_logits_t, h)  # in place: no head-sized temporary per chunk
    elif path == "out_dtype":
        torch.addmm(accumulator, grad_logits_t, h, out_dtype=accumulator.dtype, out=accumulator)
    else:
        accumulator.add_(grad_logits_t @ h)


class _FusedHeadKL(torch.autograd.Function):
    """loss = mean KL(teacher || student) + ce_weight * mean CE over rows, for student logits = hidden @ weight.T.

    hidden, teacher_hidden: [N, D]; weight, teacher_weight: [V, D]; targets: [N] token ids; ce_rows: [N] float
    (1 = the row's CE counts). Returns (loss, kl, ce); only `loss` carries a gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, ce_rows, ce_weight, chunk_size):
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = compute_dtype(device_type, weight.dtype)
        teacher_dtype = compute_dtype(device_type, teacher_weight.dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)
        tw = teacher_weight if teacher_weight.dtype == teacher_dtype else teacher_weight.to(teacher_dtype)
        count, ce_count = hidden.shape[0], max(float(ce_rows.sum()), 1.0)
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32)
        accumulate = torch.float32 if weight.dtype == torch.float32 or autocast else weight.dtype
        grad_weight = torch.zeros_like(weight, dtype=accumulate)
        path = head_grad_path(accumulate, dtype, device_type)
        if (device_type, path) not in _logged_paths:
            _logged_paths.add((device_type, path))
            log.info("fused KL on %s: head GEMMs in %s, head gradient: %s", device_type, dtype, HEAD_GRAD_PATHS[path])
        kl_sum = ce_sum = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, count, chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(dtype)
            student_logp = F.log_softmax((h @ w.T).float(), dim=-1)
            teacher_logp = F.log_softmax((teacher_hidden[rows].to(teacher_dtype) @ tw.T).float(), dim=-1)
            teacher_p = teacher_logp.exp()
            kl_sum = kl_sum + teacher_logp.sub_(student_logp).mul_(teacher_p).sum()  # in place: one chunk less
            del teacher_logp
            picked = student_logp.gather(-1, targets[rows, None])[:, 0]
            ce_sum = ce_sum - (picked * ce_rows[rows]).sum()
            student_p = student_logp.exp_()
            if ce_weight:
                grad_logits = (student_p - teacher_p) / count  # d mean-KL / d logits
                onehot = torch.zeros_like(student_p).scatter_(-1, targets[rows, None], 1.0)
                grad_logits += (ce_weight / ce_count) * (student_p - onehot) * ce_rows[rows, None]
            else:
                grad_logits = student_p.sub_(teacher_p).div_(count)  # the same values, in place
            del teacher_p, student_p, student_logp
            grad_logits = grad_logits.to(dtype)
            grad_hidden[rows] = grad_logits @ w
            add_head_grad(grad_weight, grad_logits.T, h, path)
            del grad_logits
        del w, tw
        ctx.save_for_backward(grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype))
        kl, ce = kl_sum / count, ce_sum / ce_count
        loss = kl + ce_weight * ce  # a tensor of its own: kl and ce are returned without gradients
        ctx.mark_non_differentiable(kl, ce)
        return loss, kl, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        grad_hidden, grad_weight = ctx.saved_tensors  # scaled in place: no second head-sized tensor
        return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None, None, None, None, None


def chunked_kd_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, student_head, teacher_head,
                    input_ids: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int = 256,
                    ce_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean KL(teacher || student) over valid tokens + ce_weight * mean next-token CE.

    hidden: [B, T, D] final hidden states; the heads are bias-free `nn.Linear` output layers. input_ids, mask:
    [B, T] (mask 1 = token, None = all). Every position of the sequence is distilled; CE skips positions whose
    next token is missing or padded. Returns (loss, {"kl": float, "ce": float}).
    """
    if chunk_size < 1:
        raise ValueError(f"stage.kl_chunk_size={chunk_size}; expected >= 1")
    for head in (student_head, teacher_head):
        if getattr(head, "bias", None) is not None:
            raise ValueError("the fused KL expects output heads without a bias")
    B, T, _ = student_hidden.shape
    valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if mask is None else mask.bool()
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    has_next = torch.zeros_like(valid)
    has_next[:, :-1] = valid[:, :-1] & valid[:, 1:]
    if not bool(valid.any()):
        raise ValueError("the batch has no valid (unpadded) tokens to distill")
    loss, kl, ce = _FusedHeadKL.apply(student_hidden[valid], student_head.weight, teacher_hidden[valid].detach(),
                                      teacher_head.weight.detach(), targets[valid], has_next[valid].float(),
                                      float(ce_weight), int(chunk_size))
    return loss, {"kl": kl.item(), "ce": ce.item()}
