"""What autograd keeps for backward, traced through the real modules on the meta device (or on real tensors), with
the attention and delta-rule kernels standing in by what the fused kernels keep."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

FLA_CHUNK = 64  # fla's chunk size: its WY matrix A is [B, T, H, 64]
PLAN_ATTENTION = "tcal_plan_flash"  # the attention implementation a traced student's kept layers run


class _FlashAttention(torch.autograd.Function):
    """What SDPA's flash kernels keep for backward, on the CPU and on CUDA: q, k and v (KV heads not expanded), the
    output (laid out [B, T, H, d], so the caller's transpose back needs no copy), and a float32 log-sum-exp per
    query. Stands in for SDPA on the meta device, where the math fallback would keep the [T, T] weights."""

    @staticmethod
    def forward(ctx, query, key, value):
        batch, heads, length, _ = query.shape
        out = query.new_empty(batch, length, heads, value.shape[-1]).transpose(1, 2)
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the plan never runs backward
        raise NotImplementedError


def _flash_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface around `_FlashAttention` ([B, H, T, D] in, [B, T, H, D] out, as its SDPA
    path returns): what a kept layer keeps for backward under flash attention."""
    return _FlashAttention.apply(query, key, value).transpose(1, 2).contiguous(), None


class _FlaChunk(torch.autograd.Function):
    """What fla's chunked gated delta rule (`chunk_gated_delta_rule`, CUDA) keeps for backward: q, k, v, beta, the
    chunk-local cumulative decay and the WY matrix A [B, T, H, 64]; it recomputes the rest."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        B, T, H, _ = q.shape
        ctx.save_for_backward(q, k, v, beta, g.new_empty(g.shape, dtype=torch.float32),
                              k.new_empty(B, T, H, FLA_CHUNK))
        return q.new_empty(B, T, H, v.shape[-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover
        raise NotImplementedError


def _fla_chunk(q, k, v, g, beta, initial_state=None, output_final_state=False):
    return _FlaChunk.apply(q, k, v, g, beta), None


@contextlib.contextmanager
def kernels_of(device_type: str, on_meta: bool, config=None):
    """On the meta device, the fused kernels of `device_type` ("cpu" or "cuda") stand in: flash attention in the
    kept layers of the decoder whose config is `config` (transformers' attention interface, `PLAN_ATTENTION`), and
    on CUDA fla's chunk kernel for the delta rule (`tcal.student.gdn.traced_kernel`; the CPU path is plain torch and
    is traced as it is). Real tensors run the real kernels."""
    from transformers import AttentionInterface

    from tcal.student.gdn import traced_kernel

    with contextlib.ExitStack() as stack:
        if on_meta and config is not None:
            AttentionInterface.register(PLAN_ATTENTION, _flash_attention)
            before = config._attn_implementation
            config._attn_implementation = PLAN_ATTENTION
            stack.callback(setattr, config, "_attn_implementation", before)
        if on_meta and device_type == "cuda":
            stack.enter_context(traced_kernel(_fla_chunk))
        yield


class SavedTensors:
    """The storages autograd keeps for backward while recording and still holds when the block ends (the caller
    keeps the block's outputs alive: a branch whose output is dropped frees what it saved), each counted once,
    split by whether they were first saved inside `inner` (a submodule, e.g. a GDN mixer) or elsewhere. `skip`
    storages (parameters, shared rotary tables) are not counted."""

    def __init__(self, skip=(), inner: torch.nn.Module | None = None):
        self.skip = {t.untyped_storage()._cdata for t in skip}
        self._seen: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self._depth = 0
        self.inside_bytes = self.outside_bytes = 0
        self._handles = [] if inner is None else [
            inner.register_forward_pre_hook(lambda *_: self._enter(1)),
            inner.register_forward_hook(lambda *_: self._enter(-1)),
        ]

    def _enter(self, step: int) -> None:
        self._depth += step

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        held = self._seen.get(key)
        if key not in self.skip and (held is None or held[0].expired()):  # an expired key's address was reused
            self._seen[key] = (StorageWeakRef(storage), storage.nbytes(), self._depth > 0)
        return tensor.detach()  # the tensor itself would tie a saved output to its own node in a reference cycle

    @contextlib.contextmanager
    def recording(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
            alive = [(size, inside) for ref, size, inside in self._seen.values() if not ref.expired()]
            self.inside_bytes = sum(size for size, inside in alive if inside)
            self.outside_bytes = sum(size for size, inside in alive if not inside)
        finally:
            for handle in self._handles:
                handle.remove()


def kept_by(run, skip, inner=None, device_type: str = "cpu", on_meta: bool = False, config=None) -> SavedTensors:
    """What `run()` leaves saved for backward under `kernels_of(device_type, on_meta, config)`, its output held
    until the count is taken."""
    with kernels_of(device_type, on_meta, config), SavedTensors(skip, inner).recording() as saved:
        out = run()
    del out
    return saved


@dataclass
class LayerTrace:
    """Bytes one decoder layer keeps for backward at a batch: a kept softmax layer, and a GDN layer split into its
    mixer (the GDN itself, input included) and the rest (norms, MLP, residual stream)."""

    kept: int
    gdn_mixer: int
    gdn_rest: int
    final_norm: int
    hidden: int  # one [B, T, D] hidden state in the compute dtype (a layer's input, or a mixer's)
    mlp_backward: int = 0  # the MLP backward's gradients of its three [B, T, intermediate] tensors


def trace_decoder(student, batch: int, seq_len: int, device_type: str) -> LayerTrace:
    """Trace one kept and one GDN decoder layer of `student` (meta device, or real tensors) in training mode."""
    model = student.get_decoder()
    config = student.config
    first = next(student.parameters())
    x = torch.randn(batch, seq_len, config.hidden_size, dtype=first.dtype, device=first.device, requires_grad=True)
    position_embeddings = model.rotary_emb(x, torch.arange(seq_len, device=first.device)[None])
    shared = [*student.parameters(), *position_embeddings]

    def layer_bytes(index: int | None) -> SavedTensors:
        if index is None:
            return SavedTensors()
        layer = model.layers[index]
        return kept_by(lambda: layer(x, attention_mask=None, position_embeddings=position_embeddings, use_cache=False),
                       shared, layer.self_attn if index in config.gdn_layers else None, device_type, x.is_meta,
                       model.config)

    kept = layer_bytes(config.keep_layers[0])
    gdn = layer_bytes(config.gdn_layers[0] if config.gdn_layers else None)
    norm = kept_by(lambda: model.norm(x), shared)
    intermediate = model.layers[0].mlp.down_proj.in_features
    return LayerTrace(kept.outside_bytes, gdn.inside_bytes, gdn.outside_bytes, norm.outside_bytes,
                      x.numel() * x.element_size(), 3 * batch * seq_len * intermediate * x.element_size())


def trace_alignment(gdn, batch: int, seq_len: int, input_dtype: torch.dtype, device_type: str) -> tuple[int, int]:
    """(bytes inside the mixer, bytes outside it) kept for backward by Phase 2's / Stage 1's alignment loss of one
    GDN (meta device, or real tensors) on teacher-forced inputs of `input_dtype` (the inputs are not counted)."""
    from tcal.student.alignment import alignment_loss

    device = next(gdn.parameters()).device
    x, target = (torch.randn(batch, seq_len, gdn.hidden_size, dtype=input_dtype, device=device) for _ in range(2))
    saved = kept_by(lambda: alignment_loss(gdn, x, target), [*gdn.parameters(), x, target], gdn, device_type,
                    x.is_meta)
    return saved.inside_bytes, saved.outside_bytes
