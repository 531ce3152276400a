"""Phase 2 of the init (docs/method.md, section "Phase 2"): GDN layers trained on the alignment objective
(`tcal.student.alignment`): each sees the teacher-forced input x (the teacher's input_layernorm output entering the
layer) and is pulled towards the teacher attention module's output y_T on the same input, q/k/v and the dynamics at
their own learning rates, the best state kept.

One fit (`fit_stack`) for every mode: a stack of 1..L layers of one shape and a source of windows, `FullBatch` (the
paper's: the calibration batch every step, the state of the lowest fitted loss kept) or `pool.PoolDraws`
(`full_plus`: minibatches of a pool, the state of the lowest held-out loss kept). The layers' trainable weights are
stacked along a leading layer dimension [L, ...]: one forward for all of them (the layers folded into the batch
dimension of the recurrence: one `gated_delta_rule` call), one backward of the sum of their losses, one AdamW step.

Nothing passes between layers: layer l's loss reaches only its own slice of the weights, its gradient is clipped by
its own norm, AdamW is elementwise, and each layer keeps its own best state. So a layer's fit is the one it makes
alone in a stack of one (`calibration.layers_per_fit=1`, or `calibration.fit=sequential`), up to float rounding.

Why stacked: a layer's fit is hundreds of small steps, and one layer after another a GPU mostly waited on kernel
launches and on the host reading each step's loss. Here a step is every layer's work in the same launches, the best
states stay on the device, and the losses are read every `READ_EVERY` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tcal.errors import Divergence
from tcal.student.gdn import GatedDeltaNet, gated_delta_rule

PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # trained at the small learning rate
DYNAMICS = ("a_proj", "b_proj", "g_proj", "A_log", "dt_bias")  # at the large one; Wo and o_norm stay frozen
READ_EVERY = 10  # steps between reads of the losses (the host's only wait on the device during a fit)
STACKED = ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")  # the projections, in one matmul's order


class LayerStack:
    """The Phase 2 weights of L GDN layers of one shape, stacked: each projection's weight [L, out, D] and A_log,
    dt_bias [L, H] trainable (float32 leaves), Wo [L, D, H*dh] and the output norm's weight [L, dh] frozen, on the
    layers' device; the delta rule runs the layers' own kernel (their run's choice). `write_back` copies the trained
    weights into the layers."""

    def __init__(self, gdns: Sequence[GatedDeltaNet]):
        self.gdns = list(gdns)
        shape = {(g.hidden_size, g.num_heads, g.head_dim, g.o_norm.eps, g.kernel) for g in self.gdns}
        if len(shape) != 1:
            raise ValueError(f"a layer stack needs GDN layers of one shape and kernel (hidden, heads, head_dim, eps, "
                             f"kernel); got {shape}")
        (self.hidden_size, self.num_heads, self.head_dim, self.eps, self.kernel), = shape

        def stacked(get) -> torch.Tensor:
            return torch.stack([get(g).detach().float() for g in self.gdns])

        self.params = {name: stacked(lambda g, n=name: getattr(g, n).weight) for name in STACKED}
        self.params.update(A_log=stacked(lambda g: g.A_log), dt_bias=stacked(lambda g: g.dt_bias))
        for p in self.params.values():
            p.requires_grad_(True)
        self.o_proj = stacked(lambda g: g.o_proj.weight)
        self.o_norm = stacked(lambda g: g.o_norm.weight)

    def __len__(self) -> int:
        return len(self.gdns)

    def groups(self, lr_projections: float, lr_dynamics: float) -> list[dict]:
        """Phase 2's AdamW groups: q/k/v at the small learning rate, the dynamics at the large one."""
        return [{"params": [self.params[n] for n in PROJECTIONS], "lr": lr_projections},
                {"params": [self.params[n] for n in DYNAMICS], "lr": lr_dynamics}]

    def trainable(self) -> list[torch.Tensor]:
        return [self.params[n] for n in (*PROJECTIONS, *DYNAMICS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y [L, B, T, D] of each layer l on its own input x[l] ([L, B, T, D]): `GatedDeltaNet.forward` with layer l's
        weights, the six input projections as one batched matmul and the L layers as L * B sequences of one
        `gated_delta_rule` call."""
        L, B, T, D = x.shape
        H, dh = self.num_heads, self.head_dim
        weights = torch.cat([self.params[n] for n in STACKED], dim=1)  # [L, 4 H dh + 2 H, D]
        projected = torch.bmm(x.reshape(L, B * T, D).float(), weights.transpose(1, 2))
        q, k, v, gate, a, b = projected.split([H * dh] * 4 + [H] * 2, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(L * B, T, H, dh)

        q, k = (F.normalize(F.silu(heads(t)), dim=-1) for t in (q, k))
        v = F.silu(heads(v))
        g = -self.params["A_log"].exp()[:, None] * F.softplus(a + self.params["dt_bias"][:, None])
        beta = torch.sigmoid(b)
        o, _ = gated_delta_rule(q, k, v, g.reshape(L * B, T, H), beta.reshape(L * B, T, H), kernel=self.kernel)
        o = o.reshape(L, B * T, H, dh)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm[:, None, None]
        o = o * F.silu(gate.reshape(L, B * T, H, dh))
        return torch.bmm(o.reshape(L, B * T, H * dh), self.o_proj.transpose(1, 2)).view(L, B, T, D)

    @torch.no_grad()
    def write_back(self) -> None:
        for l, gdn in enumerate(self.gdns):
            for name in STACKED:
                getattr(gdn, name).weight.copy_(self.params[name][l])
            gdn.A_log.copy_(self.params["A_log"][l])
            gdn.dt_bias.copy_(self.params["dt_bias"][l])


def layer_groups(layers: list, size: int | None) -> list[list]:
    """`layers` in consecutive groups of `size` (one group when size is None)."""
    size = len(layers) if not size else int(size)
    return [layers[start:start + size] for start in range(0, len(layers), size)]


def layers_per_fit(setting: int | None, device: torch.device) -> int | None:
    """How many layers one batched fit stacks: `calibration.layers_per_fit`, or by default every layer on an
    accelerator and one on a CPU. On a CPU stacking does not pay: a step of 15 stacked SmolLM2 layers took 1.5x
    (one thread) to 1.7x (two) the time of 15 single-layer steps on a shared 2-core machine; its tensors leave the
    caches, and those above glibc's mmap threshold (32 MB) are mapped and page-faulted anew on every step (5x the
    page faults; 1.1x the CPU time once glibc kept its memory). On a GPU it saves launches and syncs instead."""
    if setting is not None:
        return int(setting)
    return 1 if torch.device(device).type == "cpu" else None


def stack_losses(stack: LayerStack, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[L] alignment losses (`alignment.alignment_loss` of each layer: the MSE over its tokens and features)."""
    return (stack.forward(x) - target.float()).pow(2).flatten(1).mean(1)


@torch.no_grad()
def stack_metrics(stack: LayerStack, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([L] MSE, [L] mean per-token cosine): `alignment.alignment_metrics` of each layer, left on the device."""
    y, target = stack.forward(x), target.float()
    return (y - target).pow(2).flatten(1).mean(1), F.cosine_similarity(y, target, dim=-1).flatten(1).mean(1)


def clip_each_layer(params: Sequence[torch.Tensor], max_norm: float) -> None:
    """`torch.nn.utils.clip_grad_norm_` on each layer's slice [l] of the stacked parameters' gradients alone: the
    slice scaled by min(1, max_norm / (its norm + 1e-6)), its norm taken over every parameter's slice l."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])  # [P, L]
    scale = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))


class LayerBest:
    """The best state of each layer of a stack, on the device (Phase 2 keeps the state of its lowest loss, not its last): the lowest loss offered so far [L], its step [L],
    and a copy of the trainable weights in which slice l is layer l's state at its lowest loss."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        layers, device = self.params[0].shape[0], self.params[0].device
        self.loss = torch.full((layers,), math.inf, device=device)
        self.step = torch.full((layers,), -1, dtype=torch.long, device=device)
        self.state = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def offer(self, loss: torch.Tensor, step: int) -> None:
        better = loss < self.loss  # a NaN is never better
        self.loss = torch.where(better, loss, self.loss)
        self.step = torch.where(better, step, self.step)
        for kept, p in zip(self.state, self.params):
            torch.where(better.view(-1, *[1] * (p.dim() - 1)), p, kept, out=kept)

    @torch.no_grad()
    def settle(self, loss: torch.Tensor, step: int) -> None:
        """The last offer: a layer keeps its weights when `loss` is its lowest, else gets its best state back."""
        better = loss < self.loss
        self.loss = torch.where(better, loss, self.loss)
        self.step = torch.where(better, step, self.step)
        for kept, p in zip(self.state, self.params):
            torch.where(better.view(-1, *[1] * (p.dim() - 1)), p, kept, out=p)


class StackFit:
    """AdamW on a stack's trainable weights (Phase 2's groups and weight decay; fused), each layer's gradient clipped
    alone, `factor(step)` scaling the learning rates; the fitted losses kept on the device [steps, L] and read every
    `READ_EVERY` steps, where a non-finite one stops the fit as a `Divergence`."""

    def __init__(self, stack: LayerStack, phase2, steps: int, tokens: int,
                 factor: Callable[[int], float] | None = None, progress: tqdm | None = None):
        self.stack, self.grad_clip, self.tokens, self.progress = stack, float(phase2.grad_clip), tokens, progress
        self.trainable = stack.trainable()
        device = self.trainable[0].device
        self.optimizer = torch.optim.AdamW(stack.groups(phase2.lr_projections, phase2.lr_dynamics),
                                           weight_decay=phase2.weight_decay, fused=True)
        self.scheduler = None if factor is None else torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.best = LayerBest(self.trainable)
        self.losses = torch.full((steps, len(stack)), math.nan, device=device)
        self.read_rows: list[list[float]] = []

    def step(self, step: int, losses: torch.Tensor) -> None:
        """Record the losses of `step` ([L], with their graph), and take the optimizer step on them."""
        self.losses[step] = losses.detach()
        self.optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        clip_each_layer(self.trainable, self.grad_clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if (step + 1) % READ_EVERY == 0:
            self.read(step + 1)

    def read(self, upto: int) -> None:
        """Bring the losses of the steps before `upto` to the host; raise a `Divergence` for the first non-finite
        one (the earliest step; at one step, the first layer of the stack), naming its layer and step."""
        start = len(self.read_rows)
        rows = self.losses[start:upto].tolist()
        self.read_rows.extend(rows)
        if self.progress is not None:
            self.progress.update(len(rows) * len(self.stack))
        for step, row in enumerate(rows, start=start):
            for l, value in enumerate(row):
                if not math.isfinite(value):
                    raise Divergence.in_phase2(self.stack.gdns[l].layer_idx, value, step, self.tokens)

    def layer_losses(self, l: int) -> list[float]:
        return [row[l] for row in self.read_rows]


class FullBatch:
    """The paper's windows: every step fits the whole batch, x and target [L, B, T, D] (layer l on x[l]), and each
    layer keeps the state of its lowest fitted loss (offered before each step, and after the last one). Its records
    hold the loss and cosine on the batch before and after."""

    factor = None  # a constant learning rate

    def __init__(self, x: torch.Tensor, target: torch.Tensor):
        self.x, self.target = x, target
        self.tokens = x.shape[1] * x.shape[2]

    def start(self, stack: LayerStack) -> None:
        self.before = stack_metrics(stack, self.x, self.target)

    def windows(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.target

    def selection_loss(self, stack: LayerStack, step: int, losses: torch.Tensor) -> torch.Tensor:
        return losses.detach()

    @torch.no_grad()
    def last_loss(self, stack: LayerStack, steps: int) -> torch.Tensor:
        return stack_losses(stack, self.x, self.target)

    def records(self, stack: LayerStack, fit: StackFit) -> list[dict]:
        before, after = ([t.tolist() for t in pair] for pair in (self.before, stack_metrics(stack, self.x, self.target)))
        return [{"loss_before": before[0][l], "cosine_before": before[1][l], "loss_after": after[0][l],
                 "cosine_after": after[1][l], "best_step": best_step, "losses": fit.layer_losses(l)}
                for l, best_step in enumerate(fit.best.step.tolist())]


def fit_stack(gdns: Sequence[GatedDeltaNet], source, phase2, progress: tqdm | None = None) -> list[dict]:
    """Phase 2 of L layers together (in place): `phase2.steps` AdamW steps, each on `source.windows(step)`; the
    state each layer keeps is chosen by `source.selection_loss` (offered before a step, when not None) and
    `source.last_loss` (after the last); their records, from `source.records`. `source.factor` (or None) shapes
    the learning rate over the steps."""
    stack, steps = LayerStack(gdns), int(phase2.steps)
    source.start(stack)
    fit = StackFit(stack, phase2, steps, source.tokens, source.factor, progress)
    for step in range(steps):
        x, target = source.windows(step)
        losses = stack_losses(stack, x, target)
        selection = source.selection_loss(stack, step, losses)
        if selection is not None:
            fit.best.offer(selection, step)
        fit.step(step, losses)
    fit.read(steps)
    fit.best.settle(source.last_loss(stack, steps), steps)
    records = source.records(stack, fit)
    stack.write_back()
    return records
