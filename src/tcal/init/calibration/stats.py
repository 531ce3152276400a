"""Streaming teacher attention statistics for Phase 1 (docs/method.md, section "Streaming teacher statistics").

One teacher forward runs under a custom attention function that computes softmax attention
blockwise (query blocks against their causal keys), so neither a [B, H, T, T] nor a
[layers, heads, T, T] tensor ever exists, while it accumulates per-head mean attention distance
and entropy and keeps the pre-o_proj context. Forward hooks on `self_attn` keep the attention
inputs and outputs that Phase 2 regresses on.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "tcal_stats"


@dataclass
class LayerStats:
    mean_distance: torch.Tensor  # [Hq]
    mean_entropy: torch.Tensor  # [Hq]
    inputs: torch.Tensor | None  # [B, T, D]
    context: torch.Tensor | None  # [B, T, Hq, dh]
    attn_output: torch.Tensor | None  # [B, T, D]


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, Hkv, S, d] -> [B, Hq, S, d]; query head i reads KV head i // (Hq / Hkv)."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _block_scores(q_blk, k, scaling, mask, q_pos, k_pos):
    """Float32 scores of one query block, with the causal rule and the model's mask applied (in place)."""
    scores = torch.matmul(q_blk, k.transpose(-1, -2)).float().mul_(scaling)
    neg = torch.finfo(scores.dtype).min
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], neg)
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        # min, not -inf: a fully masked (padding) row stays finite instead of turning into NaN
        return scores.masked_fill_(~mask, neg)
    return scores.add_(mask)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    block_size: int = 256,
    query_mask: torch.Tensor | None = None,
    stats: bool = True,
):
    """Causal softmax attention over query blocks, with attention distance and entropy sums.

    q: [B, Hq, T, d]; k, v: [B, Hkv, S, d] with S >= T (queries are the last T positions).
    mask: None, or a 4D [B, 1|Hq, T, S] bool (True = attend) or additive float mask.
    query_mask: [B, T], nonzero for the queries the statistics average over (None = all).
    Returns (out [B, T, Hq, d] like transformers' attention functions, dist_sum [Hq],
    entropy_sum [Hq], count): sums over valid queries, float64 on q's device.
    """
    bsz, n_heads, t_len, _ = q.shape
    s_len = k.shape[2]
    offset = s_len - t_len
    k, v = _expand_kv(k, n_heads), _expand_kv(v, n_heads)
    valid = (
        torch.ones(bsz, t_len, dtype=torch.float64, device=q.device)
        if query_mask is None
        else query_mask.to(device=q.device, dtype=torch.float64)
    )
    out = torch.empty(bsz, t_len, n_heads, v.shape[-1], dtype=v.dtype, device=q.device)
    dist_sum = torch.zeros(n_heads, dtype=torch.float64, device=q.device)
    ent_sum = torch.zeros(n_heads, dtype=torch.float64, device=q.device)
    for start in range(0, t_len, block_size):
        stop = min(start + block_size, t_len)
        k_end = stop + offset  # causal: the block never sees keys after its last query
        q_pos = torch.arange(start + offset, k_end, device=q.device)
        k_pos = torch.arange(k_end, device=q.device)
        blk_mask = None if mask is None else mask[:, :, start:stop, :k_end]
        scores = _block_scores(q[:, :, start:stop], k[:, :, :k_end], scaling, blk_mask, q_pos, k_pos)
        probs = torch.softmax(scores, dim=-1)
        del scores
        out[:, start:stop] = torch.matmul(probs.to(v.dtype), v[:, :, :k_end]).transpose(1, 2)
        if stats:
            w = valid[:, None, start:stop]  # [B, 1, blk]
            dist = (q_pos[:, None] - k_pos[None, :]).float().clamp(min=0.5)
            row_dist = (probs * dist).sum(-1)  # [B, Hq, blk]
            row_ent = -torch.special.xlogy(probs, probs).sum(-1)
            dist_sum += (row_dist.double() * w).sum((0, 2))
            ent_sum += (row_ent.double() * w).sum((0, 2))
        del probs
    return out, dist_sum, ent_sum, valid.sum()


class _Collector:
    """Per-call state the registered attention function writes into."""

    def __init__(self, layers, block_size, keep_tensors, query_mask, progress):
        self.layers = set(layers)
        self.block_size = block_size
        self.keep_tensors = keep_tensors
        self.query_mask = query_mask
        self.progress = progress
        self.sums: dict[int, tuple] = {}
        self.context: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.attn_output: dict[int, torch.Tensor] = {}

    def add(self, layer, dist_sum, ent_sum, count, out):
        self.sums[layer] = (dist_sum.cpu(), ent_sum.cpu(), float(count))
        if self.keep_tensors:
            self.context[layer] = out.detach().float().cpu()
        if self.progress:
            print(f"[tcal stats] layer {layer} done", file=sys.stderr, flush=True)

    def result(self, layer) -> LayerStats:
        dist_sum, ent_sum, count = self.sums[layer]
        count = max(count, 1.0)
        return LayerStats(
            mean_distance=(dist_sum / count).float().clamp(min=0.5),
            mean_entropy=(ent_sum / count).float(),
            inputs=self.inputs.get(layer),
            context=self.context.get(layer),
            attn_output=self.attn_output.get(layer),
        )


_ACTIVE: _Collector | None = None


def _stats_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: normal output, statistics as a side effect (no dropout)."""
    col = _ACTIVE
    layer = getattr(module, "layer_idx", None)
    record = col is not None and layer in col.layers
    query_mask = None
    if record and col.query_mask is not None and col.query_mask.shape[1] == query.shape[2]:
        query_mask = col.query_mask
    out, dist_sum, ent_sum, count = blockwise_attention(
        query,
        key,
        value,
        query.shape[-1] ** -0.5 if scaling is None else scaling,
        mask=attention_mask,
        block_size=col.block_size if col is not None else 256,
        query_mask=query_mask,
        stats=record,
    )
    if record:
        col.add(layer, dist_sum, ent_sum, count, out)
    return out, None


def register() -> str:
    """Register the attention function and its mask builder (idempotent); returns the name.

    The mask builder matters: for a name unknown to AttentionMaskInterface, create_causal_mask
    returns None, silently dropping the padding mask.
    """
    AttentionInterface.register(ATTN_NAME, _stats_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


@contextlib.contextmanager
def attn_implementation(model: PreTrainedModel, name: str):
    """Temporarily switch the attention implementation of `model` and all its sub-models."""
    configs = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
    saved = {key: config._attn_implementation_internal for key, config in configs.items()}
    try:
        model.set_attn_implementation(name)
        yield model
    finally:
        for key, config in configs.items():
            config._attn_implementation_internal = saved[key]


def _capture_hook(col: _Collector, layer: int):
    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        col.inputs[layer] = hidden.detach().float().cpu()
        col.attn_output[layer] = output[0].detach().float().cpu()

    return hook


@torch.no_grad()
def collect_teacher_stats(
    teacher,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layers=None,
    block_size: int = 256,
    keep_tensors: bool = True,
    progress: bool = False,
) -> dict[int, LayerStats]:
    """One teacher forward (no grad) through the base model (no lm_head logits); layers=None means all.

    Statistics average over the queries where the 2D attention_mask is 1. Tensors are float32 on CPU;
    keep_tensors=False stores only the statistics.
    """
    global _ACTIVE
    base = teacher.base_model
    decoder_layers = base.layers
    layers = list(range(len(decoder_layers))) if layers is None else [int(i) for i in layers]
    device = next(teacher.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    col = _Collector(layers, block_size, keep_tensors, attention_mask, progress)
    handles = []
    was_training = teacher.training
    register()
    try:
        teacher.eval()
        if keep_tensors:
            for i in layers:
                attn = decoder_layers[i].self_attn
                handles.append(attn.register_forward_hook(_capture_hook(col, i), with_kwargs=True))
        _ACTIVE = col
        with attn_implementation(teacher, ATTN_NAME):
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        _ACTIVE = None
        for h in handles:
            h.remove()
        teacher.train(was_training)
    missing = [i for i in layers if i not in col.sums]
    if missing:
        raise RuntimeError(f"attention of layers {missing} never ran through {ATTN_NAME}")
    return {i: col.result(i) for i in layers}
