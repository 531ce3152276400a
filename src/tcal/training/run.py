"""Running the stages of the `stage` setting after the init: planning (checked before any work), Lightning Trainers,
checkpoints and resume, the Stage 1 cache (`tcal.store.cache`, kind `stage1`), and the stage records of results.json
(their fields: `tcal.store.record`).

`stage=none` has no stages; `align` and `distill` have one; `align_distill` runs `stage.align` then
`stage.distill`. Budgets are tokens: a stage runs max_tokens // (batch_size * seq_len * world size) steps and
evaluates (and checkpoints) every round(eval_every_tokens / tokens per step) steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from tcal.data.documents import eval_sets, token_windows
from tcal.data.token_store import training_tokens
from tcal.evaluate.validation import eval_dataloaders
from tcal.registry import STAGE_KINDS
from tcal.runtime.distributed import world_size
from tcal.runtime.lightning_output import trainer_callbacks
from tcal.settings import TrainerSettings
from tcal.settings.stage import TrainingStageSettings
from tcal.settings.relevance import cache_settings
from tcal.store.cache import Codec, get_or_build, tensor_codec
from tcal.store.files import atomic_checkpoint_io
from tcal.store.fingerprint import digest, plain, teacher_fingerprint, weights_digest
from tcal.store.record import is_stage_record
from tcal.store.rerun import checkpoint_progress
from tcal.teachers.load import torch_dtype
from tcal.tracking import drop_rows_after, log_curve
from tcal.training.data import (
    PackedTextDataModule,
    describe_reading,
    plan_reading,
    reading_line,
    stage_samples,
)

log = logging.getLogger(__name__)


@dataclass
class StagePlan:
    kind: str
    settings: TrainingStageSettings
    prefix: str
    data: PackedTextDataModule
    total_steps: int
    eval_every_steps: int
    tokens_per_step: int  # batch_size x seq_len x ranks
    eval_names: list[str]  # the eval sets of its curve


def plan_stages(ctx) -> list[StagePlan]:
    """Tokenized, packed training data and step counts for each stage, and which windows each reads
    (`tcal.training.data.plan_reading`), stated on one line before any work; fails before conversion when the
    training split is shorter than one sequence."""
    settings, plans = ctx.settings, []
    world, data = world_size(settings.trainer), settings.data
    stages = settings.stage.stages()
    if not stages:
        return plans
    cached = all(node.cache_tokens for _, node in stages)
    tokens = training_tokens(ctx.splits.train, ctx.tokenizer, ctx.cache_dir if cached else None, data)
    readings = plan_reading(tokens.num_tokens, stage_samples(settings), int(settings.seed), float(data.retrieval_mix))
    windows = curve_windows(ctx)
    eval_loaders = functools.partial(eval_dataloaders, windows, int(settings.eval.batch_size), ctx.ranks.rank,
                                     ctx.ranks.world_size)
    for (prefix, node), reading in zip(stages, readings):
        steps = node.steps(world)
        module = PackedTextDataModule(tokens, ctx.tokenizer, node.seq_len, node.batch_size, steps.total,
                                      int(settings.seed), retrieval_mix=float(data.retrieval_mix),
                                      retrieval_sample_tokens=data.retrieval_sample_tokens, reading=reading,
                                      eval_loaders=eval_loaders)
        plans.append(StagePlan(node.kind, node, prefix, module, steps.total, steps.eval_every, steps.tokens_per_step,
                               list(windows)))
    if ctx.ranks.is_main:
        print(reading_line(describe_reading(tokens.key, tokens.num_tokens, readings)), flush=True)
    return plans


def data_record(plans: list[StagePlan]) -> dict | None:
    """What the run's stages read (results.json `data`; `tcal.training.data.describe_reading`); None without stages."""
    if not plans:
        return None
    tokens = plans[0].data.windows.tokens
    return describe_reading(tokens.key, tokens.num_tokens, [plan.data.reading for plan in plans])


def stage1_key(ctx, student, plan: StagePlan) -> str:
    """Everything a finished Stage 1 depends on: teacher, keep list, the GDN layers' starting weights, its training
    windows, the number of ranks, and every setting that changes a trained student or its curve, of a run whose
    stage is this one (so `stage=align` and the Stage 1 of `stage=align_distill` share entries)."""
    gdn_start = gdn_state(student).values()  # hashed tensor by tensor (fingerprint.digest streams tensors)
    alone = dataclasses.replace(ctx.settings, stage=plan.settings)
    return digest(teacher_fingerprint(ctx.teacher), student.config.keep_layers, *gdn_start,
                  cache_settings("stage1", alone), plan.data.windows_key, world_size(ctx.settings.trainer),
                  *curve_windows(ctx).values())


def curve_windows(ctx) -> dict:
    """{eval set: [num_windows, seq_len] token windows} the stages' curves are measured on: by content in the Stage 1
    key, so an eval file edited between two runs is measured again rather than read from the old curve."""
    ev = ctx.settings.eval
    return {name: token_windows(docs, ctx.tokenizer, int(ev.seq_len), int(ev.num_windows))
            for name, docs in eval_sets(ctx.settings.data, ctx.splits).items()}


def gdn_state(student) -> dict:
    """The GDN layers' parameters under their names in the student's state dict."""
    return {f"model.layers.{i}.self_attn.{k}": v for i in student.config.gdn_layers
            for k, v in student.gdn(i).state_dict().items()}


def stage1_codec(student) -> Codec[tuple[dict, object]]:
    """A finished Stage 1 as one safetensors file: the GDN layers' weights, the stage record as metadata. Read
    back, the weights go into `student` (an entry whose tensors do not fit it is foreign)."""

    def decode(state: dict, record) -> tuple[dict, object]:
        own = gdn_state(student)
        if state.keys() != own.keys() or any(state[k].shape != v.shape for k, v in own.items()):
            raise ValueError("its GDN weights do not fit this student (a foreign file)")
        if not is_stage_record(record):
            raise ValueError("its record is not a stage record of this schema (a foreign file, or older code's)")
        student.load_state_dict(state, strict=False)
        return {**record, "cached": True}, student

    return tensor_codec(lambda done: (gdn_state(done[1]), done[0]), decode)


class ShardedStrategy(ModelParallelStrategy):
    """`trainer.strategy=fsdp`: FSDP2 (`fully_shard`) over every rank, no tensor parallelism. The stage module's
    `configure_model` shards the student (`tcal.training.stages.shard_student`); the teacher stays outside it.

    Its checkpoint is a folder (each rank writes its shards, rank 0 the metadata). A save writes a sibling
    `<name>.partial` folder first and moves it into place only when every rank has finished, so a kill at any
    moment leaves a whole checkpoint under `<name>` (or, between the two renames, under `<name>.old`)."""

    def __init__(self, world: int):
        super().__init__(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=True)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + ".partial")
        if self.global_rank == 0:
            remove_path(partial)
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            old = path.with_name(path.name + ".old")
            remove_path(old)
            if path.exists():
                path.rename(old)
            partial.rename(path)
            remove_path(old)
        self.barrier()

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0:
            remove_path(Path(filepath))


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or folder if it is there."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def stage_checkpoint(run_dir: Path, kind: str) -> Path | None:
    """The stage's last checkpoint: `last.ckpt` (a file, or a sharded run's folder), or the folder a sharded save
    had just moved aside when it was killed; None when the stage has none."""
    folder = Path(run_dir) / "checkpoints" / kind
    for candidate in (folder / "last.ckpt", folder / "last.ckpt.old"):
        if candidate.exists():
            return candidate
    return None


def resolve_strategy(name: str, world: int):
    """What Lightning is given for `trainer.strategy`: `fsdp` is FSDP2 through `ShardedStrategy` (Lightning's own
    `fsdp` string would be FSDP1, whose wrapping, clipping and precision this project does not use)."""
    return ShardedStrategy(world) if name == "fsdp" else name


def make_trainer(trainer_settings: TrainerSettings, plan: StagePlan, run_dir: Path, logger, callbacks) -> L.Trainer:
    """The stage's Trainer: validation (the curve) every `eval_every_steps` optimizer steps, and the last checkpoint
    written after each validation, so a checkpoint always holds the curve up to its own step. Its bar and lines suit
    a log file (`tcal.runtime.lightning_output`)."""
    trainer_cfg = trainer_settings
    checkpoint = ModelCheckpoint(dirpath=run_dir / "checkpoints" / plan.kind, filename="last", save_top_k=1,
                                 monitor=None, enable_version_counter=False, save_on_train_epoch_end=False)
    strategy = resolve_strategy(str(trainer_cfg.strategy), world_size(trainer_cfg))
    # max_epochs=-1: the sampler ends the data at max_steps; with max_epochs=1 a resumed run stops early (tested)
    # gradient clipping: StageModule.configure_gradient_clipping (also through the sharded root)
    return L.Trainer(
        accelerator=trainer_cfg.accelerator, devices=trainer_cfg.devices, num_nodes=trainer_cfg.num_nodes,
        strategy=strategy, precision=trainer_cfg.precision, max_steps=plan.total_steps, max_epochs=-1,
        gradient_clip_val=plan.settings.grad_clip, logger=logger if logger is not None else False,
        callbacks=trainer_callbacks([*callbacks, checkpoint]), default_root_dir=str(run_dir),
        use_distributed_sampler=False, val_check_interval=plan.eval_every_steps, check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=1, enable_model_summary=False, inference_mode=False,
        deterministic=trainer_cfg.deterministic, plugins=[atomic_checkpoint_io()()],
    )


@contextlib.contextmanager
def teacher_in_dtype(teacher, dtype_name: str | None):
    """The frozen teacher's parameters in `dtype_name` (e.g. bfloat16) for the block, back in their own dtype
    afterwards. Buffers keep theirs: rounding the float32 RoPE frequencies would change every position's angle."""
    if not dtype_name:
        yield
        return
    own = teacher.dtype
    buffers = [(module, name, buffer) for module in teacher.modules() for name, buffer in module._buffers.items()
               if buffer is not None]
    teacher.to(torch_dtype(dtype_name))
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    try:
        yield
    finally:
        teacher.to(own)
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


def loss_text(value: float | None) -> str:
    """A loss for the console; none when a resumed stage had no step left to run."""
    return "-" if value is None else f"{value:.4g}"


def unsharded_student(trainer, student, ctx, kind: str):
    """The trained student as a plain module on the run's device, on every rank. One device and DDP train the
    student's own parameters: it is returned as it is. Under FSDP every rank gathers the full weights (one copy,
    in the dtype they trained in) and a student built on the meta device takes them by assignment, so no second
    copy of the weights is ever made; the sharded one is dropped with the Trainer."""
    if not isinstance(trainer.strategy, ModelParallelStrategy):
        return student.to(ctx.device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True))  # every rank, on device
    fresh = rebuilt_from(student, full)
    log.info("stage %s: the student's full weights gathered from %s", kind, type(trainer.strategy).__name__)
    return fresh


def release_stage(trainer, module, data) -> None:
    """Free what a finished stage holds for training, before the stage-end gather: AdamW's states, the student's
    gradients (under FSDP both are shards), and every link that ties the stage's optimizer, LightningModule and
    wrapped module to the Trainer, its strategy and the data module. Lightning links them both ways (the module and
    the data module hold the Trainer; the Trainer's strategy holds the module, the wrapped module (DDP's wrapper,
    with gradient buckets as large as the gradients), the optimizers, their Lightning wrappers and the schedulers,
    which hold the optimizers again; the callbacks hold the module's logging methods, and under DDP the module holds
    its own redirected `forward`): without this the optimizer and module of a stage live in reference cycles until
    a full garbage collection, next to the following stage's. With the links cut they are freed by reference
    counting as soon as the caller drops the module and the Trainer (the Trainer's own internal cycles hold nothing
    of the stage). The student itself stays usable."""
    strategy = trainer.strategy
    for optimizer in strategy.optimizers:
        optimizer.state.clear()
    module.student.zero_grad(set_to_none=True)
    strategy.optimizers = []
    strategy.lr_scheduler_configs = []
    strategy.model = None
    strategy._lightning_module = None  # Lightning has no public way to disconnect a module from its strategy
    module.trainer = None
    module.__dict__.pop("forward", None)  # Lightning's forward redirection (DDP) leaves a bound `forward` on it
    data.trainer = None
    trainer._data_connector._datahook_selector = None  # it holds the module and the data module
    for callback in trainer.callbacks:  # Lightning gives every callback the module's `log` and `log_dict`
        for name in ("log", "log_dict"):
            if getattr(getattr(callback, name, None), "__self__", None) is module:
                delattr(callback, name)
    log.info("stage %s: optimizer state, gradients and the Trainer's links to the module released", module.kind)


def collect_checkpoint_cycles(kind: str) -> None:
    """After a sharded stage: free the garbage cycles that torch.distributed.checkpoint's state-dict walk leaves at
    each save and each gather (`_iterate_valid_model_state`'s recursive closure refers to itself and keeps the set
    of every module it visited: the stage's LightningModule and the sharded student with its shards). No reference
    reaches them from here, so one garbage collection is the only way to free them before the next stage; a run
    on one device or under DDP makes none and needs none (its stage objects go by reference counting)."""
    import gc

    found = gc.collect()
    log.info("stage %s: the sharded stage's checkpoint-walk cycles collected (%d objects)", kind, found)


def rebuilt_from(student, state: dict):
    """A plain `HybridForCausalLM` of `student`'s config holding the tensors of `state` (assigned, not copied) and
    `student`'s buffers (the RoPE frequencies are not in a state dict)."""
    from tcal.student.hybrid import HybridForCausalLM

    with torch.device("meta"):
        fresh = HybridForCausalLM(student.config)
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    own = dict(student.named_buffers())
    for name, buffer in fresh.named_buffers():
        owner, _, leaf = name.rpartition(".")
        fresh.get_submodule(owner)._buffers[leaf] = own[name]
    fresh.requires_grad_(False)
    return fresh


def run_stage(plan: StagePlan, ctx, student, logger, resume: bool):
    """Train `student` for one stage; returns (the stage's record: summary and curve, the trained student). The
    student is trained in place except under FSDP, whose full weights come back in a plain module."""
    if plan.kind == "align":
        folder = ctx.cache_dir / "stage1" / ctx.settings.teacher.name if plan.settings.cache else None
        record, student = get_or_build("stage1", stage1_key(ctx, student, plan),
                                       lambda: train_stage(plan, ctx, student, logger, resume),
                                       folder=folder, codec=stage1_codec(student), ranks=ctx.ranks)
        if record["cached"]:
            log_curve(logger, plan.kind, record["curve"])  # its panels as a computed stage has them
        return record, student
    return train_stage(plan, ctx, student, logger, resume)


def train_stage(plan: StagePlan, ctx, student, logger, resume: bool):
    """`run_stage` without the Stage 1 cache."""
    settings = ctx.settings
    stage_module = STAGE_KINDS[plan.kind].implementation
    module = stage_module(student, ctx.teacher, plan.settings, plan.total_steps, eval_names=plan.eval_names)
    trainer = make_trainer(settings.trainer, plan, ctx.run_dir, logger, ctx.extra_callbacks)
    last = stage_checkpoint(ctx.run_dir, plan.kind) if resume else None
    ckpt_path = str(last) if last is not None else None
    if ckpt_path:
        log.info("stage %s: resuming from %s", plan.kind, ckpt_path)
    drop_rows_after(logger, plan.kind, checkpoint_progress(last).get("tokens_seen") if ckpt_path else None)
    start = time.perf_counter()
    with teacher_in_dtype(ctx.teacher, getattr(plan.settings, "teacher_dtype", None)):
        if ckpt_path is None:
            trainer.validate(module, datamodule=plan.data, verbose=False)  # the curve's point at token 0
        trainer.fit(module, datamodule=plan.data, ckpt_path=ckpt_path)
        if module.last_eval_tokens != module.tokens_seen:
            trainer.validate(module, datamodule=plan.data, verbose=False)  # the last point, between two intervals
    seconds = time.perf_counter() - start
    record = {
        "kind": plan.kind, "settings": plain(plan.settings), "steps": int(trainer.global_step),
        "tokens_seen": module.tokens_seen, "tokens_per_step": plan.tokens_per_step, "world_size": trainer.world_size,
        "seconds_this_process": round(seconds, 2), "loss_first": module.loss_first, "loss_last": module.loss_last,
        "rank_weight_digests": module.rank_weight_digests, "curve": module.curve, "resumed": ckpt_path is not None,
        "cached": False,
    }
    first, final = ({name: points[i]["ppl"] for name, points in module.curve.items() if points} for i in (0, -1))
    summary = (f"stage {plan.kind}: {module.tokens_seen:,} tokens in {trainer.global_step} steps, {seconds:.0f} s "
               f"in this process; loss {loss_text(module.loss_first)} -> {loss_text(module.loss_last)}; "
               + ", ".join(f"ppl {n} {first[n]:.2f} -> {final[n]:.2f}" for n in final))
    is_global_zero, sharded = trainer.is_global_zero, isinstance(trainer.strategy, ModelParallelStrategy)
    release_stage(trainer, module, plan.data)
    student.requires_grad_(False)
    student = unsharded_student(trainer, student, ctx, plan.kind)
    del trainer, module
    if sharded:
        collect_checkpoint_cycles(plan.kind)
    if not record["rank_weight_digests"]:  # a sharded run: the digests of the gathered weights
        digests = ctx.ranks.merge({ctx.ranks.rank: weights_digest(student)[:15]})
        record["rank_weight_digests"] = [digests[rank] for rank in range(ctx.ranks.world_size)]
    if is_global_zero:
        print(summary, flush=True)
    return record, student
