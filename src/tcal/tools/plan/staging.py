"""Host memory of a node: what its ranks load, stage and read besides the device, and what a SLURM job asks for."""

from __future__ import annotations

import math

from tcal.tools.plan.memory import GB, Model, dtype_bytes, gb

# Host memory of one rank's process besides its data (host_plan): 0.54 GB measured after importing torch,
# transformers, Lightning and tcal on the CPU; the rest an allowance for CUDA's host-side context and pinned buffers
PROCESS_HOST_GB = 4
HOST_CPUS_PER_RANK = 4  # a rank's loop (data loading runs in process), NCCL's threads, torch's host-side threads


def host_plan(settings, model: Model, stages: dict, world: int, headroom_gb: float) -> dict:
    """Host memory of a node of `world` ranks (each rank one process), and what a SLURM job asks for it.

    A rank holds at most one of these at a time: the teacher as loaded (its weights in `teacher.dtype` on the host
    before they move to the device), the calibration statistics (`host_gb`), and on rank 0 the student's full
    state dict for the export (float32: an upper bound). The student is built on the teacher's device on the meta
    device first (`convert.build_student`): no host copy. Each process adds PROCESS_HOST_GB. `slurm_mem_gb` is
    the node's sum plus the headroom, rounded up; `cpus_per_task` is HOST_CPUS_PER_RANK."""
    teacher_load = model.teacher_params * dtype_bytes(settings.teacher.dtype)
    statistics = int(stages["calibration"].settings["host_gb"] * GB)
    export = model.student_params * 4 if settings.save_student else 0
    checkpoint_rank0, checkpoint = checkpoint_staging(settings, model, world)
    data_rank0, data = data_staging(settings)
    per_rank = max(teacher_load, statistics, checkpoint) + data + PROCESS_HOST_GB * GB
    rank0 = max(teacher_load, statistics, export, checkpoint_rank0) + data_rank0 + PROCESS_HOST_GB * GB
    node = rank0 + (world - 1) * per_rank
    parts = {"teacher_load": teacher_load, "statistics": statistics, "export_rank0": export,
             "checkpoint_rank0": checkpoint_rank0, "checkpoint_per_rank": checkpoint, "data_rank0": data_rank0,
             "data_per_rank": data}
    return {"per_rank_gb": gb(per_rank), "rank0_gb": gb(rank0), "per_node_gb": gb(node), "ranks": world,
            "slurm_mem_gb": math.ceil(node / GB + headroom_gb), "cpus_per_task": HOST_CPUS_PER_RANK,
            "parts_gb": {**{name: gb(size) for name, size in parts.items()}, "process": PROCESS_HOST_GB}}


def checkpoint_staging(settings, model: Model, world: int) -> tuple[int, int]:
    """(rank 0, any other rank) bytes of host memory a stage checkpoint stages: the student's float32 weights and
    Adam's two float32 states of what the stage trains (the most any stage trains, by its settings' `trains`).
    One process or DDP: rank 0 serializes the whole checkpoint in memory before it writes it
    (`atomic_checkpoint_io`); FSDP: each rank stages its own shard. Nothing without a training stage."""
    stages = [node for _, node in settings.stage.stages()]
    if not stages:
        return 0, 0
    whole = model.student_params * 4 + max(model.trained(node.trains) for node in stages) * 8
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
