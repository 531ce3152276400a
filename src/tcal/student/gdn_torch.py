"""The Gated DeltaNet layer in torch alone: the maths both tcal's student (`tcal.student.gdn`, which adds fla's kernels
on CUDA and activation checkpointing) and the `hf` export's shipped modeling file run. This module imports
nothing but torch, because `tcal-export --format hf` splices its code into that file (`tcal.export.remote`), which
loads where tcal is not installed. One layer, per head (d = head_dim), with fla's parameter names:

    q, k, v = l2norm(silu(Wq x)), l2norm(silu(Wk x)), silu(Wv x)
    g = -exp(A_log) * softplus(Wa x + dt_bias)         (log decay)      beta = sigmoid(Wb x)
    S_t = exp(g_t) (S_{t-1} - beta_t S_{t-1} k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t / sqrt(d)
    y = Wo (RMSNorm_eps(o) * w * silu(Wg x))

The state S is float32 [B, H, K, V] on every path, kept in transformers' hybrid `DynamicCache`. A prompt runs the
chunked (WY) form of the recurrence, chunks of 64 tokens, exact up to float rounding; one-token decoding runs a single
recurrent step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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


def gated_delta_rule_torch(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           update_state: bool = False):
    """o_t = S_t q_t / sqrt(K), S_t = exp(g_t)(S_{t-1} - beta_t S_{t-1} k_t k_t^T) + beta_t v_t k_t^T, in torch:
    one token by `recurrent_step`, more by `chunk_gated_delta_rule_torch`.

    q, k: [B, T, H, K] (already l2-normalized); v: [B, T, H, V]; g (log decay), beta: [B, T, H].
    The state is [B, H, K, V] in float32. Returns (o [B, T, H, V] float32, state or None).
    `update_state`: a one-token step writes its final state into `initial_state` (a contiguous float32 tensor
    outside autograd, e.g. the cache's) and returns that tensor.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.shape[1] > 1:
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, 64, scale, initial_state, output_final_state)
    state = initial_state
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    in_place = update_state and initial_state is not None
    o, state = recurrent_step(*(t[:, 0].float() for t in (q, k, v, g, beta)), state.float(), scale, in_place)
    return o[:, None], state if output_final_state else None


INFERENCE_SEGMENT = 256  # tokens per piece of a chunked forward without autograd (rounded to whole chunks)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None,
                                 output_final_state=False):
    """The chunked (WY) gated delta rule in plain torch, float32; same maths as fla's
    `naive_chunk_gated_delta_rule`, with its 64-step Python loop for the in-chunk inverse replaced by one
    triangular solve (about 2x less GDN time on CPU). Shapes as `gated_delta_rule_torch`.

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
    """`chunk_gated_delta_rule_torch` over the whole sequence at once. Within a chunk, with G the cumulative log
    decay, the corrected values U = (I + A)^-1 (beta V - beta exp(G) K S) come from one unit lower-triangular solve
    (A_ij = beta_i exp(G_i - G_j) k_i.k_j for i > j); the output is exp(G) Q S + (Q K^T * decay, causal) U and the
    state moves on as exp(G_last) S + (exp(G_last - G) K)^T U."""
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


def padding_mask(attention_mask, length: int):
    """The 2D padding mask ([B, length], 1 = token) of a call's last `length` positions, the GDN layers'
    `linear_attention_mask`, or None when nothing is padded (or the mask is not 2D)."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    mask = attention_mask[:, -length:]
    return None if bool(mask.all()) else mask


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
    """Gated DeltaNet token mixer with fla's parameter names (`GatedDeltaNet(expand_v=1, use_short_conv=False,
    use_gate=True)`) and init of A_log and dt_bias; drop-in for a decoder layer's `self_attn`. The delta rule runs in
    torch (`delta_rule`, which tcal's subclass dispatches to fla's kernel on CUDA)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, norm_eps: float = 1e-5,
                 layer_idx: int | None = None):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.layer_idx = layer_idx
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

    def delta_rule(self, q, k, v, g, beta, initial_state=None, output_final_state=False, update_state=False):
        """The recurrence on the layer's inputs (`gated_delta_rule_torch`: its shapes and arguments)."""
        return gated_delta_rule_torch(q, k, v, g, beta, initial_state, output_final_state, update_state)

    def mix(self, x: torch.Tensor, mask: torch.Tensor | None = None, initial_state=None,
            output_final_state: bool = False, update_state: bool = False):
        """The recurrence's output o [B, T, H, dh] (float32, before the gated norm) and the final state
        (`update_state`: see `gated_delta_rule_torch`)."""
        q, k, v = self.qkv(x)
        g, beta = self.gates(x, mask)
        return self.delta_rule(q, k, v, g, beta, initial_state, output_final_state, update_state)

    def project_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y = Wo(RMSNorm(o) * silu(Wg x)), per head."""
        y = self.o_norm(o, self._heads(self.g_proj(x)))
        return self.o_proj(y.flatten(-2).to(x.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, cache=None,
                linear_attention_mask: torch.Tensor | None = None, **kwargs):
        """Decoder-layer interface: `attention_mask` (the softmax layers' 4D mask) is ignored; padding comes
        as the 2D `linear_attention_mask` ([B, T], 1 = token) trimmed to this call's positions (`padding_mask`)."""
        cached = _cached_state(cache, self.layer_idx) if cache is not None else None
        # Without autograd a decoding step updates the cached state in place instead of copying a new one into it.
        o, state = self.mix(hidden_states, linear_attention_mask, cached, output_final_state=cache is not None,
                            update_state=not torch.is_grad_enabled())
        if cache is not None and state is not cached:
            cache.update_recurrent_state(state, self.layer_idx)
        return self.project_out(o, hidden_states), None
