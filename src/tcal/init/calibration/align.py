"""Phase 2 of the init (docs/method.md, section "Phase 2"): each GDN layer trained alone on the alignment objective
(`tcal.student.alignment`): it sees the teacher-forced input x (the teacher's input_layernorm output entering the
layer) and is pulled towards the teacher attention module's output y_T on the same input, q/k/v and the dynamics at
their own learning rates, the best state kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from tcal.errors import Divergence, check_finite
from tcal.settings.init import Phase2Settings, PoolPhase2Settings
from tcal.student.alignment import alignment_loss, alignment_loss_value, alignment_metrics
from tcal.student.gdn import GatedDeltaNet

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
DYNAMICS = ("a_proj", "b_proj", "g_proj", "A_log", "dt_bias")


def parameter_groups(gdn: GatedDeltaNet, lr_projections: float, lr_dynamics: float) -> list[dict]:
    """q/k/v at the small learning rate, the dynamics (a, b, g projections, A_log, dt_bias) at the large one.
    Wo and o_norm are not in any group: they stay frozen."""
    def params(names):
        return [p for name, p in gdn.named_parameters() if name.split(".")[0] in names]

    return [{"params": params(PROJECTIONS), "lr": lr_projections}, {"params": params(DYNAMICS), "lr": lr_dynamics}]


@contextlib.contextmanager
def only_trainable(gdn: GatedDeltaNet, trainable) -> Iterator[None]:
    """Gradients for `trainable` only while the block runs; every parameter's requires_grad is restored after."""
    requires = {id(p): p.requires_grad for p in gdn.parameters()}
    gdn.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in gdn.parameters():
            p.requires_grad_(requires[id(p)])


def phase2_optimizer(gdn: GatedDeltaNet,
                     phase2: Phase2Settings | PoolPhase2Settings) -> tuple[torch.optim.Optimizer, list]:
    """AdamW over Phase 2's parameter groups, and the trainable parameters (for clipping)."""
    groups = parameter_groups(gdn, phase2.lr_projections, phase2.lr_dynamics)
    trainable = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(groups, weight_decay=phase2.weight_decay), trainable


def optimizer_step(optimizer, trainable, loss: torch.Tensor, grad_clip: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    optimizer.step()


def align_layer(gdn: GatedDeltaNet, x: torch.Tensor, target: torch.Tensor, phase2: Phase2Settings, mask=None,
                progress: tqdm | None = None) -> dict:
    """Phase 2: full-batch AdamW on the alignment loss for `phase2.steps` steps; keep the lowest-loss state."""
    before = alignment_metrics(gdn, x, target, mask)
    optimizer, trainable = phase2_optimizer(gdn, phase2)
    best, losses = BestState(), []
    tokens = x.shape[0] * x.shape[1] if mask is None else int(mask.sum())
    with only_trainable(gdn, trainable):
        for step in range(int(phase2.steps)):
            loss = alignment_loss(gdn, x, target, mask)
            losses.append(loss.item())
            check_finite(losses[-1], lambda value: Divergence.in_phase2(gdn.layer_idx, value, step, tokens))
            best.offer(gdn, losses[-1], step)
            optimizer_step(optimizer, trainable, loss, phase2.grad_clip)
            if progress is not None:
                progress.update(1)
        best.settle(gdn, alignment_loss_value(gdn, x, target, mask), int(phase2.steps))
    after = alignment_metrics(gdn, x, target, mask)
    return {"loss_before": before["mse"], "cosine_before": before["cosine"], "loss_after": after["mse"],
            "cosine_after": after["cosine"], "best_step": best.step, "losses": losses}


@torch.no_grad()
def snapshot(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class BestState:
    """The lowest loss offered so far, its step, and a copy of the module's state at that moment (Phase 2 keeps
    the state of its lowest loss, not its last)."""

    def __init__(self):
        self.loss, self.step, self.state = float("inf"), None, None

    def offer(self, module: torch.nn.Module, loss: float, step: int) -> None:
        if loss < self.loss:
            self.loss, self.step, self.state = loss, step, snapshot(module)

    def settle(self, module: torch.nn.Module, loss: float, step: int) -> None:
        """The last offer: `module` keeps its state when `loss` is the lowest, else gets the best state back."""
        if loss < self.loss:
            self.loss, self.step, self.state = loss, step, None
        else:
            module.load_state_dict(self.state)


