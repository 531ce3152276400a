"""The processes of a run, one per device, started before the teacher loads.

A multi-device run (`trainer.devices` x `trainer.num_nodes` > 1) has one process per rank. Either something
outside started them (SLURM's tasks, torchrun, MPI/LSF; `ranks_started_outside`), or the job's own process
starts them (`tcal.cli.rank`: one fresh set of processes and one process group per job, so the jobs of a sweep never
share ranks). Each rank joins the process group with `launch` (Lightning Fabric with the environment it finds,
so the Trainers created later find the processes and the process group already there; it never relaunches
the command). From then on every rank holds the teacher and the student on its own device, and the per-layer
work (calibration, retention scoring) is split across ranks and exchanged, so no rank idles while another
computes. A one-device run gets `Ranks()` with no process group: nothing changes.

Decisions are collective: what rank 0 decides alone (`Ranks.decide`) reaches every rank, value or error, and
local work that may fail on some ranks only runs in `Ranks.together()`, which raises on every rank the error of
the lowest rank that failed. So every rank stops with the same error at the same point, and none waits in a
collective that another rank has left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

from tcal.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Every collective of the process group waits at most this long for the other ranks. The longest a rank waits
# legitimately is another rank's work done alone: rank 0 writing a full checkpoint with optimizer state (about
# 100 GB at 8B parameters) or consolidating a sharded one. A rank that failed does not leave the others waiting
# this long: a failure inside a decision is shared (`Ranks.decide`, `Ranks.together`), and the process that
# started a job's ranks stops the others as soon as one fails (`tcal.cli.rank`).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


def world_size(trainer) -> int:
    """Processes a `trainer` node asks for: devices per node x nodes (`devices: -1` = every visible GPU)."""
    devices = trainer.devices
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        per_node = len(devices)
    else:
        per_node = max(torch.cuda.device_count(), 1) if trainer.accelerator in ("gpu", "cuda") else 1
    return per_node * int(trainer.num_nodes)


def single_device(accelerator: str) -> torch.device:
    """The device of a one-process run: `cpu`, or the current CUDA device for `gpu`/`cuda` (and `auto` with one)."""
    if accelerator in ("gpu", "cuda") or accelerator == "auto" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Ranks:
    """This process's place in the run, and the few collectives the per-layer work needs."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, items: Iterable[T]) -> list[T]:
        """This rank's share of `items` (round robin, so every rank gets about as many)."""
        return list(items)[self.rank::self.world_size]

    def owner(self, position: int) -> int:
        """The rank whose `share` holds item number `position`."""
        return position % self.world_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def decide(self, compute: Callable[[], T]) -> T:
        """`compute()` run on rank 0 only; its value on every rank, or, when it raised, its error raised on every
        rank."""
        if not self.distributed:
            return compute()
        value, error = None, None
        if self.is_main:
            try:
                value = compute()
            except Exception as err:  # noqa: BLE001 - shared below, then raised on every rank
                error = err
        value, shared = self.broadcast((value, portable(error)))
        if error is not None:
            raise error
        if shared is not None:
            raise shared
        return value

    @contextlib.contextmanager
    def together(self):
        """Around local work that may fail on some ranks only: every rank leaves the block together, and when the
        block raised on any rank, every rank raises the error of the lowest rank that failed. The block must not
        enter collectives itself (other than nested `together` blocks and `decide`): a rank that raised before
        one would leave the others waiting in it."""
        try:
            yield
        except Exception as err:
            self.share_outcome(err)
            raise
        self.share_outcome(None)

    def share_outcome(self, error: Exception | None) -> None:
        """Every rank's outcome of one step gathered (a collective: every rank calls it); when any rank failed,
        the error of the lowest rank that failed is raised here on the others (that rank raises its own)."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        outcomes: list = [None] * self.world_size
        dist.all_gather_object(outcomes, portable(error))
        failed = [(rank, err) for rank, err in enumerate(outcomes) if err is not None]
        if not failed:
            return
        rank, first = failed[0]
        if rank == self.rank:
            raise error
        if error is not None:
            log.error("rank %d: %s: %s (stopping with rank %d's error instead)", self.rank, type(error).__name__,
                      error, rank)
        raise first

    def broadcast(self, obj: T, src: int = 0) -> T:
        """`obj` of rank `src` on every rank (pickled)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self._comm_device())
        return box[0]

    def merge(self, mine: dict) -> dict:
        """The union of every rank's dict (each rank computed its own keys)."""
        if not self.distributed:
            return dict(mine)
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        merged: dict = {}
        for part in parts:
            merged.update(part)
        return merged

    @torch.no_grad()
    def broadcast_module(self, module: torch.nn.Module, src: int) -> None:
        """Every tensor of `module`'s state set to rank `src`'s, in place (same shapes on every rank)."""
        if not self.distributed:
            return
        comm = self._comm_device()
        for tensor in module.state_dict().values():
            if tensor.device == comm:
                dist.broadcast(tensor, src=src)
            else:
                moved = tensor.to(comm)
                dist.broadcast(moved, src=src)
                tensor.copy_(moved)

    def _comm_device(self) -> torch.device:
        """Where the process group's tensors live: the GPU for NCCL, the CPU for gloo."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def portable(error: Exception | None) -> Exception | None:
    """`error` as it can travel to another rank (pickled): itself, or a RuntimeError naming it when it does not
    survive pickling."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not round-trip travels as its description
        return RuntimeError(f"{type(error).__name__}: {error}")


def ranks_started_outside() -> bool:
    """Whether this process is one of a run's ranks that something else started: a job's rank started by
    `tcal.cli.rank` or torchrun (LOCAL_RANK set), a SLURM task, an LSF or MPI job (Lightning's cluster environments,
    which tell the Trainer not to launch processes either)."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return "LOCAL_RANK" in os.environ or any(environment.detect() for environment in (
        TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment))


def check_tasks_match(world: int) -> None:
    """A SLURM job runs one task per rank: an sbatch of fewer tasks than the trainer's ranks (one task and 8 GPUs)
    would wait in Lightning's launcher or fail with its own error; it is one line saying what to run instead."""
    tasks = os.environ.get("SLURM_NTASKS")
    if tasks is None or "LOCAL_RANK" in os.environ or not tasks.isdigit() or int(tasks) == world:
        return
    raise ConfigError(f"trainer asks for {world} ranks (trainer.devices x trainer.num_nodes), but this SLURM job has "
                      f"{tasks} task{'s' if tasks != '1' else ''} (SLURM_NTASKS={tasks}); expected one task per rank: "
                      f"#SBATCH --ntasks-per-node=<devices per node> with `srun tcal ...`, or "
                      f"`tcal ... hydra/launcher=slurm_gpu` from a login node")


def starts_ranks(trainer) -> bool:
    """Whether this process must start the run's ranks itself (`tcal.cli.rank`): a multi-device trainer, and no
    ranks started from outside."""
    return world_size(trainer) > 1 and not ranks_started_outside()


def launch(trainer) -> Ranks:
    """Join the run's process group as the rank the environment names (the ranks are started beforehand, see
    the module doc); a one-device trainer joins nothing."""
    world = world_size(trainer)
    accelerator = str(trainer.accelerator)
    if world == 1:
        return Ranks(device=single_device(accelerator))
    if not ranks_started_outside():
        raise RuntimeError(f"tcal.runtime.distributed.launch: {world} ranks asked for, but this process is not one of them "
                           f"(no LOCAL_RANK, SLURM, torchrun, LSF or MPI environment); the job starts its ranks "
                           f"with tcal.cli.rank")
    check_tasks_match(world)
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator=accelerator, devices=trainer.devices, num_nodes=int(trainer.num_nodes),
                    strategy=DDPStrategy(timeout=PROCESS_GROUP_TIMEOUT))
    fabric.launch()
    ranks = Ranks(fabric.global_rank, fabric.world_size, fabric.device)
    log.info("rank %d of %d on %s", ranks.rank, ranks.world_size, ranks.device)
    return ranks


def split_work(ranks: Ranks, items: list, work: Callable[[object], T]) -> dict:
    """{item: work(item)} for every item, each computed by one rank (its `share`) and gathered on all ranks.
    `work` must return picklable values; when it raises on any rank, every rank raises that error."""
    with ranks.together():
        mine = {item: work(item) for item in ranks.share(items)}
    return ranks.merge(mine)


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of its run (Lightning records the rank once the ranks are launched)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0
