"""The training stages as LightningModules: Stage 1 alignment and Stage 2 distillation (docs/method.md, sections
"Stage 1: alignment" and "Stage 2: distillation").

Both wrap the hybrid student (a registered submodule: it trains, moves and checkpoints with the module) and
the frozen teacher (held outside the module tree: never trained, never checkpointed, never wrapped by DDP).
Both count `tokens_seen`, summed over all ranks, and log every metric with it as the step.
"""

from __future__ import annotations

import logging
import time

import torch

from tcal.errors import Divergence, check_finite
from tcal.evaluate.validation import PerplexityValidation, is_sharded
from tcal.settings.schedule import lr_factor
from tcal.settings.stage import TrainingStageSettings
from tcal.store.fingerprint import weights_digest
from tcal.student.alignment import alignment_loss, capture_teacher_io
from tcal.tracking import curve_metric, tokens_metric
from tcal.training.kd import chunked_kd_loss

log = logging.getLogger(__name__)

Curve = dict[str, list[dict]]  # eval set -> [{"tokens": int, "ppl": float}, ...]


FSDP_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16}  # trainer.precision -> the dtype FSDP2 gathers parameters in


def fsdp_policy(precision: str):
    """FSDP2's mixed-precision policy for `trainer.precision`: under `bf16-mixed` parameters are gathered in
    bfloat16 (half the all-gather bytes and half each gathered unit's memory; autocast would cast them to bfloat16
    for every matmul anyway) and gradients are reduce-scattered in float32 (a sum over ranks in bfloat16 would
    round each rank's contribution), landing in the float32 shards AdamW updates. Every other precision gets None:
    parameters are gathered and gradients reduced in their own dtype, so a float32 run is what it was."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = FSDP_PARAM_DTYPES.get(str(precision))
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_student(student, mesh, precision: str = "32-true") -> None:
    """FSDP2 units over `mesh`: each GDN mixer, each decoder layer (holding the mixer's unit), then the student as
    the root (embeddings, final norm, head). A unit's weights are gathered only while it runs, so a rank holds one
    layer's full weights at a time besides its shards. The shards stay in their dtype (float32 under `-mixed`
    precisions, where AdamW updates them); under `bf16-mixed` they are gathered in bfloat16 and gradients reduced
    in float32 (`fsdp_policy`), under autocast as on one device. FSDP then also casts each unit's floating-point
    inputs to bfloat16, so the residual stream between layers is bfloat16 (on one device and under DDP it is
    float32): the standard FSDP mixed precision. Buffers are never cast, so the RoPE frequencies stay float32.

    The root's lazy initialization runs here rather than at its first forward, because Stage 1 calls the GDN
    units directly (`student.gdn(i)`) and FSDP takes the first module to run as the root. Code that reaches the
    root's own weights without the root's forward (Stage 2 calls the decoder and uses the head's weight) gathers
    them first with `student.unshard()`; the backward's final callback reduces their gradients and reshards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fsdp_policy(precision)
    log.info("FSDP2 units of the student: parameters gathered in %s, gradients reduced in %s (trainer.precision=%s)",
             *((policy.param_dtype, policy.reduce_dtype) if policy else ("their own dtype",) * 2), precision)
    options = {"mesh": mesh, "mp_policy": policy or MixedPrecisionPolicy()}
    for i in student.config.gdn_layers:
        fully_shard(student.gdn(i), **options)
    for layer in student.get_decoder().layers:
        fully_shard(layer, **options)
    fully_shard(student, **options)
    student._get_fsdp_state()._lazy_init()


def lr_schedule(optimizer, name: str, total_steps: int, min_lr_ratio: float = 0.0):
    """`constant` or `cosine` (from each group's lr down to min_lr_ratio * lr over total_steps), per step."""
    factor = lr_factor(name, total_steps, min_lr_ratio, "stage.schedule")
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}


class StageModule(PerplexityValidation):
    """What both stages share: the teacher reference, token counting, logging, the optimizer and schedule, and
    the perplexity curve (Lightning validation at token 0, every `eval_every_tokens` and at the end: one point per
    eval set each time, kept in the checkpoint so a resumed run continues its curve)."""

    kind = "stage"

    def __init__(self, student, teacher, settings: TrainingStageSettings, total_steps: int, eval_names=()):
        super().__init__()
        self.student = student
        self._frozen = {"teacher": teacher}  # a plain dict: not a submodule
        self.settings, self.total_steps = settings, int(total_steps)
        self.eval_names = list(eval_names)
        self.curve: Curve = {name: [] for name in self.eval_names}
        self.last_eval_tokens: int | None = None
        self.tokens_seen = 0
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.rank_weight_digests: list[str] = []
        self._clock: tuple[float, int] | None = None

    @property
    def teacher(self):
        return self._frozen["teacher"]

    def on_fit_start(self) -> None:
        self.teacher.to(self.device)  # the run placed it on this rank's device already; a no-op then

    def setup(self, stage: str) -> None:
        self.student.train()  # no dropout in these models; train mode states the intent (and silences Lightning)
        self.set_checkpointing(bool(self.settings.checkpoint_mixers), bool(self.settings.activation_checkpointing))

    def configure_model(self) -> None:
        """Under `trainer.strategy=fsdp`, shard the student (`shard_student`), once: the token-0 validation and
        the fit of one Trainer share the wrap. Other strategies train the student as it is."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self.trainer.strategy, ModelParallelStrategy) and not is_sharded(self.student):
            shard_student(self.student, self.device_mesh["data_parallel"], str(self.trainer.precision))

    def teardown(self, stage: str) -> None:
        self.set_checkpointing(False, False)

    def set_checkpointing(self, mixers: bool, layers: bool) -> None:
        """Recompute in backward instead of storing: the GDN mixers only, or whole decoder layers. With both asked
        for, the mixers' own checkpoints are off: a checkpointed layer already recomputes its mixer in backward,
        and a mixer checkpoint inside it would run that mixer a third time (its forward, the layer's recompute,
        then its own recompute), for no memory saved (the layer keeps only its input either way)."""
        if mixers and layers:
            log.info("stage %s: decoder layers checkpointed; the GDN mixers' own checkpoints are skipped inside them "
                     "(each mixer runs forward twice per step, not three times)", self.kind)
        for i in self.student.config.gdn_layers:
            self.student.gdn(i).checkpoint_training = mixers and not layers
        if layers:
            self.student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.student.is_gradient_checkpointing:
            self.student.gradient_checkpointing_disable()

    def parameter_groups(self) -> list[dict]:
        raise NotImplementedError

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the stage's loss on a batch of token ids, extra figures to log)."""
        raise NotImplementedError

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.count_tokens(batch)
        loss, extra = self.loss(batch)
        self.log_step(loss, extra)
        return loss

    def configure_optimizers(self):
        stage = self.settings
        fused = bool(stage.fused_optimizer) and self.device.type in ("cpu", "cuda")
        optimizer = torch.optim.AdamW(self.parameter_groups(), betas=tuple(stage.betas),
                                      weight_decay=stage.weight_decay, fused=fused or None)
        return {"optimizer": optimizer,
                "lr_scheduler": lr_schedule(optimizer, stage.schedule, self.total_steps, stage.min_lr_ratio)}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping by the global norm of every gradient, the same figure on every strategy: done here for the
        fused AdamW under bf16 autocast (bfloat16 has no gradient scaler, so there is nothing to unscale first;
        Lightning's mixed-precision plugin refuses every fused optimizer, scaler or not) and for FSDP, whose
        gradients are shards (DTensors: `clip_grad_norm_` reduces their norms over the ranks)."""
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

        plugin, strategy = self.trainer.precision_plugin, self.trainer.strategy
        ours = isinstance(strategy, ModelParallelStrategy) or (
            isinstance(plugin, MixedPrecision) and plugin.scaler is None
            and type(strategy) in (SingleDeviceStrategy, DDPStrategy))
        if gradient_clip_val and ours:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def count_tokens(self, batch: torch.Tensor) -> int:
        """Add this step's tokens over all ranks to tokens_seen."""
        local = torch.tensor(float(batch.numel()), dtype=torch.float64, device=batch.device)
        self.tokens_seen += int(self.trainer.strategy.reduce(local, reduce_op="sum").item())
        return self.tokens_seen

    def check_finite(self, losses: dict[str, torch.Tensor]) -> None:
        """Raise a Divergence naming the first non-finite loss of `losses` ({what: one-element tensor}). With
        several ranks every rank's losses are gathered first, so a non-finite loss on any rank stops every rank
        with the same error (the lowest such rank's first), and none is left waiting in the next step's
        gradient reduction."""
        values = torch.stack([loss.detach().float().reshape(()) for loss in losses.values()])
        if self._trainer is not None and self.trainer.world_size > 1:
            values = self.all_gather(values)
        for row in values.reshape(-1, len(losses)).tolist():
            for what, value in zip(losses, row):
                check_finite(value, lambda value, what=what: Divergence.in_stage(
                    self.kind, what, value, self.global_step, self.tokens_seen))

    def log_step(self, loss: torch.Tensor, extra: dict) -> None:
        """Loss, extras, tokens_seen (also the logger's step) and throughput, on the progress bar too."""
        if self.loss_first is None:
            self.loss_first = loss.item()
        self.loss_last = loss.item()
        now = time.perf_counter()
        start_time, start_tokens = self._clock or (now, self.tokens_seen)
        speed = (self.tokens_seen - start_tokens) / (now - start_time) if now > start_time else 0.0
        metrics = {f"{self.kind}/loss": loss.detach(), **{f"{self.kind}/{k}": v for k, v in extra.items()},
                   tokens_metric(self.kind): float(self.tokens_seen), "step": float(self.tokens_seen)}
        self.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self.log_dict({"tokens": float(self.tokens_seen), "tok/s": speed}, prog_bar=True, logger=False,
                      on_step=True, on_epoch=False, rank_zero_only=True)
        if self.device.type == "cuda":
            self.log(f"{self.kind}/peak_memory_gb", torch.cuda.max_memory_allocated() / 2**30, rank_zero_only=True)

    def on_train_start(self) -> None:
        self._clock = (time.perf_counter(), self.tokens_seen)

    def on_train_end(self) -> None:
        """Every rank's weight digest, gathered: a DDP run proves its ranks ended identical. A sharded student
        holds shards: its digests are taken after the gather (`tcal.training.run.train_stage`). The optimizer
        states are cleared here, once training is over: Lightning's teardown, next, would otherwise copy them to the
        host (one device and DDP move them to the CPU at the end of a fit), only for the stage end to free them
        (`tcal.training.run.release_stage`)."""
        for optimizer in self.trainer.optimizers:
            optimizer.state.clear()
        if is_sharded(self.student):
            return
        mine = torch.tensor([int(weights_digest(self.student)[:15], 16)], dtype=torch.int64, device=self.device)
        gathered = self.all_gather(mine).reshape(-1)
        self.rank_weight_digests = [f"{int(d):015x}" for d in gathered.tolist()]

    def evaluated(self) -> torch.nn.Module:
        return self.student

    def on_perplexities(self, ppl: dict[str, float]) -> None:
        """One curve point per eval set at `tokens_seen`: logged with it as the step, kept in `curve` (for the record:
        `tcal.pipeline.RecordCallback`). A non-finite perplexity stops the stage on every rank (the sums were
        reduced over ranks, so all of them see it) before the point or a checkpoint is kept."""
        tokens = int(self.tokens_seen)
        for name, value in ppl.items():
            check_finite(value, lambda value, name=name: Divergence.in_stage(
                self.kind, f"perplexity on eval set {name!r}", value, self.trainer.global_step, tokens))
        self.last_eval_tokens = tokens
        if not self.trainer.is_global_zero:
            return
        for name, value in ppl.items():
            self.curve[name].append({"tokens": tokens, "ppl": value})
        metrics = {curve_metric(self.kind, name): value for name, value in ppl.items()}
        for logger in self.trainer.loggers:
            logger.log_metrics({**metrics, tokens_metric(self.kind): float(tokens)}, step=tokens)
        log.info("%s at %d tokens: %s", self.kind, tokens, ", ".join(f"ppl {n} {v:.2f}" for n, v in ppl.items()))

    def on_fit_end(self) -> None:
        """A fit resumed from a checkpoint of its last step trains nothing and skips on_train_end: gather here."""
        if not self.rank_weight_digests:
            self.on_train_end()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tcal"] = {"tokens_seen": self.tokens_seen, "loss_first": self.loss_first,
                              "loss_last": self.loss_last, "curve": self.curve,
                              "last_eval_tokens": self.last_eval_tokens}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["tcal"]
        self.tokens_seen = int(state["tokens_seen"])
        self.loss_first, self.loss_last = state["loss_first"], state.get("loss_last")
        self.curve, self.last_eval_tokens = state["curve"], state["last_eval_tokens"]


class AlignStage(StageModule):
    """Stage 1: every GDN layer, fed the teacher's normalized input, matches the teacher attention output.

    The loss is Phase 2's objective (`alignment_loss`) averaged over the GDN layers; only GDN parameters train.
    The teacher runs once per batch; the student's decoder does not run at all (inputs are teacher-forced).
    """

    kind = "align"

    def __init__(self, student, teacher, settings: TrainingStageSettings, total_steps: int, **curve):
        super().__init__(student, teacher, settings, total_steps, **curve)
        self.gdn_layers = list(student.config.gdn_layers)
        student.requires_grad_(False)
        for i in self.gdn_layers:
            student.gdn(i).requires_grad_(True)

    def parameter_groups(self) -> list[dict]:
        mixers = [p for i in self.gdn_layers for p in self.student.gdn(i).parameters()]
        return [{"params": mixers, "lr": self.settings.lr}]

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(mean over GDN layers of the alignment loss, {"layer_<i>": that layer's loss})."""
        with torch.no_grad(), capture_teacher_io(self.teacher, self.gdn_layers) as io:
            self.teacher.get_decoder()(input_ids=batch, use_cache=False)
        losses = {}
        for i in self.gdn_layers:
            losses[i] = alignment_loss(self.student.gdn(i), *io[i])
        self.check_finite({f"alignment loss of layer {i}": loss for i, loss in losses.items()})
        return torch.stack(list(losses.values())).mean(), {f"layer_{i}": v.detach() for i, v in losses.items()}


class DistillStage(StageModule):
    """Stage 2: forward KL(teacher || student) on the logits of every position, computed in token chunks.

    Two parameter groups: the GDN mixers at `lr_mixer`, every other student parameter at `lr_rest`.
    """

    kind = "distill"

    def __init__(self, student, teacher, settings: TrainingStageSettings, total_steps: int, **curve):
        super().__init__(student, teacher, settings, total_steps, **curve)
        student.requires_grad_(True)

    def parameter_groups(self) -> list[dict]:
        mixer_ids = {id(p) for i in self.student.config.gdn_layers for p in self.student.gdn(i).parameters()}
        mixers = [p for p in self.student.parameters() if id(p) in mixer_ids]
        rest = [p for p in self.student.parameters() if id(p) not in mixer_ids]
        return [{"params": mixers, "lr": self.settings.lr_mixer}, {"params": rest, "lr": self.settings.lr_rest}]

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(KL (+ CE) loss, {"kl", "ce"}) of one batch of token ids."""
        with torch.no_grad():
            teacher_hidden = self.teacher.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        if is_sharded(self.student):
            self.student.unshard()  # the decoder's embeddings and norm and the head's weight, used outside forward
        student_hidden = self.student.get_decoder()(input_ids=batch, use_cache=False).last_hidden_state
        loss, parts = chunked_kd_loss(student_hidden, teacher_hidden, self.student.get_output_embeddings(),
                                      self.teacher.get_output_embeddings(), batch,
                                      chunk_size=int(self.settings.kl_chunk_size),
                                      ce_weight=float(self.settings.ce_weight))
        self.check_finite({"loss": loss})
        return loss, parts

