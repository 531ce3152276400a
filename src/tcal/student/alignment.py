"""How well a GDN layer stands in for the teacher's attention: the alignment loss (MSE between the layer's output
and the teacher's attention output on the same teacher-forced input) and its metrics, and the hooks that capture
those inputs and outputs. Phase 2 of the init (`tcal.init.calibration.phase2`) and Stage 1 (`tcal.training.stages`)
both minimize it."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tcal.student.gdn import GatedDeltaNet


def valid_tokens(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Rows of a [B, T, ...] tensor at non-padded positions (mask: [B, T], 1 = token)."""
    return t if mask is None else t[mask.bool()]


def alignment_loss(gdn: GatedDeltaNet, x: torch.Tensor, target: torch.Tensor, mask=None) -> torch.Tensor:
    """MSE between the layer's output and the teacher attention output, over non-padded tokens."""
    y = gdn(x, linear_attention_mask=mask)[0]
    return F.mse_loss(valid_tokens(y, mask).float(), valid_tokens(target, mask).float())


@torch.no_grad()
def alignment_metrics(gdn: GatedDeltaNet, x, target, mask=None) -> dict:
    """MSE and mean per-token cosine similarity to the teacher output."""
    y = valid_tokens(gdn(x, linear_attention_mask=mask)[0], mask).float()
    t = valid_tokens(target, mask).float()
    return {"mse": F.mse_loss(y, t).item(), "cosine": F.cosine_similarity(y, t, dim=-1).mean().item()}


@torch.no_grad()
def alignment_loss_value(gdn, x, target, mask=None) -> float:
    return alignment_loss(gdn, x, target, mask).item()


@contextlib.contextmanager
def capture_teacher_io(teacher, layers):
    """Inside the block, each teacher forward fills {layer: (x, y_T)}: the teacher-forced input of `self_attn`
    (the input_layernorm output) and the attention module's output, for every layer in `layers`."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(layer):
        def keep(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[layer] = (hidden.detach(), output[0].detach())
        return keep

    decoder = teacher.get_decoder().layers
    handles = [decoder[i].self_attn.register_forward_hook(hook(i), with_kwargs=True) for i in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
