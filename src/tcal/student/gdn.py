"""The student's Gated DeltaNet mixer, the paper's "gdn_v4" (docs/method.md, section "The GDN layer").

Parameter names and shapes are fla's `GatedDeltaNet(expand_v=1, use_short_conv=False, use_gate=True)`,
so a checkpoint loads into fla's layer. The projections, gates, l2norm and gated RMSNorm are plain torch;
only the delta-rule recurrence dispatches: fla's chunked Triton kernel on CUDA where the stack is right for it
(`trainer.gdn_kernel`, `tcal.student.stack`), the pure-torch chunked recurrence (`chunk_gated_delta_rule_torch`) on
CPU and wherever it is asked for, and a single recurrent step for one-token decoding anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tcal.student.stack import gdn_kernel_for

log = logging.getLogger(__name__)

_announced: set[tuple[str, str]] = set()
_traced_kernel = None  # a stand-in for the chunked kernel while `traced_kernel` is on (tcal-plan)
_cuda_kernel: str | None = None  # `fla` or `torch` for this process's CUDA calls; None: `auto`, decided at first use


def use_gdn_kernel(choice: str, on_cuda: bool) -> str:
    """Choose the kernel of this process's multi-token delta rule (`trainer.gdn_kernel`: auto, fla, torch) for a run
    on CUDA (`on_cuda`) or not. A stack on which fla computes wrong or refuses is a one-line ConfigError here, before
    any work (`tcal.student.stack.gdn_kernel_for`). Returns the name of the kernel path the run uses."""
    global _cuda_kernel
    kernel = gdn_kernel_for(choice, on_cuda)
    if on_cuda:
        _cuda_kernel = kernel
    return kernel_path("cuda" if on_cuda else "cpu")


def _cuda_kernel_chosen() -> str:
    global _cuda_kernel
    if _cuda_kernel is None:  # no run chose (the Python API on CUDA): `auto`, with its refusal
        _cuda_kernel = gdn_kernel_for("auto", True)
    return _cuda_kernel


def kernel_path(device: torch.device | str) -> str:
    """Name of the delta-rule implementation used on `device` (printed once per run, recorded as `kernel_path`)."""
    cuda = torch.device(device).type == "cuda"
    return "fla-triton-chunk" if cuda and _cuda_kernel_chosen() == "fla" else "torch-chunk"


def _announce(device: torch.device) -> None:
    path = kernel_path(device)
    if (device.type, path) not in _announced:
        _announced.add((device.type, path))
        log.info("GatedDeltaNet kernel path on %s: %s", device, path)


def recurrent_step(q, k, v, g, beta, state, scale, in_place: bool = False):
    """One token of the gated delta rule. q, k: [B, H, K]; v: [B, H, V]; g, beta: [B, H]; state: [B, H, K, V]
    (contiguous). With `in_place` the new state is written into `state` and `state` itself returned (decoding
    without autograd: no new state tensor to allocate, none to copy into the cache; about 6x less time at batch
    8). Batched matmuls over the contiguous state rather than einsum, which copied it transposed."""
    decay = g.exp()[..., None, None]
    state = state.mul_(decay) if in_place else state * decay
    residual = (v - (k.unsqueeze(-2) @ state).squeeze(-2)) * beta[..., None]
    flat, k_col, row = state.flatten(0, 1), k.flatten(0, 1).unsqueeze(-1), residual.flatten(0, 1).unsqueeze(-2)
    if in_place:
        flat.baddbmm_(k_col, row)  # state += k residual^T, through the flat view
    else:
        state = torch.baddbmm(flat, k_col, row).view_as(state)
    return ((q * scale).unsqueeze(-2) @ state).squeeze(-2), state


def kernel_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v, beta as fla's kernel takes them: in autocast's dtype when autocast is on for their device (bf16-mixed
    runs the kernel in bfloat16, as the matmuls around it; its state and log decay stay float32), else unchanged."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


@contextlib.contextmanager
def traced_kernel(kernel):
    """Within the block, every multi-token call of `gated_delta_rule` runs `kernel(q, k, v, g, beta, initial_state,
    output_final_state)` instead: how `tcal-plan` traces, on tensors of the meta device, what fla's CUDA kernel keeps
    for backward. One process-wide switch, for planning only."""
    global _traced_kernel
    before, _traced_kernel = _traced_kernel, kernel
    try:
        yield
    finally:
        _traced_kernel = before


def gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, update_state: bool = False):
    """o_t = S_t q_t / sqrt(K), S_t = exp(g_t)(S_{t-1} - beta_t S_{t-1} k_t k_t^T) + beta_t v_t k_t^T.

    q, k: [B, T, H, K] (already l2-normalized); v: [B, T, H, V]; g (log decay), beta: [B, T, H].
    The state is [B, H, K, V] in float32 on every path. Returns (o [B, T, H, V] float32, state or None).
    `update_state`: a one-token step writes its final state into `initial_state` (a contiguous float32 tensor
    outside autograd, e.g. the cache's) and returns that tensor.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.shape[1] == 1:
        state = initial_state
        if state is None:
            state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
        in_place = update_state and initial_state is not None
        o, state = recurrent_step(*(t[:, 0].float() for t in (q, k, v, g, beta)), state.float(), scale, in_place)
        return o[:, None], state if output_final_state else None
    if _traced_kernel is not None:
        return _traced_kernel(q, k, v, g, beta, initial_state, output_final_state)
    if q.is_cuda and _cuda_kernel_chosen() == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v, beta = kernel_inputs(q, k, v, beta)
        o, state = chunk_gated_delta_rule(
            q, k, v, g=g.float(), beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        )
        return o.float(), state
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, 64, scale, initial_state, output_final_state)


INFERENCE_SEGMENT = 256  # tokens per piece of a chunked forward without autograd (rounded to whole chunks)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None,
                                 output_final_state=False):
    """The chunked (WY) gated delta rule in plain torch, float32; same maths as fla's
    `naive_chunk_gated_delta_rule`, with its 64-step Python loop for the in-chunk inverse replaced by one
    triangular solve (about 2x less GDN time on CPU). Shapes as `gated_delta_rule`.

    Without autograd a longer sequence runs INFERENCE_SEGMENT tokens at a time, the state carried from piece to
    piece: the same chunks and the same results, but the per-chunk intermediates of a whole long sequence
    outgrow the CPU caches (a prefill of 16k tokens took 2.4x the time, 4 x 4,096 eval windows 2.2x). With
    autograd the sequence runs whole, which keeps the backward faster."""
    segment = max(INFERENCE_SEGMENT // chunk_size, 1) * chunk_size
    inputs = (q, k, v, g, beta, initial_state)
    recording = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if recording or q.shape[1] <= segment:
        return _chunk_rule(q, k, v, g, beta, chunk_size, scale, initial_state, output_final_state)
    outputs, state = [], initial_state
    for start in range(0, q.shape[1], segment):
        piece = slice(start, start + segment)
        o, state = _chunk_rule(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], chunk_size,
                               scale, state, True)
        outputs.append(o)
    return torch.cat(outputs, 1), state if output_final_state else None


def _chunk_rule(q, k, v, g, beta, chunk_size, scale, initial_state, output_final_state):
    """`chunk_gated_delta_rule_torch` over the whole sequence at once."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    pad = (-T) % C
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)) for t in (g, beta))
    n = (T + pad) // C
    q, k, v = (t.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4) for t in (q, k, v))  # [B, H, n, C, d]
    g, beta = (t.view(B, n, C, H).permute(0, 3, 1, 2) for t in (g, beta))      # [B, H, n, C]
    q = q * scale
    gc = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    wy = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)
    u = wy @ (v * beta[..., None])
    w = wy @ (k_beta * gc.exp()[..., None])
    qk = q @ k.transpose(-1, -2) * decay
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    out = []
    q_decayed = q * gc.exp()[..., None]
    k_decayed = k * (gc[..., -1:] - gc).exp()[..., None]
    for u_i, w_i, q_i, qk_i, k_i, last in zip(*(t.unbind(2) for t in (u, w, q_decayed, qk, k_decayed)),
                                              gc[..., -1].unbind(2)):
        v_new = u_i - w_i @ state
        out.append(q_i @ state + qk_i @ v_new)
        state = state * last.exp()[..., None, None] + k_i.transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(B, H, n * C, V)[:, :, :T].transpose(1, 2)
    return o, state if output_final_state else None


def _cached_state(cache, layer_idx: int):
    """The layer's recurrent state in transformers' hybrid cache, or None before the first write.

    After `cache.reset()` the zeroed state is returned, which is equivalent to no state.
    """
    layer = cache.layers[layer_idx]
    return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the mixer output, times silu(gate) (fla's FusedRMSNormGated, swish)."""

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return o * F.silu(gate.float())


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer with fla's parameter names; drop-in for a decoder layer's `self_attn`."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, norm_eps: float = 1e-5,
                 layer_idx: int | None = None):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.layer_idx = layer_idx
        # Training only: keep just the input for backward and recompute the mixer there (about 170 MB less per
        # layer at 4 x 512 tokens, for about one more mixer forward). Set by the training stages.
        self.checkpoint_training = False
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.g_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        self.reset_dynamics()

    @torch.no_grad()
    def reset_dynamics(self, generator: torch.Generator | None = None) -> None:
        """fla's defaults: A ~ U(0, 16), A_log = log A; dt log-uniform in [1e-3, 1e-1] (floor 1e-4)."""
        A = torch.empty(self.num_heads).uniform_(0, 16, generator=generator)
        self.A_log.copy_(torch.log(A))
        dt_min, dt_max = 1e-3, 1e-1
        u = torch.rand(self.num_heads, generator=generator)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(*t.shape[:-1], self.num_heads, self.head_dim)

    def gates(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        """Log decay g = -exp(A_log) softplus(a_proj x + dt_bias) and write strength beta = sigmoid(b_proj x).

        Padded positions (mask 0) get g = 0 and beta = 0: the state passes through them untouched.
        """
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x).float())
        if mask is not None:
            keep = mask.to(g.dtype)[..., None]
            g, beta = g * keep, beta * keep
        return g, beta

    def qkv(self, x: torch.Tensor):
        q = F.normalize(F.silu(self._heads(self.q_proj(x))).float(), dim=-1)
        k = F.normalize(F.silu(self._heads(self.k_proj(x))).float(), dim=-1)
        v = F.silu(self._heads(self.v_proj(x))).float()
        return q, k, v

    def mix(self, x: torch.Tensor, mask: torch.Tensor | None = None, initial_state=None,
            output_final_state: bool = False, update_state: bool = False):
        """The recurrence's output o [B, T, H, dh] (float32, before the gated norm) and the final state
        (`update_state`: see `gated_delta_rule`)."""
        _announce(x.device)
        q, k, v = self.qkv(x)
        g, beta = self.gates(x, mask)
        return gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state, update_state)

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y = Wo(RMSNorm(o) * silu(Wg x)), per head."""
        y = self.o_norm(o, self._heads(self.g_proj(x)))
        return self.o_proj(y.flatten(-2).to(x.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, cache=None,
                linear_attention_mask: torch.Tensor | None = None, **kwargs):
        """Decoder-layer interface: `attention_mask` (the softmax layers' 4D mask) is ignored; padding comes
        as the 2D `linear_attention_mask` ([B, T], 1 = token) trimmed to this call's positions."""
        if cache is None and self.checkpoint_training and self.training and torch.is_grad_enabled():
            return checkpoint(self._mix_out, hidden_states, linear_attention_mask, use_reentrant=False), None
        cached = _cached_state(cache, self.layer_idx) if cache is not None else None
        # Without autograd a decoding step updates the cached state in place instead of copying a new one into it.
        o, state = self.mix(hidden_states, linear_attention_mask, cached, output_final_state=cache is not None,
                            update_state=not torch.is_grad_enabled())
        if cache is not None and state is not cached:
            cache.update_recurrent_state(state, self.layer_idx)
        return self.project_out(o, hidden_states), None

    def _mix_out(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.project_out(self.mix(x, mask)[0], x)
