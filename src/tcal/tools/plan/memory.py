"""Per-device memory: the calibration, each training stage (its terms asked of its settings: `trains`, `runs`,
`checkpointing`, `stage_teacher_dtype`, `logit_kl_chunk`) and the moments outside the training step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from tcal.settings.stage import StageSequenceSettings
from tcal.tools.plan.trace import LayerTrace, trace_alignment, trace_decoder

log = logging.getLogger(__name__)

GB = 2**30
KINDS = tuple(next(f for f in fields(StageSequenceSettings) if f.name == "sequence").default_factory())  # align, distill
STAGE_ORDER = ("calibration", *KINDS)  # the stages as the plan lists them, before any other kind
# [chunk, vocab] float32 tensors alive at once in one chunk of the fused KL (kd.py; `make bench ARGS=kl_memory`)
KL_CHUNK_TENSORS = 3


def stage_order(kinds) -> list[str]:
    """STAGE_ORDER, then the kinds among `kinds` it does not name (a stage kind of a plugin's)."""
    return [*STAGE_ORDER, *(kind for kind in kinds if kind not in STAGE_ORDER)]


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype, or of the one a name ("bfloat16") names."""
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    return torch.empty((), dtype=dtype).element_size()


def gb(size: float) -> float:
    return round(size / GB, 2)


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
    """What a training strategy spreads over the ranks (see the package docstring)."""

    name: str
    # FSDP2: weights, gradients and AdamW states sharded over the ranks, and each decoder layer and GDN mixer a
    # unit, gathered one at a time
    sharded: bool = False
    note: str = ""

    @classmethod
    def parse(cls, name) -> "Strategy":
        name = str(name)
        if name.startswith("fsdp") or name == "model_parallel":
            return cls(name, sharded=True,
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

    def gathered_dtype(self, precision: Precision) -> torch.dtype | None:
        """The dtype FSDP2 gathers parameters in (`tcal.training.stages.fsdp_policy`): bfloat16 under bf16-mixed,
        None (their own dtype) otherwise and under every other strategy."""
        if self.sharded and precision.mixed and precision.compute == torch.bfloat16:
            return torch.bfloat16
        return None


def trainer_state(trainer) -> tuple[Precision, Strategy, StateBytes]:
    precision, strategy = Precision.parse(trainer.precision), Strategy.parse(trainer.strategy)
    return precision, strategy, strategy.state_bytes(precision)


def parameters_of(module) -> int:
    return sum(p.numel() for p in module.parameters())


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

    def trained(self, trains: str) -> int:
        """Parameters a stage trains, by its settings' `trains`: the whole student's or the GDN mixers'."""
        return {"student": self.student_params, "mixers": self.gdn_params}[trains]


def build_model(settings, keep_layers: list[int]) -> Model:
    from tcal.student.convert import meta_student
    from tcal.teachers.load import meta_model, parameter_count, teacher_architecture

    config = teacher_architecture(settings.teacher, settings.paths.cache_dir)
    teacher = meta_model(config)
    student = meta_student(config, keep_layers)
    gdn = sum(parameters_of(student.gdn(i)) for i in student.config.gdn_layers)
    return Model(config, parameter_count(teacher), student, parameter_count(student), keep_layers, gdn, teacher)


def planned_keep(retention, num_layers: int) -> list[int] | None:
    """The policy's keep list when it is known before the teacher is read and the policy's own settings class says
    it (`PolicySettings.planned_keep`): a class that inherits another policy's keep list (a plugin deriving from
    `RetentionSettings` without its own) cannot be planned, None."""
    keep = retention.planned_keep(num_layers)
    return keep if "planned_keep" in vars(type(retention)) else None


def retention_plan(settings, num_layers: int) -> dict:
    """The kept layers: computed for `uniform` and `explicit`; for scored policies (and a policy that does not say
    its keep list) only their count is known before the real teacher is read (the plan counts them at uniform
    positions: every layer has the same size)."""
    ret = settings.retention
    keep = planned_keep(ret, num_layers)
    plan = {"policy": ret.name, "setting": ret.keep_setting(), "kept": ret.kept(num_layers), "keep_layers": keep,
            "scored": keep is None}
    if keep is None and ret.planned_keep(num_layers) is not None:
        plan["note"] = (f"retention={ret.name}: {type(ret).__name__} does not define planned_keep, so tcal-plan "
                        f"cannot plan its keep list; its {plan['kept']} kept layers are planned at uniform positions")
        log.warning("%s", plan["note"])
    elif keep is None:
        plan["note"] = f"{ret.name} chooses the {plan['kept']} kept layers by scoring the real teacher"
    return plan


class Fitting:
    """A per-device figure (its `peak` bytes) that fits when its peak plus the headroom is at most the device."""

    def fits(self, device_gb: float, headroom_gb: float) -> bool:
        return self.peak + headroom_gb * GB <= device_gb * GB

    def fit_dict(self, device_gb: float, headroom_gb: float) -> dict:
        return {"peak_gb": gb(self.peak), "free_gb": round(device_gb - self.peak / GB, 2),
                "fits": self.fits(device_gb, headroom_gb)}


@dataclass
class StageMemory(Fitting):
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

    def as_dict(self, device_gb: float, headroom_gb: float) -> dict:
        return {**self.settings, "weights_gb": gb(self.weights), "gradients_gb": gb(self.gradients),
                "optimizer_gb": gb(self.optimizer), "teacher_gb": gb(self.teacher), "buffers_gb": gb(self.buffers),
                "autocast_gb": gb(self.autocast.get(self.checkpointing, 0)), "gathered_gb": gb(self.gathered),
                "activations_gb": gb(self.activations[self.checkpointing]), "checkpointing": self.checkpointing,
                "activations_gb_by_checkpointing": {k: gb(v) for k, v in self.activations.items()},
                "kl_gb": gb(self.kl), **self.fit_dict(device_gb, headroom_gb), "notes": self.notes}


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


def linear_params(modules) -> int:
    """Weights and biases of the nn.Linear modules in `modules` that train (what autocast casts)."""
    return sum(p.numel() for m in modules if isinstance(m, torch.nn.Linear)
               for p in m.parameters(recurse=False) if p.requires_grad)


@dataclass(frozen=True)
class Step:
    """What a training step that runs one thing (a stage settings' `runs`, `STEPS`) holds, by checkpointing
    setting: the activations and the parameters whose compute-dtype copy autocast makes and autograd keeps for
    backward (Lightning's autocast caches no cast, so a copy lives as long as the graph saves it); and FSDP2's root
    parameters and units."""

    activations: dict[str, int]
    autocast_params: dict[str, int]
    fsdp_root: int
    fsdp_units: list[int]
    note: str = ""


def decoder_step(student, batch: int, seq_len: int, teacher_dtype, device_type: str) -> Step:
    """The student's decoder on the batch. Autocast's copies: every trainable Linear without checkpointing; with
    checkpointed mixers all but the mixers' plus one mixer's being recomputed; with checkpointed layers one layer's,
    plus the head's cast that the fused KL makes for each chunk. FSDP2's root is everything outside the decoder
    layers (embeddings, final norm, head; not resharded after its forward; the head's gradient is the fused KL's,
    counted there), its units the decoder layers."""
    config, layers = student.config, student.get_decoder().layers
    trace = trace_decoder(student, batch, seq_len, device_type)
    every = linear_params(student.modules())
    mixers = [linear_params(student.gdn(i).modules()) for i in config.gdn_layers] or [0]
    copies = {"none": every, "checkpoint_mixers": every - sum(mixers) + max(mixers),
              "activation_checkpointing": max(linear_params(layer.modules()) for layer in layers)
              + linear_params([student.lm_head])}
    root = sum(p.numel() for name, p in student.named_parameters() if not name.startswith("model.layers."))
    return Step(decoder_activations(trace, len(config.keep_layers), len(config.gdn_layers)), copies, root,
                [parameters_of(layer) for layer in layers])


def mixers_step(student, batch: int, seq_len: int, teacher_dtype, device_type: str) -> Step:
    """Each GDN mixer alone, on the teacher's captured inputs and attention outputs (in `teacher_dtype`), with its
    alignment loss; no decoder runs, so activation checkpointing does not apply. Autocast copies every mixer's
    Linear weights, or one mixer's being recomputed; FSDP2's units are the mixers."""
    gdn_layers = student.config.gdn_layers
    n_gdn, dtype = len(gdn_layers), next(student.parameters()).dtype
    mixer, loss = trace_alignment(student.gdn(gdn_layers[0]), batch, seq_len, dtype, device_type) if n_gdn else (0, 0)
    captured = 2 * n_gdn * batch * seq_len * student.config.hidden_size * dtype_bytes(teacher_dtype)
    copies = [linear_params(student.gdn(i).modules()) for i in gdn_layers] or [0]
    return Step({"none": captured + n_gdn * (mixer + loss), "checkpoint_mixers": captured + n_gdn * loss + mixer},
                {"none": sum(copies), "checkpoint_mixers": max(copies)}, 0,
                [parameters_of(student.gdn(i)) for i in gdn_layers] or [0],
                "activations: the teacher's captured GDN inputs and attention outputs, and every GDN's alignment "
                "loss (activation_checkpointing does not apply: the student's decoder does not run)")


STEPS = {"decoder": decoder_step, "mixers": mixers_step}  # by a stage settings' `runs`


def fsdp_gathered(step: Step, state: StateBytes, gathered_bytes: int | None = None) -> int:
    """What FSDP2 holds unsharded besides the shards at the end of a forward and the backward's first units: the
    step's root parameters and two units (the running one and the prefetched one) with their unsharded gradients.
    `gathered_bytes`: the bytes of a gathered parameter and of its unsharded gradient under a mixed-precision policy
    (`tcal.training.stages.fsdp_policy`: bfloat16), whose gradients are then reduce-scattered from a float32 copy of
    one unit; None: parameters in their own dtype."""
    if gathered_bytes is None:
        weight, unit_bytes, reduce = state.weight, state.weight + state.gradient, 0
    else:
        weight, unit_bytes, reduce = gathered_bytes, 2 * gathered_bytes, 4
    unit = max(step.fsdp_units)
    return step.fsdp_root * weight + 2 * unit * unit_bytes + unit * reduce


def kl_bytes(tokens: int, hidden: int, vocab: int, chunk: int, student_dtype, teacher_dtype,
             compute_dtype=None, device_type: str = "cuda", head_dtype=None) -> int:
    """The fused KL's peak (`training/kd.py`): the float32 gradient accumulator of the student head [V, D], both
    models' final hidden states with their row copies and the float32 gradient of the student's, and
    KL_CHUNK_TENSORS [chunk, V] float32 tensors of one chunk. Under autocast (`compute_dtype`) a head not already
    in the compute dtype is copied once for the call: the student head's copy is counted with the autocast copies
    (`Step.autocast_params`), the teacher head's here; off CUDA each chunk's head-gradient product is a [V, D]
    tensor in the compute dtype besides the accumulator (CUDA's addmm adds into it in float32 directly). A head in a
    reduced `head_dtype` under autocast (FSDP's bfloat16 gathered head) gets its float32 accumulated gradient back as
    a copy in that dtype once the chunks are done: the larger of that copy and a chunk's tensors counts."""
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


def stage_memory(node, settings, model: Model, world: int, device_type: str) -> StageMemory:
    """Per-device memory of one training stage under the run's trainer, from the terms its settings `node` gives:
    what it trains, what a step runs (`STEPS`), its checkpointing, the teacher's dtype and the KL on the logits."""
    precision, strategy, state = trainer_state(settings.trainer)
    teacher_dtype_name = node.stage_teacher_dtype(settings.teacher.dtype)
    teacher_dtype = getattr(torch, str(teacher_dtype_name))
    # Under autocast the residual stream, the norms and the GDN's recurrence stay float32 and only matmul outputs
    # are in the compute dtype: tracing the float32 student bounds what autograd keeps from above.
    trace_dtype = torch.float32 if state.autocast_copy else precision.compute
    student = model.student.to(trace_dtype).train()
    trainable = model.trained(node.trains)
    student.requires_grad_(node.trains == "student")
    for i in student.config.gdn_layers:
        student.gdn(i).requires_grad_(True)
    batch, seq_len = int(node.batch_size), int(node.seq_len)
    step = STEPS[node.runs](student, batch, seq_len, teacher_dtype, device_type)
    gathered_dtype = strategy.gathered_dtype(precision)
    chunk = node.logit_kl_chunk()
    kl = 0 if chunk is None else kl_bytes(batch * seq_len, model.hidden_size, model.vocab_size, int(chunk),
                                          trace_dtype, teacher_dtype, precision.compute if precision.mixed else None,
                                          device_type, gathered_dtype)
    steps = node.steps(world)
    notes = [n for n in (strategy.note, state.note) if n]
    if state.autocast_copy:
        notes.append("activations traced in float32 (an upper bound under autocast: matmul outputs are in the "
                     "compute dtype there)")
    autocast = {k: n * state.autocast_copy for k, n in step.autocast_params.items()}
    if gathered_dtype is not None:
        autocast = {k: 0 for k in autocast}
        notes.append("FSDP2 mixed precision: parameters gathered in bfloat16, so autocast makes none of the copies "
                     "above; gradients reduce-scattered from a float32 copy of one unit")
    gathered = 0
    if strategy.sharded and world > 1:
        gathered = fsdp_gathered(step, state, dtype_bytes(gathered_dtype) if gathered_dtype else None)
    shards = world if strategy.sharded else 1
    return StageMemory(
        weights=model.student_params * state.weight // shards, gradients=trainable * state.gradient // shards,
        optimizer=trainable * state.optimizer // shards,
        teacher=model.teacher_params * dtype_bytes(teacher_dtype), buffers=strategy.buffers(trainable, state, world),
        activations=step.activations, checkpointing=node.checkpointing(), kl=kl, autocast=autocast,
        gathered=gathered, notes=notes + ([step.note] if step.note else []),
        settings={"strategy": strategy.name, "precision": precision.name, "world_size": world,
                  "batch_per_rank": [batch, seq_len], "tokens_per_step": steps.tokens_per_step,
                  "steps": steps.total, "trainable_params": trainable, "teacher_dtype": str(teacher_dtype_name)})


def fitted_together(calibration, work, device_type: str, world: int) -> int:
    """How many layers' Phase 2 fits share a device at once: one after another with `calibration.fit=sequential`,
    else `calibration.layers_per_fit` (by default all on a GPU, one on a CPU) of the layers whose statistics a
    rank holds together (its share of the converted layers, in groups of `work.layers_at_once`)."""
    from tcal.init.calibration.phase2 import layers_per_fit

    if calibration.fit == "sequential":
        return 1
    held = min(work.layers_at_once, -(-work.layers // world))
    return min(layers_per_fit(calibration.layers_per_fit, device_type) or held, held)


def calibration_memory(settings, model: Model, device_type: str, world: int = 1) -> StageMemory:
    """Per-device memory of the init: teacher and student in `teacher.dtype`, and the larger of the teacher's
    statistics forward (an estimate: one layer's MLP and residual tensors and the blockwise attention scores) and
    Phase 2 of the layers fitted together (`fitted_together`; each with its teacher-forced tensors on the device,
    trained in float32 with AdamW and a best-state copy, and its activations). The statistics are held in host
    memory (`host_gb`)."""
    from tcal.student.convert import meta_student

    config = model.teacher_config
    teacher_bytes = dtype_bytes(settings.teacher.dtype)
    gdn_layers = model.student.config.gdn_layers
    work = settings.init.calibration_work(settings.calibration, len(gdn_layers)) if gdn_layers else None
    host = forward = phase2 = 0
    fitted = fitted_together(settings.calibration, work, device_type, world) if work else 1
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
        phase2 = (2 * work.device_windows * work.seq_len * model.hidden_size * 4
                  + parameters_of(gdn) * (4 + 4 + 8 + 4) + mixer + loss) * fitted
    memory = StageMemory(weights=model.student_params * teacher_bytes, gradients=0, optimizer=0,
                         teacher=model.teacher_params * teacher_bytes, buffers=0,
                         activations={"none": max(forward, phase2)}, checkpointing="none",
                         settings={"init": settings.init.name, "teacher_dtype": str(settings.teacher.dtype),
                                   "calibration_tokens": work.stats_windows * work.seq_len if work else 0,
                                   "host_gb": gb(host)})
    memory.notes.append(f"activations: the larger of the teacher's statistics forward and Phase 2 of the {fitted} "
                        f"layer(s) fitted together")
    if planned_keep(settings.retention, model.teacher_config.num_hidden_layers) is None:
        memory.notes.append(f"retention={settings.retention.name} chooses its layers on the real teacher first (not "
                            f"planned)")
    return memory


@dataclass
class Moment(Fitting):
    """What one device holds at one moment of a run outside the training step: each part's bytes, and what the
    moment is."""

    parts: dict[str, int]
    note: str
    settings: dict = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def as_dict(self, device_gb: float, headroom_gb: float) -> dict:
        return {**self.settings, "parts_gb": {k: gb(v) for k, v in self.parts.items()},
                **self.fit_dict(device_gb, headroom_gb), "note": self.note}


def gather_moment(settings, model: Model, world: int) -> Moment | None:
    """A stage's end (`tcal.training.run.train_stage`): `release_stage` has freed AdamW's states, the gradients and
    every gathered unit, and the stage's activations are gone with its last step. Under FSDP every rank then
    gathers the full student (`unsharded_student`: every parameter's full tensor on every rank, in its shards'
    dtype) while it still holds its shards, which the gather reads; the teacher stays, back in `teacher.dtype`.
    On one device and under DDP nothing is gathered: the student's own weights and the teacher. None without
    stages."""
    if not settings.stage.stages():
        return None
    _, strategy, state = trainer_state(settings.trainer)
    teacher = model.teacher_params * dtype_bytes(settings.teacher.dtype)
    full = model.student_params * state.weight
    where = {"strategy": strategy.name, "world_size": world}
    if strategy.sharded and world > 1:
        return Moment({"teacher": teacher, "weight_shards": full // world, "gathered_student": full},
                      f"FSDP stage end: the full student ({state.weight}-byte weights) gathered on every rank next to "
                      f"its shards and the teacher; optimizer states, gradients, gathered units and activations "
                      f"freed before it (release_stage)", where)
    return Moment({"teacher": teacher, "student": full},
                  "stage end without sharding: the student's own weights and the teacher; optimizer states, "
                  "gradients and activations freed (release_stage)", where)


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
    - RULER (`eval.ruler.batch_size` examples of the longest `eval.ruler.lengths`, decoded together, or fewer: a
      rank's share of a cell's `eval.ruler.n`, `examples_decoded_together`): one layer's
      forward of one example's prefill (each runs alone), and per example the kept layers' KV cache, the GDN states
      and the last position's logits (generate keeps one).

    The student's bytes per parameter after its stages: float32 under `-mixed` (cast before the first stage), the
    compute dtype under `-true`; without stages, the teacher's dtype it was built in.
    """
    from tcal.evaluate.perplexity import NLL_CHUNK_ROWS
    from tcal.evaluate.ruler import examples_decoded_together
    from tcal.runtime.distributed import world_size

    precision, _, state = trainer_state(settings.trainer)
    config, vocab, ev = model.teacher_config, model.vocab_size, settings.eval
    teacher_bytes = dtype_bytes(settings.teacher.dtype)
    student_bytes = state.weight if settings.stage.stages() else teacher_bytes
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
        length = max(int(n) for n in ev.ruler.lengths)
        batch = examples_decoded_together(ev.ruler.n, ev.ruler.batch_size, world_size(settings.trainer))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = 2 * len(student_config.keep_layers) * length * config.num_key_value_heads * head_dim * compute
        states = len(student_config.gdn_layers) * (gdn.num_heads * gdn.head_dim ** 2 * 4 if gdn else 0)
        per_example = kv + states + vocab * 4
        work["ruler"] = forward_working_set(length, config, gdn_width, compute) + batch * per_example
    largest = max(work, key=work.get)
    parts = {"teacher": model.teacher_params * teacher_bytes, "student": model.student_params * student_bytes,
             f"{largest}_work": work[largest]}
    return Moment(parts,
                  f"final evaluation: teacher and trained student on every rank, and the largest working set, "
                  f"{largest}'s (logits bounded by a chunk of positions)",
                  {"largest": largest, "work_gb": {k: gb(v) for k, v in work.items()}})
