"""`tcal-plan [overrides] [--json|--markdown|--slurm-env] [--device-gb 80] [--headroom-gb 8]`: what a run holds per
device and per host, from its configs alone.

The overrides are those of `tcal` (an experiment, a teacher, a trainer, `stage.*`, ...). The teacher is built from
its architecture on the meta device (`teachers.load.teacher_architecture`: a paper teacher's shipped config.json or
a local folder's; no weights, no data, no GPU), then the student with the retention policy's layers converted.

For calibration, Stage 1 (align) and Stage 2 (distill) the plan adds up, per device (GB = 2^30 bytes):

- weights, gradients and optimizer (`Strategy.state_bytes`): under `*-true` everything in the compute dtype (AdamW's
  two moments too); under `*-mixed` the student is float32 (`pipeline` casts it): 4-byte weights and gradients,
  8 bytes of moments per trainable parameter;
- autocast copies: under `*-mixed`, the compute-dtype copy of each trainable Linear weight that autograd keeps for
  backward (Lightning's autocast caches none), by checkpointing setting (`autocast_copies`);
- teacher: frozen, in `teacher.dtype` (Stage 2: `stage.teacher_dtype` when set), whole on every device;
- buffers: DDP's bucket copy of the gradients;
- gathered units: under FSDP2 (`trainer.strategy=fsdp`: each decoder layer and GDN mixer a unit), the root's
  parameters and two layer units with their unsharded gradients (`fsdp_gathered`);
- activations: what autograd keeps for backward at the configured per-rank batch (`stage.batch_size` x
  `stage.seq_len`), traced through the real modules on the meta device, with the attention and delta-rule kernels
  standing in by what the flash (CPU, CUDA) and fla (CUDA) kernels keep, plus the backward's working set; with and
  without checkpointing. Under autocast the float32 student is traced (an upper bound: matmul outputs are in the
  compute dtype there, while the residual stream, the norms and the GDN's recurrence are float32);
- kl: the fused KL of Stage 2 (`training/kd.py`) at its peak.

Strategies (`trainer.strategy`, the same for both stages): one device and `ddp` replicate everything; `fsdp` shards
the weights, gradients and optimizer states over the ranks, and under `bf16-mixed` gathers parameters in bfloat16
(no autocast copies then) and reduce-scatters gradients from float32 (`tcal.training.stages.fsdp_policy`). The
peak is the sum of all of them, at the start of a backward (the previous step's gradients counted too: Lightning
zeroes them between the forward and the backward). A stage fits when its peak plus `--headroom-gb` is at most
`--device-gb`. It counts allocated tensors: not CUDA's context, nor free memory an allocator keeps (glibc's heap on
the CPU, PyTorch's cache on CUDA); the headroom is for those. The host section is what a node's ranks hold in host
memory (`host_plan`) and what a SLURM job asks for it; `--slurm-env` prints it as the variables
conf/hydra/launcher/slurm_gpu.yaml reads.

Three moments are planned (`moments`), each fitting by the same rule: the training step (the largest stage peak
above), the stage-end gather (`gather_moment`: under FSDP the full student gathered on every rank next to its
shards and the teacher, once `tcal.training.run.release_stage` has freed optimizer states and gradients) and the
final evaluation (`final_eval_moment`: teacher, trained student and the largest working set of perplexity, the
harness and RULER, whose logits are bounded by a chunk of positions). `fits` holds when every stage and every
moment fits. `hours` predicts the training stages' hours on 8 x H100 and 8 x A100 from a FLOPs model
(`FLOPS_FORMULA`, with the peak bf16 throughput and the utilisation `GPU_RATES` assume: H100 989 TFLOPs at MFU 0.35,
A100 312 TFLOPs at MFU 0.45; planning constants, not measurements). `--moments-markdown` prints one row per plan
of the three moments and the hours.
`make bench ARGS=plan` checks the plan against a measured Stage 2, `make bench ARGS=plan_activations` its activation
model at a paper width. A configuration error prints one line and exits with code 2, as `tcal` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tcal.errors import ConfigError

GB = 2**30
# [chunk, vocab] float32 tensors alive at once in one chunk of the fused KL (kd.py; `make bench ARGS=kl_memory`)
KL_CHUNK_TENSORS = 3
FLA_CHUNK = 64  # fla's chunk size: its WY matrix A is [B, T, H, 64]
DEFAULT_HEADROOM_GB = 8.0  # per device, for what the plan does not count (make_plan)
# Host memory of one rank's process besides its data (host_plan): 0.54 GB measured after importing torch,
# transformers, Lightning and tcal on the CPU; the rest an allowance for CUDA's host-side context and pinned buffers
PROCESS_HOST_GB = 4
HOST_CPUS_PER_RANK = 4  # a rank's loop (data loading runs in process), NCCL's threads, torch's host-side threads


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Precision:
    """Lightning's `trainer.precision` as the plan counts it: the compute dtype, and whether it is mixed (`*-mixed`:
    float32 trainable state, compute in the reduced dtype)."""

    name: str
    compute: torch.dtype
    mixed: bool

    ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true",
               "transformer-engine": "bf16-mixed", "transformer-engine-float16": "16-mixed"}
    DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}

    @classmethod
    def parse(cls, name) -> "Precision":
        bits, _, mode = cls.ALIASES.get(str(name), str(name)).partition("-")
        return cls(str(name), cls.DTYPES[bits], mode == "mixed")

    @property
    def compute_bytes(self) -> int:
        return dtype_bytes(self.compute)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the student's weights and gradients, per trainable parameter of AdamW's states, and
    per trainable Linear parameter of autocast's compute-dtype copies (0 without autocast)."""

    weight: int
    gradient: int
    optimizer: int
    autocast_copy: int
    note: str


@dataclass(frozen=True)
class Strategy:
    """What a training strategy spreads over the ranks (see the module docstring)."""

    name: str
    shards_optimizer: bool = False
    shards_gradients: bool = False
    shards_weights: bool = False
    per_layer_units: bool = False  # FSDP2: each decoder layer and GDN mixer a unit, gathered one at a time
    note: str = ""

    @classmethod
    def parse(cls, name) -> "Strategy":
        name = str(name)
        if name.startswith("fsdp") or name == "model_parallel":
            return cls(name, True, True, True, per_layer_units=True,
                       note="FSDP2: float32 weights, gradients and AdamW states sharded over the ranks; the root "
                            "(embeddings, final norm, head) gathered from forward to backward, and two layer units "
                            "(the running one and the next) with their unsharded gradients")
        return cls(name)

    def state_bytes(self, precision: Precision) -> StateBytes:
        """`*-true`: everything in the compute dtype (AdamW's moments too). `*-mixed` (one device, DDP and FSDP
        alike): the student is float32 (`pipeline` casts it) and autocast computes in the reduced dtype: float32
        gradients and moments, and a compute-dtype copy of each trainable Linear weight that autocast makes for the
        forward and autograd keeps for the backward."""
        c = precision.compute_bytes
        if not precision.mixed:
            return StateBytes(c, c, 2 * c, 0, f"{precision.name}: weights, gradients and AdamW moments in {c} bytes")
        return StateBytes(4, 4, 8, c, f"{precision.name} (autocast): float32 weights, gradients and moments, and a "
                                      f"compute-dtype copy of every trainable Linear weight during the forward")

    def buffers(self, trainable: int, state: StateBytes, world: int) -> int:
        """Communication buffers: DDP's bucket copy of the gradients (none counted on one device or under FSDP)."""
        if self.name.startswith("ddp") or (self.name == "auto" and world > 1):
            return trainable * state.gradient
        return 0


# ------------------------------------------------------------------------------------------------ tracing


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


PLAN_ATTENTION = "tcal_plan_flash"  # the attention implementation a traced student's kept layers run


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
    params = list(student.parameters())
    x = torch.randn(batch, seq_len, config.hidden_size, dtype=first.dtype, device=first.device, requires_grad=True)
    position_embeddings = model.rotary_emb(x, torch.arange(seq_len, device=first.device)[None])
    shared = [*params, *position_embeddings]

    def layer_bytes(index: int | None) -> SavedTensors:
        if index is None:
            return SavedTensors()
        layer = model.layers[index]
        inner = layer.self_attn if index in config.gdn_layers else None
        with kernels_of(device_type, x.is_meta, model.config), SavedTensors(shared, inner).recording() as saved:
            out = layer(x, attention_mask=None, position_embeddings=position_embeddings, use_cache=False)
        del out
        return saved

    kept = layer_bytes(config.keep_layers[0])
    gdn = layer_bytes(config.gdn_layers[0] if config.gdn_layers else None)
    with SavedTensors(shared).recording() as norm:
        out = model.norm(x)
    del out
    intermediate = model.layers[0].mlp.down_proj.in_features
    return LayerTrace(kept.outside_bytes, gdn.inside_bytes, gdn.outside_bytes, norm.outside_bytes,
                      x.numel() * x.element_size(), 3 * batch * seq_len * intermediate * x.element_size())


def trace_alignment(gdn, batch: int, seq_len: int, input_dtype: torch.dtype, device_type: str) -> tuple[int, int]:
    """(bytes inside the mixer, bytes outside it) kept for backward by Phase 2's / Stage 1's alignment loss of one
    GDN (meta device, or real tensors) on teacher-forced inputs of `input_dtype` (the inputs are not counted)."""
    from tcal.student.alignment import alignment_loss

    device = next(gdn.parameters()).device
    x, target = (torch.randn(batch, seq_len, gdn.hidden_size, dtype=input_dtype, device=device) for _ in range(2))
    with kernels_of(device_type, x.is_meta), SavedTensors([*gdn.parameters(), x, target], gdn).recording() as saved:
        loss = alignment_loss(gdn, x, target)
    del loss
    return saved.inside_bytes, saved.outside_bytes


# ------------------------------------------------------------------------------------------------ the plan


@dataclass
class Model:
    """The teacher's and the student's shapes (meta device) and the facts the plan reads from them."""

    teacher_config: object
    teacher_params: int
    student: torch.nn.Module
    student_params: int
    keep_layers: list[int]
    gdn_params: int  # all GDN mixers together
    teacher: torch.nn.Module | None = None  # on the meta device

    @property
    def hidden_size(self) -> int:
        return self.teacher_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.teacher_config.vocab_size


def build_model(settings, keep_layers: list[int]) -> Model:
    from tcal.student.convert import meta_student
    from tcal.teachers.load import meta_model, parameter_count, teacher_architecture

    config = teacher_architecture(settings.teacher, settings.paths.cache_dir)
    teacher = meta_model(config)
    student = meta_student(config, keep_layers)
    gdn = sum(p.numel() for i in student.config.gdn_layers for p in student.gdn(i).parameters())
    return Model(config, parameter_count(teacher), student, parameter_count(student), keep_layers, gdn, teacher)


def retention_plan(settings, num_layers: int) -> dict:
    """The kept layers: computed for `uniform` and `explicit`; for scored policies only their count is known
    before the real teacher is scored (the plan counts them at uniform positions: every layer has the same size)."""
    ret = settings.retention
    keep = ret.planned_keep(num_layers)
    plan = {"policy": ret.name, "setting": ret.keep_setting(), "kept": ret.kept(num_layers), "keep_layers": keep,
            "scored": keep is None}
    if keep is None:
        plan["note"] = f"{ret.name} chooses the {plan['kept']} kept layers by scoring the real teacher"
    return plan


@dataclass
class StageMemory:
    """One stage's per-device bytes; `activations` maps each checkpointing setting to its bytes."""

    weights: int
    gradients: int
    optimizer: int
    teacher: int
    buffers: int
    activations: dict[str, int]
    checkpointing: str  # the configured setting: none, checkpoint_mixers, activation_checkpointing
    kl: int = 0
    autocast: dict[str, int] = field(default_factory=dict)  # autocast's weight copies kept, by checkpointing
    gathered: int = 0  # FSDP: unsharded units (weights and their gradients) besides the shards
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """Everything at the start of a backward (the activations' peak), the previous step's gradients included:
        Lightning zeroes them between the forward and the backward, so they are held through the forward."""
        return (self.weights + self.gradients + self.optimizer + self.teacher + self.buffers
                + self.activations[self.checkpointing] + self.kl + self.autocast.get(self.checkpointing, 0)
                + self.gathered)

    def fits(self, device_gb: float, headroom_gb: float) -> bool:
        return self.peak + headroom_gb * GB <= device_gb * GB

    def as_dict(self, device_gb: float, headroom_gb: float) -> dict:
        gb = lambda b: round(b / GB, 2)  # noqa: E731
        return {**self.settings, "weights_gb": gb(self.weights), "gradients_gb": gb(self.gradients),
                "optimizer_gb": gb(self.optimizer), "teacher_gb": gb(self.teacher), "buffers_gb": gb(self.buffers),
                "autocast_gb": gb(self.autocast.get(self.checkpointing, 0)), "gathered_gb": gb(self.gathered),
                "activations_gb": gb(self.activations[self.checkpointing]), "checkpointing": self.checkpointing,
                "activations_gb_by_checkpointing": {k: gb(v) for k, v in self.activations.items()},
                "kl_gb": gb(self.kl), "peak_gb": gb(self.peak),
                "free_gb": round(device_gb - self.peak / GB, 2), "fits": self.fits(device_gb, headroom_gb),
                "notes": self.notes}


def checkpointing_of(node) -> str:
    if node.activation_checkpointing:
        return "activation_checkpointing"
    return "checkpoint_mixers" if node.checkpoint_mixers else "none"


def decoder_activations(trace: LayerTrace, n_kept: int, n_gdn: int) -> dict[str, int]:
    """Stage 2's student activations at their peak, the start of the backward, for each checkpointing setting:
    what the forward left for backward, plus the backward's working set. A checkpointed mixer keeps only its input
    and recomputes the rest during backward (one mixer at a time, once its layer's MLP and norms have been freed);
    a checkpointed decoder layer keeps only its input and recomputes one whole layer at a time. The working set is
    the last layer's MLP backward (its gradients of three [B, T, intermediate] tensors), on top of the recomputed
    layer under layer checkpointing (`make bench ARGS=plan_activations` measures all three)."""
    gdn_plain = trace.gdn_mixer + trace.gdn_rest
    gdn_mixers = trace.hidden + trace.gdn_rest
    mixer_recompute = (trace.gdn_mixer - trace.hidden - trace.gdn_rest) if n_gdn else 0
    none = n_kept * trace.kept + n_gdn * gdn_plain + trace.final_norm + trace.mlp_backward
    mixers = (n_kept * trace.kept + n_gdn * gdn_mixers + trace.final_norm
              + max(trace.mlp_backward, mixer_recompute))
    recompute = max(trace.kept, gdn_plain if n_gdn else 0)
    layers = (n_kept + n_gdn) * trace.hidden + trace.final_norm + recompute + trace.mlp_backward
    return {"none": none, "checkpoint_mixers": mixers, "activation_checkpointing": layers}


def kl_bytes(tokens: int, hidden: int, vocab: int, chunk: int, student_dtype, teacher_dtype,
             compute_dtype=None, device_type: str = "cuda", head_dtype=None) -> int:
    """The fused KL's peak (`training/kd.py`): the float32 gradient accumulator of the student head [V, D], both
    models' final hidden states with their row copies and the float32 gradient of the student's, and
    KL_CHUNK_TENSORS [chunk, V] float32 tensors of one chunk. Under autocast (`compute_dtype`) a head not already
    in the compute dtype is copied once for the call: the student head's copy is counted with the autocast copies
    (`autocast_copies`), the teacher head's here; off CUDA each chunk's head-gradient product is a [V, D] tensor in
    the compute dtype besides the accumulator (CUDA's addmm adds into it in float32 directly). A head in a reduced
    `head_dtype` under autocast (FSDP's bfloat16 gathered head) gets its float32 accumulated gradient back as a copy
    in that dtype once the chunks are done: the larger of that copy and a chunk's tensors counts."""
    s, t = dtype_bytes(student_dtype), dtype_bytes(teacher_dtype)
    hidden_states = tokens * hidden * (2 * s + 2 * t + 4)
    copies = 0
    if compute_dtype is not None and compute_dtype != teacher_dtype:
        copies += vocab * hidden * dtype_bytes(compute_dtype)
    if compute_dtype is not None and device_type != "cuda":
        copies += vocab * hidden * dtype_bytes(compute_dtype)
    chunks = KL_CHUNK_TENSORS * min(chunk, tokens) * vocab * 4 + copies
    returned = vocab * hidden * dtype_bytes(head_dtype) if compute_dtype is not None and head_dtype else 0
    return vocab * hidden * 4 + hidden_states + max(chunks, returned)


def linear_params(modules) -> int:
    """Weights and biases of the nn.Linear modules in `modules` that train (what autocast casts)."""
    return sum(p.numel() for m in modules if isinstance(m, torch.nn.Linear)
               for p in m.parameters(recurse=False) if p.requires_grad)


def autocast_copies(student, kind: str) -> dict[str, int]:
    """Parameters whose compute-dtype copy autocast makes and autograd keeps for backward at the end of a forward,
    by checkpointing setting. Lightning's autocast does not cache casts (`cache_enabled=False`), so a copy lives as
    long as the graph saves it: every trainable Linear without checkpointing; with checkpointed mixers, all but
    the mixers' plus one mixer's being recomputed; with checkpointed layers one layer's, plus the head's cast that
    the fused KL makes for each chunk. Stage 1 runs the GDN mixers alone."""
    mixers = [linear_params(student.gdn(i).modules()) for i in student.config.gdn_layers] or [0]
    if kind == "align":
        return {"none": sum(mixers), "checkpoint_mixers": max(mixers)}
    every = linear_params(student.modules())
    layers = [linear_params(layer.modules()) for layer in student.get_decoder().layers]
    return {"none": every, "checkpoint_mixers": every - sum(mixers) + max(mixers),
            "activation_checkpointing": max(layers) + linear_params([student.lm_head])}


def fsdp_gathered(student, kind: str, state: StateBytes, gathered_bytes: int | None = None) -> int:
    """What FSDP2 holds unsharded besides the shards at the end of a forward and the backward's first units: in
    Stage 2 the root's parameters (everything outside the decoder layers: embeddings, final norm, head; the root is
    not resharded after its forward; the head's gradient is the fused KL's, counted there) and two decoder layers
    (the running unit and the prefetched one) with their unsharded gradients; in Stage 1 (the GDN mixers run on
    their own) two mixers with their gradients. `gathered_bytes`: the bytes of a gathered parameter and of its
    unsharded gradient under a mixed-precision policy (`tcal.training.stages.fsdp_policy`: bfloat16), whose
    gradients are then reduce-scattered from a float32 copy of one unit; None: parameters in their own dtype."""
    if gathered_bytes is None:
        weight, unit_bytes, reduce = state.weight, state.weight + state.gradient, 0
    else:
        weight, unit_bytes, reduce = gathered_bytes, 2 * gathered_bytes, 4
    if kind == "distill":
        root = sum(p.numel() for name, p in student.named_parameters() if not name.startswith("model.layers."))
        units = [sum(p.numel() for p in layer.parameters()) for layer in student.get_decoder().layers]
        return root * weight + 2 * max(units) * unit_bytes + max(units) * reduce
    units = [sum(p.numel() for p in student.gdn(i).parameters()) for i in student.config.gdn_layers] or [0]
    return 2 * max(units) * unit_bytes + max(units) * reduce


def fsdp_param_dtype(strategy: Strategy, precision: Precision) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in (`tcal.training.stages.fsdp_policy`): bfloat16 under bf16-mixed, None
    (their own dtype) otherwise and under every other strategy."""
    if strategy.per_layer_units and precision.mixed and precision.compute == torch.bfloat16:
        return torch.bfloat16
    return None


def stage_memory(kind: str, node, settings, model: Model, world: int, device_type: str) -> StageMemory:
    """Per-device memory of Stage 1 (`align`) or Stage 2 (`distill`) under the run's trainer."""
    trainer = settings.trainer
    precision = Precision.parse(trainer.precision)
    strategy = Strategy.parse(trainer.strategy)
    state = strategy.state_bytes(precision)
    teacher_dtype_name = (node.teacher_dtype if kind == "distill" else None) or settings.teacher.dtype
    teacher_dtype = getattr(torch, str(teacher_dtype_name))
    # Under autocast the residual stream, the norms and the GDN's recurrence stay float32 and only matmul outputs
    # are in the compute dtype: tracing the float32 student bounds what autograd keeps from above.
    trace_dtype = torch.float32 if state.autocast_copy else precision.compute
    student = model.student.to(trace_dtype).train()
    trainable = model.student_params if kind == "distill" else model.gdn_params
    student.requires_grad_(kind == "distill")
    for i in student.config.gdn_layers:
        student.gdn(i).requires_grad_(True)
    batch, seq_len = int(node.batch_size), int(node.seq_len)
    n_gdn = len(student.config.gdn_layers)
    gathered_dtype = fsdp_param_dtype(strategy, precision)
    if kind == "distill":
        trace = trace_decoder(student, batch, seq_len, device_type)
        activations = decoder_activations(trace, len(student.config.keep_layers), n_gdn)
        kl = kl_bytes(batch * seq_len, model.hidden_size, model.vocab_size, int(node.kl_chunk_size),
                      trace_dtype, teacher_dtype, precision.compute if precision.mixed else None, device_type,
                      gathered_dtype)
    else:
        mixer, loss = trace_alignment(student.gdn(student.config.gdn_layers[0]), batch, seq_len, trace_dtype,
                                      device_type) if n_gdn else (0, 0)
        captured = 2 * n_gdn * batch * seq_len * model.hidden_size * dtype_bytes(teacher_dtype)
        activations = {"none": captured + n_gdn * (mixer + loss), "checkpoint_mixers": captured + n_gdn * loss + mixer}
        kl = 0
    steps = node.steps(world)
    notes = [n for n in (strategy.note, state.note) if n]
    if state.autocast_copy:
        notes.append("activations traced in float32 (an upper bound under autocast: matmul outputs are in the "
                     "compute dtype there)")
    checkpointing = checkpointing_of(node)
    autocast = {k: n * state.autocast_copy for k, n in autocast_copies(student, kind).items()}
    if gathered_dtype is not None:
        autocast = {k: 0 for k in autocast}
        notes.append("FSDP2 mixed precision: parameters gathered in bfloat16, so autocast makes none of the copies "
                     "above; gradients reduce-scattered from a float32 copy of one unit")
    if kind == "align":
        checkpointing = "checkpoint_mixers" if node.checkpoint_mixers else "none"
        notes.append("activations: the teacher's captured GDN inputs and attention outputs, and every GDN's "
                     "alignment loss (activation_checkpointing does not apply: the student's decoder does not run)")
    return StageMemory(
        weights=model.student_params * state.weight // (world if strategy.shards_weights else 1),
        gradients=trainable * state.gradient // (world if strategy.shards_gradients else 1),
        optimizer=trainable * state.optimizer // (world if strategy.shards_optimizer else 1),
        teacher=model.teacher_params * dtype_bytes(teacher_dtype),
        buffers=strategy.buffers(trainable, state, world),
        autocast=autocast,
        gathered=(fsdp_gathered(student, kind, state, dtype_bytes(gathered_dtype) if gathered_dtype else None)
                  if strategy.per_layer_units and world > 1 else 0),
        activations=activations, checkpointing=checkpointing, kl=kl, notes=notes,
        settings={"strategy": strategy.name, "precision": precision.name, "world_size": world,
                  "batch_per_rank": [batch, seq_len], "tokens_per_step": steps.tokens_per_step,
                  "steps": steps.total, "trainable_params": trainable,
                  "teacher_dtype": str(teacher_dtype_name)})


def fitted_together(calibration, work, device_type: str, world: int) -> int:
    """How many layers' Phase 2 fits share a device at once: one after another with `calibration.fit=sequential`,
    else `calibration.layers_per_fit` (by default all on a GPU, one on a CPU) of the layers whose statistics a
    rank holds together (its share of the converted layers, in groups of `work.layers_at_once`)."""
    from tcal.init.calibration.batched import layers_per_fit

    if calibration.fit == "sequential":
        return 1
    held = min(work.layers_at_once, -(-work.layers // world))
    return min(layers_per_fit(calibration.layers_per_fit, device_type) or held, held)


def calibration_memory(settings, model: Model, device_type: str, world: int = 1) -> StageMemory:
    """Per-device memory of the init: teacher and student in `teacher.dtype`, and the larger of the teacher's
    statistics forward (an estimate: one layer's MLP and residual tensors and the blockwise attention scores) and
    Phase 2 of the layers fitted together (`fitted_together`; each with its teacher-forced tensors on the device,
    trained in float32 with AdamW and a best-state copy, and its activations). The statistics are held in host memory (`host_gb`)."""
    from tcal.student.convert import meta_student

    config = model.teacher_config
    teacher_bytes = dtype_bytes(getattr(torch, str(settings.teacher.dtype)))
    gdn_layers = model.student.config.gdn_layers
    work = settings.init.calibration_work(settings.calibration, len(gdn_layers)) if gdn_layers else None
    host = forward = phase2 = 0
    if work is not None:
        D = model.hidden_size
        query_width = model.student.gdn(gdn_layers[0]).num_heads * model.student.gdn(gdn_layers[0]).head_dim
        host = work.stats_windows * work.seq_len * (2 * D + query_width) * 4 * work.layers_at_once
        tokens = work.forward_windows * work.seq_len
        forward = (tokens * (3 * config.intermediate_size + 4 * D) * teacher_bytes
                   + 2 * work.forward_windows * config.num_attention_heads
                   * min(int(settings.calibration.block_size), work.seq_len) * work.seq_len * 4)
    if work is not None and work.phase2:
        gdn = meta_student(config, model.keep_layers).gdn(gdn_layers[0]).train()
        mixer, loss = trace_alignment(gdn, work.step_windows, work.seq_len, torch.float32, device_type)
        layer_params = sum(p.numel() for p in gdn.parameters())
        phase2 = (2 * work.device_windows * work.seq_len * model.hidden_size * 4
                  + layer_params * (4 + 4 + 8 + 4) + mixer + loss) * fitted_together(settings.calibration, work,
                                                                                      device_type, world)
    memory = StageMemory(weights=model.student_params * teacher_bytes, gradients=0, optimizer=0,
                         teacher=model.teacher_params * teacher_bytes, buffers=0,
                         activations={"none": max(forward, phase2)}, checkpointing="none",
                         settings={"init": settings.init.name, "teacher_dtype": str(settings.teacher.dtype),
                                   "calibration_tokens": work.stats_windows * work.seq_len if work else 0,
                                   "host_gb": round(host / GB, 2)})
    memory.notes.append(f"activations: the larger of the teacher's statistics forward and Phase 2 of the "
                        f"{fitted_together(settings.calibration, work, device_type, world) if work else 1} layer(s) fitted "
                        f"together")
    if settings.retention.planned_keep(model.teacher_config.num_hidden_layers) is None:
        memory.notes.append(f"retention={settings.retention.name} first scores the layers on the real teacher (not "
                            f"planned)")
    return memory


# ------------------------------------------------------------------------------------------------ moments


@dataclass
class Moment:
    """What one device holds at one moment of a run outside the training step: each part's bytes, and what the
    moment is."""

    parts: dict[str, int]
    note: str
    settings: dict = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def fits(self, device_gb: float, headroom_gb: float) -> bool:
        return self.peak + headroom_gb * GB <= device_gb * GB

    def as_dict(self, device_gb: float, headroom_gb: float) -> dict:
        return {**self.settings, "parts_gb": {k: round(v / GB, 2) for k, v in self.parts.items()},
                "peak_gb": round(self.peak / GB, 2), "free_gb": round(device_gb - self.peak / GB, 2),
                "fits": self.fits(device_gb, headroom_gb), "note": self.note}


def trained_student_bytes(settings, state: StateBytes) -> int:
    """Bytes per parameter of the student after its stages: float32 under `-mixed` (cast before the first stage),
    the compute dtype under `-true`; without stages, the teacher's dtype it was built in."""
    if not settings.stage.stages():
        return dtype_bytes(getattr(torch, str(settings.teacher.dtype)))
    return state.weight


def gather_moment(settings, model: Model, world: int) -> Moment | None:
    """A stage's end (`tcal.training.run.train_stage`): `release_stage` has freed AdamW's states, the gradients and
    every gathered unit, and the stage's activations are gone with its last step. Under FSDP every rank then
    gathers the full student (`unsharded_student`: every parameter's full tensor on every rank, in its shards'
    dtype) while it still holds its shards, which the gather reads; the teacher stays, back in `teacher.dtype`.
    On one device and under DDP nothing is gathered: the student's own weights and the teacher. None without
    stages."""
    if not settings.stage.stages():
        return None
    precision, strategy = Precision.parse(settings.trainer.precision), Strategy.parse(settings.trainer.strategy)
    state = strategy.state_bytes(precision)
    teacher = model.teacher_params * dtype_bytes(getattr(torch, str(settings.teacher.dtype)))
    full = model.student_params * state.weight
    if strategy.shards_weights and world > 1:
        return Moment({"teacher": teacher, "weight_shards": full // world, "gathered_student": full},
                      f"FSDP stage end: the full student ({state.weight}-byte weights) gathered on every rank next to "
                      f"its shards and the teacher; optimizer states, gradients, gathered units and activations "
                      f"freed before it (release_stage)", {"strategy": strategy.name, "world_size": world})
    return Moment({"teacher": teacher, "student": full},
                  "stage end without sharding: the student's own weights and the teacher; optimizer states, "
                  "gradients and activations freed (release_stage)", {"strategy": strategy.name, "world_size": world})


def forward_working_set(tokens: int, config, gdn_width: int, act_bytes: int) -> int:
    """Without autograd, what one decoder layer's forward holds at once for `tokens` positions (an estimate): its
    MLP's three [tokens, intermediate] tensors in the activation dtype, and six [tokens, width] float32 tensors
    (the residual stream and norm, a mixer's q, k, v and output: the GDN computes them in float32), width the larger
    of the hidden size and the GDN's heads x head_dim."""
    width = max(config.hidden_size, gdn_width)
    return 3 * tokens * config.intermediate_size * act_bytes + 6 * tokens * width * 4


def final_eval_moment(settings, model: Model) -> Moment:
    """The final evaluation (`tcal.evaluate.suite.evaluate`), on every rank: the teacher and the trained student
    both on the device, and the largest working set of its parts at their longest batch:

    - perplexity (`eval.batch_size` x `eval.seq_len`): the head's logits for NLL_CHUNK_ROWS positions at a time
      (`tcal.evaluate.perplexity.token_nll`), in the compute dtype, their float32 copy and the cross entropy's
      float32 log-softmax, plus one layer's forward;
    - the harness (`eval.harness.batch_size` x `max_length`): the batch's final hidden states and the log-softmax of
      one request's continuation at a time (`tcal.evaluate.ranked_lm.RankedHFLM`; at most `max_length` positions,
      a rolling log-likelihood's), plus one layer's forward; lm-eval turns autocast off, so a float32 student
      computes in float32;
    - RULER (`eval.ruler.batch_size` examples of the longest `eval.ruler.lengths`, decoded together): one layer's
      forward of one example's prefill (each runs alone), and per example the kept layers' KV cache, the GDN states
      and the last position's logits (generate keeps one).
    """
    from tcal.evaluate.perplexity import NLL_CHUNK_ROWS

    precision = Precision.parse(settings.trainer.precision)
    state = Strategy.parse(settings.trainer.strategy).state_bytes(precision)
    config, vocab, ev = model.teacher_config, model.vocab_size, settings.eval
    student_bytes = trained_student_bytes(settings, state)
    student_config = model.student.config
    gdn = model.student.gdn(student_config.gdn_layers[0]) if student_config.gdn_layers else None
    gdn_width = gdn.num_heads * gdn.head_dim if gdn is not None else 0
    compute = precision.compute_bytes if precision.mixed else student_bytes
    ppl_tokens = int(ev.batch_size) * int(ev.seq_len)
    work = {"perplexity": min(NLL_CHUNK_ROWS, ppl_tokens) * vocab * (compute + 4 + 4)
            + forward_working_set(ppl_tokens, config, gdn_width, compute)}
    harness = ev.harness
    if harness.name != "none":
        tokens = int(harness.batch_size) * int(harness.max_length)
        continuation = int(harness.max_length) * vocab * 2 * student_bytes  # one request's logits, log-softmax
        work["harness"] = (tokens * model.hidden_size * student_bytes + continuation
                           + forward_working_set(tokens, config, gdn_width, student_bytes))
    if ev.ruler.name != "none":
        length, batch = max(int(n) for n in ev.ruler.lengths), int(ev.ruler.batch_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = 2 * len(student_config.keep_layers) * length * config.num_key_value_heads * head_dim * compute
        states = len(student_config.gdn_layers) * (gdn.num_heads * gdn.head_dim ** 2 * 4 if gdn else 0)
        per_example = kv + states + vocab * 4
        work["ruler"] = forward_working_set(length, config, gdn_width, compute) + batch * per_example
    largest = max(work, key=work.get)
    teacher = model.teacher_params * dtype_bytes(getattr(torch, str(settings.teacher.dtype)))
    parts = {"teacher": teacher, "student": model.student_params * student_bytes, f"{largest}_work": work[largest]}
    return Moment(parts,
                  f"final evaluation: teacher and trained student on every rank, and the largest working set, "
                  f"{largest}'s (logits bounded by a chunk of positions)",
                  {"largest": largest, "work_gb": {k: round(v / GB, 2) for k, v in work.items()}})


# ------------------------------------------------------------------------------------------------ hours


# Peak dense bfloat16 tensor throughput (vendor data sheets, SXM parts) and the model FLOPs utilisation the hours
# assume: planning constants (no run has measured them here), stated in the output with the formula.
GPU_RATES = {
    "H100": {"peak_bf16_tflops": 989.0, "mfu": 0.35},
    "A100": {"peak_bf16_tflops": 312.0, "mfu": 0.45},
}
HOURS_GPUS = 8
FLOPS_FORMULA = ("per training token: 6 N_trained (forward and backward of the trained matmul parameters) + "
                 "2 N_teacher (the frozen teacher's forward; Stage 1 without its head) + 2 N_recomputed (checkpointed "
                 "parts run forward twice) + softmax attention 2 T d_attn per layer forward (causal, T the sequence "
                 "length), x3 in trained layers + GDN chunk 2 H (2 C d + 3 d^2) per layer forward (chunk C=64, "
                 "head dim d), x3 in trained layers; hours = FLOPs / (GPUs x peak bf16 x MFU)")


def matmul_params(modules) -> int:
    """Parameters of the nn.Linear modules among `modules`, counted once each (a tied head once): the parameters a
    token's forward multiplies (embeddings are looked up, norms are elementwise)."""
    seen, total = set(), 0
    for module in modules:
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def attention_flops(seq_len: int, config) -> int:
    """Forward FLOPs per token of one causal softmax attention layer (scores and weighted values, T / 2 keys on
    average): 2 T H d_head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * seq_len * config.num_attention_heads * head_dim


def gdn_flops(seq_len: int, gdn) -> int:
    """Forward FLOPs per token of one GDN layer's chunked delta rule (fla's chunk algorithm, an estimate): per head,
    the chunk's q k^T and its weighted values (2 x 2 C d), and the state's read, correction and update (3 x 2 d^2)."""
    chunk = min(FLA_CHUNK, seq_len)
    return gdn.num_heads * (4 * chunk * gdn.head_dim + 6 * gdn.head_dim ** 2)


def stage_flops(kind: str, node, model: Model, world: int) -> dict:
    """Tokens and FLOPs of one training stage by `FLOPS_FORMULA`."""
    teacher = model.teacher
    student, config = model.student, model.teacher_config
    steps = node.steps(world)
    tokens = steps.total * steps.tokens_per_step
    T = int(node.seq_len)
    n_layers, n_kept = config.num_hidden_layers, len(student.config.keep_layers)
    gdn_layers = list(student.config.gdn_layers)
    gdn_kernel = gdn_flops(T, student.gdn(gdn_layers[0])) if gdn_layers else 0
    n_gdn_params = matmul_params(m for i in gdn_layers for m in student.gdn(i).modules())
    teacher_decoder = matmul_params(teacher.get_decoder().modules())
    attention = attention_flops(T, config)
    if kind == "align":
        per_token = {"teacher_forward": 2 * teacher_decoder + n_layers * attention,
                     "trained": 6 * n_gdn_params + 3 * len(gdn_layers) * gdn_kernel}
        recompute = 2 * n_gdn_params + len(gdn_layers) * gdn_kernel if node.checkpoint_mixers else 0
    else:
        trained = matmul_params(student.modules())
        per_token = {"teacher_forward": 2 * matmul_params(teacher.modules()) + n_layers * attention,
                     "trained": 6 * trained + 3 * (n_kept * attention + len(gdn_layers) * gdn_kernel)}
        if node.activation_checkpointing:
            layers = matmul_params(student.get_decoder().layers.modules())
            recompute = 2 * layers + n_kept * attention + len(gdn_layers) * gdn_kernel
        elif node.checkpoint_mixers:
            recompute = 2 * n_gdn_params + len(gdn_layers) * gdn_kernel
        else:
            recompute = 0
    per_token["recompute"] = recompute
    flops_per_token = sum(per_token.values())
    return {"tokens": tokens, "flops_per_token": flops_per_token, "flops": tokens * flops_per_token,
            "flops_per_token_parts": per_token}


def hours_plan(settings, model: Model, world: int) -> dict:
    """Predicted hours of the run's training stages on HOURS_GPUS x H100 and x A100 (`FLOPS_FORMULA`, `GPU_RATES`);
    calibration, validation and the final evaluation are not counted."""
    stages = {node.kind: stage_flops(node.kind, node, model, world) for _, node in settings.stage.stages()}
    total = sum(stage["flops"] for stage in stages.values())
    gpus = {f"{HOURS_GPUS} x {name}": {**rate, "hours": round(total / (HOURS_GPUS * rate["peak_bf16_tflops"] * 1e12
                                                                         * rate["mfu"]) / 3600, 2)}
            for name, rate in GPU_RATES.items()}
    return {"formula": FLOPS_FORMULA, "total_flops": total, "stages": stages, "gpus": gpus,
            "not_counted": "calibration (init), the validation curve and the final evaluation"}


def host_plan(settings, model: Model, stages: dict, world: int, headroom_gb: float) -> dict:
    """Host memory of a node of `world` ranks (each rank one process), and what a SLURM job asks for it.

    A rank holds at most one of these at a time: the teacher as loaded (its weights in `teacher.dtype` on the host
    before they move to the device), the calibration statistics (`host_gb`), and on rank 0 the student's full
    state dict for the export (float32: an upper bound). The student is built on the teacher's device on the meta
    device first (`convert.build_student`): no host copy. Each process adds PROCESS_HOST_GB. `slurm_mem_gb` is
    the node's sum plus the headroom, rounded up; `cpus_per_task` is HOST_CPUS_PER_RANK."""
    teacher_load = model.teacher_params * dtype_bytes(getattr(torch, str(settings.teacher.dtype)))
    statistics = int(stages["calibration"].settings["host_gb"] * GB)
    export = model.student_params * 4 if settings.save_student else 0
    checkpoint_rank0, checkpoint = checkpoint_staging(settings, model, world)
    data_rank0, data = data_staging(settings)
    per_rank = max(teacher_load, statistics, checkpoint) + data + PROCESS_HOST_GB * GB
    rank0 = max(teacher_load, statistics, export, checkpoint_rank0) + data_rank0 + PROCESS_HOST_GB * GB
    node = rank0 + (world - 1) * per_rank
    return {"per_rank_gb": round(per_rank / GB, 2), "rank0_gb": round(rank0 / GB, 2),
            "per_node_gb": round(node / GB, 2), "ranks": world,
            "slurm_mem_gb": math.ceil(node / GB + headroom_gb), "cpus_per_task": HOST_CPUS_PER_RANK,
            "parts_gb": {"teacher_load": round(teacher_load / GB, 2), "statistics": round(statistics / GB, 2),
                         "export_rank0": round(export / GB, 2), "checkpoint_rank0": round(checkpoint_rank0 / GB, 2),
                         "checkpoint_per_rank": round(checkpoint / GB, 2), "data_rank0": round(data_rank0 / GB, 2),
                         "data_per_rank": round(data / GB, 2), "process": PROCESS_HOST_GB}}


def checkpoint_staging(settings, model: Model, world: int) -> tuple[int, int]:
    """(rank 0, any other rank) bytes of host memory a stage checkpoint stages: the student's float32 weights and
    Adam's two float32 states of what the stage trains (Stage 2: every student parameter). One process or DDP:
    rank 0 serializes the whole checkpoint in memory before it writes it (`atomic_checkpoint_io`); FSDP: each rank
    stages its own shard. Nothing without a training stage."""
    kinds = [node.kind for _, node in settings.stage.stages()]
    if not kinds:
        return 0, 0
    trainable = model.student_params if "distill" in kinds else model.gdn_params
    whole = model.student_params * 4 + trainable * 8
    if str(settings.trainer.strategy) == "fsdp":
        return math.ceil(whole / world), math.ceil(whole / world)
    return whole, 0


def data_staging(settings) -> tuple[int, int]:
    """(rank 0, any other rank) bytes of host memory the training data takes besides the mapped token store (whose
    pages are shared and reclaimable): each stage's reading plan, 8 bytes for each of three arrays per window of the
    store (`tcal.training.data.plan_reading`), and on the rank that prepares the store one shard being written
    (`data.shard_tokens` int32 tokens, twice: gathered and written). A source without `max_tokens` (a local split)
    is counted as none: its windows are few."""
    stored = getattr(settings.data, "max_tokens", None)
    stages = [node for _, node in settings.stage.stages()]
    if not stored or not stages:
        return 0, 0
    windows = stored // min(node.seq_len for node in stages)
    reading = windows * 8 * 3
    return reading + settings.data.shard_tokens * 4 * 2, reading


def make_plan(settings, device_gb: float = 80.0, headroom_gb: float = DEFAULT_HEADROOM_GB) -> dict:
    """The plan of a run's settings (see the module docstring) as one JSON-ready object. A stage fits when
    its peak plus `headroom_gb` (CUDA's context, the caching allocator's fragmentation, NCCL's buffers, kernels'
    workspaces: what the plan does not count) is at most `device_gb`."""
    from tcal.preflight import check_plan
    from tcal.settings.retention import uniform_layers
    from tcal.runtime.distributed import world_size
    from tcal.teachers.load import teacher_architecture

    if headroom_gb < 0 or headroom_gb >= device_gb:
        raise ConfigError(f"--headroom-gb {headroom_gb:g}: expected 0 <= headroom < the device's {device_gb:g} GB")
    check_plan(settings)
    num_layers = teacher_architecture(settings.teacher, settings.paths.cache_dir).num_hidden_layers
    retention = retention_plan(settings, num_layers)
    keep = retention["keep_layers"] or uniform_layers(num_layers, retention["kept"] / num_layers)
    model = build_model(settings, keep)
    trainer = settings.trainer
    device_type = "cpu" if str(trainer.accelerator) == "cpu" else "cuda"
    world = world_size(trainer)
    stages = {"calibration": calibration_memory(settings, model, device_type, world)}
    stages.update({node.kind: stage_memory(node.kind, node, settings, model, world, device_type)
                   for _, node in settings.stage.stages()})
    per_device = {kind: round(stages[kind].peak / GB, 2) if kind in stages else None
                  for kind in ("calibration", "align", "distill")}
    step_kind = max(stages, key=lambda kind: stages[kind].peak)
    step = Moment({"training_step": stages[step_kind].peak}, f"the largest step: {step_kind}'s peak (stages)",
                  {"stage": step_kind})
    moments = {"step": step, "stage_end_gather": gather_moment(settings, model, world),
               "final_evaluation": final_eval_moment(settings, model)}
    moments = {name: moment for name, moment in moments.items() if moment is not None}
    notes = []
    if str(trainer.devices) in ("-1", "auto") and str(trainer.accelerator) != "cpu":
        notes.append(f"trainer.devices={trainer.devices} counts the GPUs visible here ({world} counted); "
                     f"pass trainer.devices=N for the node's")
    return {
        "teacher": settings.teacher.name, "model_type": model.teacher_config.model_type,
        "teacher_params": model.teacher_params, "student_params": model.student_params,
        "gdn_params": model.gdn_params, "num_layers": num_layers,
        "retention": {**retention, "converted": num_layers - retention["kept"]},
        "trainer": {"accelerator": str(trainer.accelerator), "devices": world, "precision": str(trainer.precision),
                    "kernels": "fla + flash (CUDA)" if device_type == "cuda" else "torch chunk + flash (CPU)"},
        "device_gb": device_gb, "headroom_gb": headroom_gb, "per_device_gb": per_device,
        "fits": all(part.fits(device_gb, headroom_gb) for part in [*stages.values(), *moments.values()]),
        "stages": {kind: stage.as_dict(device_gb, headroom_gb) for kind, stage in stages.items()},
        "moments": {name: moment.as_dict(device_gb, headroom_gb) for name, moment in moments.items()},
        "hours": hours_plan(settings, model, world),
        "host": host_plan(settings, model, stages, world, headroom_gb),
        "notes": notes,
    }


# ------------------------------------------------------------------------------------------------ output


ROWS = (  # (label, key in a stage's dict)
    ("init", "init"), ("strategy", "strategy"), ("precision", "precision"), ("batch per rank", "batch_per_rank"),
    ("tokens per step", "tokens_per_step"), ("steps", "steps"), ("weights GB", "weights_gb"),
    ("gradients GB", "gradients_gb"), ("optimizer GB", "optimizer_gb"), ("teacher GB", "teacher_gb"),
    ("buffers GB", "buffers_gb"), ("autocast copies GB", "autocast_gb"), ("gathered units GB", "gathered_gb"),
    ("activations GB", "activations_gb"), ("kl GB", "kl_gb"), ("peak GB", "peak_gb"), ("free GB", "free_gb"),
    ("fits", "fits"),
)


def _cell(value) -> str:
    if isinstance(value, list):
        return " x ".join(str(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def format_plan(plan: dict, label: str) -> str:
    ret, host = plan["retention"], plan["host"]
    kept = ret["keep_layers"] if ret["keep_layers"] is not None else f"({ret['note']})"
    lines = [f"tcal-plan {label}",
             f"teacher  {plan['teacher']} ({plan['model_type']}, {plan['num_layers']} layers): "
             f"{plan['teacher_params']:,} parameters",
             f"student  {plan['student_params']:,} parameters: {ret['kept']} softmax layers kept, "
             f"{ret['converted']} converted to Gated DeltaNet ({plan['gdn_params']:,} GDN parameters)",
             f"retention {ret['policy']}: keep {kept}",
             f"trainer  {plan['trainer']['devices']} x {plan['trainer']['accelerator']}, "
             f"{plan['trainer']['precision']}, kernels {plan['trainer']['kernels']}; fits {plan['device_gb']:g} GB "
             f"per device with {plan['headroom_gb']:g} GB headroom: {_cell(plan['fits'])}",
             f"host     {host['per_node_gb']:g} GB per node of {host['ranks']} ranks (rank 0 {host['rank0_gb']:g} GB): "
             f"SLURM mem_gb={host['slurm_mem_gb']}, cpus_per_task={host['cpus_per_task']}", ""]
    stages = [k for k in ("calibration", "align", "distill") if k in plan["stages"]]
    rows = [["", *stages]]
    for name, key in ROWS:
        rows.append([name, *(_cell(plan["stages"][k].get(key)) for k in stages)])
    for setting in ("none", "checkpoint_mixers", "activation_checkpointing"):
        rows.append([f"  activations, {setting}",
                     *(_cell(plan["stages"][k]["activations_gb_by_checkpointing"].get(setting)) for k in stages)])
    cal = plan["stages"]["calibration"]
    rows.append(["host GB (statistics)", _cell(cal["host_gb"]), *([""] * (len(stages) - 1))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines += ["", moments_line(plan), hours_line(plan)]
    for kind in stages:
        lines += [f"note ({kind}): {n}" for n in plan["stages"][kind]["notes"]]
    for name, moment in plan["moments"].items():
        parts = ", ".join(f"{part} {gb:g}" for part, gb in moment["parts_gb"].items())
        lines.append(f"note ({MOMENT_LABELS[name]}): {parts} GB; {moment['note']}")
    lines.append(f"note (hours): {plan['hours']['formula']}; not counted: {plan['hours']['not_counted']}")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


MOMENT_LABELS = {"step": "training step", "stage_end_gather": "stage-end gather",
                 "final_evaluation": "final evaluation"}


def moments_line(plan: dict) -> str:
    """The three moments' per-device peaks and whether each fits, on one line."""
    cells = []
    for name, moment in plan["moments"].items():
        which = moment.get("stage") or moment.get("largest")
        cells.append(f"{MOMENT_LABELS[name]}{f' ({which})' if which else ''} {moment['peak_gb']:g} GB "
                     f"(fits: {_cell(moment['fits'])})")
    return "moments  " + "; ".join(cells)


def hours_line(plan: dict) -> str:
    """The predicted hours on each GPU type, with the peak and utilisation they assume."""
    hours = plan["hours"]
    cells = [f"{gpus} ({rate['peak_bf16_tflops']:g} TFLOPs bf16 peak, MFU {rate['mfu']:g}): {rate['hours']:g} h"
             for gpus, rate in hours["gpus"].items()]
    return f"hours    {'; '.join(cells)} ({hours['total_flops']:.3g} FLOPs of training stages)"


def markdown_table(plans: list[tuple[str, dict]]) -> str:
    """One row per plan: parameter counts and per-device peaks (GB), the distill activations by checkpointing."""
    head = ("| run | teacher params | student params | converted | calibration GB | align GB | distill GB | "
            "distill activations GB (none / mixers / layers) | tokens per step (align, distill) | fits |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, plan in plans:
        stages, per = plan["stages"], plan["per_device_gb"]
        distill = stages.get("distill", {}).get("activations_gb_by_checkpointing", {})
        acts = " / ".join(_cell(distill.get(k)) for k in ("none", "checkpoint_mixers", "activation_checkpointing"))
        tokens = ", ".join(_cell(stages[k]["tokens_per_step"]) if k in stages else "-" for k in ("align", "distill"))
        lines.append(f"| {label} | {plan['teacher_params'] / 1e9:.2f}B | {plan['student_params'] / 1e9:.2f}B | "
                     f"{plan['retention']['converted']} of {plan['num_layers']} | {_cell(per['calibration'])} | "
                     f"{_cell(per['align'])} | {_cell(per['distill'])} | {acts} | {tokens} | {_cell(plan['fits'])} |")
    return "\n".join(lines)


def moments_markdown(plans: list[tuple[str, dict]]) -> str:
    """One row per plan: the per-device peak (GB) of each moment and whether all fit, the training tokens of each
    stage and the predicted hours on each GPU type."""
    gpus = list(plans[0][1]["hours"]["gpus"]) if plans else []
    head = ("| run | training step GB | stage-end gather GB | final evaluation GB | fits | tokens (align, distill) | "
            + " | ".join(f"hours {g}" for g in gpus) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, plan in plans:
        moments, stages = plan["moments"], plan["hours"]["stages"]

        def peak(name: str) -> str:
            moment = moments.get(name)
            if moment is None:
                return "-"
            which = moment.get("stage") or moment.get("largest")
            return f"{moment['peak_gb']:g}" + (f" ({which})" if which else "")

        tokens = ", ".join(_cell(stages[k]["tokens"]) if k in stages else "-" for k in ("align", "distill"))
        hours = " | ".join(f"{plan['hours']['gpus'][g]['hours']:g}" for g in gpus)
        lines.append(f"| {label} | {peak('step')} | {peak('stage_end_gather')} | {peak('final_evaluation')} | "
                     f"{_cell(plan['fits'])} | {tokens} | {hours} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry


def slurm_env(plans: list[dict]) -> str:
    """`export` of the variables conf/hydra/launcher/slurm_gpu.yaml reads, from the plans' host figures (the
    largest of each over the plans: one SLURM preset serves every job of a sweep)."""
    mem = max(plan["host"]["slurm_mem_gb"] for plan in plans)
    cpus = max(plan["host"]["cpus_per_task"] for plan in plans)
    gpus = max(plan["trainer"]["devices"] for plan in plans)
    return f"export TCAL_SLURM_MEM_GB={mem} TCAL_CPUS_PER_TASK={cpus} TCAL_GPUS_PER_NODE={gpus}"


def gigabytes(text: str) -> float:
    """A finite number of GB >= 0 (argparse's `type`: its error names the flag); NaN and infinity plan nothing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of GB >= 0")
    return value


def label_of(overrides: list[str]) -> str:
    return " ".join(overrides) or "(defaults)"


def main(argv=None) -> None:
    """The `tcal-plan` console script."""
    from tcal.errors import config_error_exit
    from tcal.settings.compose import compose_here, hydra_configs, planned_jobs
    from tcal.settings.conversion import run_settings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for tcal (group=a,b plans each)")
    parser.add_argument("--json", action="store_true", help="one JSON object per plan")
    parser.add_argument("--markdown", action="store_true", help="one markdown table row per plan")
    parser.add_argument("--moments-markdown", action="store_true",
                        help="one markdown table row per plan: the three moments' peaks and the predicted hours")
    parser.add_argument("--slurm-env", action="store_true",
                        help="the environment hydra/launcher=slurm_gpu reads (memory, CPUs and GPUs of a node), "
                             "the largest over the plans: eval \"$(tcal-plan ... --slurm-env)\"")
    parser.add_argument("--device-gb", type=gigabytes, default=80.0, help="memory of one device (default 80)")
    parser.add_argument("--headroom-gb", type=gigabytes, default=DEFAULT_HEADROOM_GB,
                        help=f"kept free on each device: fits means peak + headroom <= device "
                             f"(default {DEFAULT_HEADROOM_GB:g})")
    args = parser.parse_args(argv)
    try:
        with hydra_configs():
            runs = [(label_of(job), make_plan(run_settings(compose_here(job)), args.device_gb, args.headroom_gb))
                    for job in planned_jobs(args.overrides)]
    except ConfigError as err:
        config_error_exit(err)
    if args.slurm_env:
        print(slurm_env([plan for _, plan in runs]), flush=True)
    elif args.json:
        for label, plan in runs:
            print(json.dumps({"run": label, **plan}), flush=True)
    elif args.markdown:
        print(markdown_table(runs), flush=True)
    elif args.moments_markdown:
        print(moments_markdown(runs), flush=True)
    else:
        print("\n\n".join(format_plan(plan, label) for label, plan in runs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
