"""The processes of a run, one per device, started before the teacher loads.

A multi-device run (`trainer.devices` x `trainer.num_nodes` > 1) launches its ranks first, with Lightning
Fabric's launcher (the same one the Trainer uses, so the Trainers created later find the processes and the
process group already there). From then on every rank holds the teacher and the student on its own device,
and the per-layer work (calibration, retention scoring) is split across ranks and exchanged, so no rank
idles while another computes. A one-device run gets `Ranks()` with no process group: nothing changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

T = TypeVar("T")


def world_size(trainer_cfg) -> int:
    """Processes a `trainer` node asks for: devices per node x nodes (`devices: -1` = every visible GPU)."""
    devices = trainer_cfg.devices
    if isinstance(devices, int) and devices > 0:
        per_node = devices
    elif isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        per_node = len(devices)
    else:
        per_node = max(torch.cuda.device_count(), 1) if trainer_cfg.accelerator in ("gpu", "cuda") else 1
    return per_node * int(trainer_cfg.num_nodes)


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


def launch(trainer_cfg) -> Ranks:
    """Start the run's processes (rank 0 launches the others, which run the same command) and join the
    process group; a one-device trainer starts nothing."""
    world = world_size(trainer_cfg)
    accelerator = str(trainer_cfg.accelerator)
    if world == 1:
        return Ranks(device=single_device(accelerator))
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=accelerator, devices=trainer_cfg.devices, num_nodes=int(trainer_cfg.num_nodes),
                    strategy="ddp")
    fabric.launch()
    ranks = Ranks(fabric.global_rank, fabric.world_size, fabric.device)
    log.info("rank %d of %d on %s", ranks.rank, ranks.world_size, ranks.device)
    return ranks


def split_work(ranks: Ranks, items: list, work: Callable[[object], T]) -> dict:
    """{item: work(item)} for every item, each computed by one rank (its `share`) and gathered on all ranks.
    `work` must return picklable values."""
    return ranks.merge({item: work(item) for item in ranks.share(items)})


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of its run (Lightning records the rank once the ranks are launched)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0
