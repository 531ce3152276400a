"""The GPU software stack a run meets, and which delta-rule kernel is right on it, decided before any work.

fla's chunked kernels are Triton code, and some stacks compute them wrong. fla 0.6.0 itself refuses one (Hopper GPUs
with Triton >= 3.4.0, < 3.7.1), but only at the first backward: after the teacher load and the calibration forward.
`gdn_kernel_for` reads the same facts up front, from package metadata and the device (nothing is compiled), against
`FLA_RULES`: the table of docs/gpu.md, "The stack check", each row with its source.

    trainer.gdn_kernel=auto   fla where no row applies; a stack a row names is refused in one line naming the fix
    trainer.gdn_kernel=fla    fla; refused only where fla itself would refuse (a `hard` row), else a warning
    trainer.gdn_kernel=torch  tcal's torch chunk path (`tcal.student.gdn_torch.chunk_gated_delta_rule_torch`): correct
                              on every device, slower on CUDA
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from packaging.version import Version

from tcal.errors import ConfigError
from tcal.settings.trainer import GDN_KERNELS

log = logging.getLogger(__name__)

FLA_CHECKED = "0.6.0"  # the fla version `FLA_RULES` was written against (constraints.txt pins it)
TORCH_PATH_FIX = "trainer.gdn_kernel=torch (tcal's torch chunk path on CUDA: correct, slower)"


@dataclass(frozen=True)
class Stack:
    """What decides whether fla's kernels are right here. Versions are package versions (None: not installed);
    `capability` is the CUDA device's compute capability (None without one); `tilelang`: fla can route its gated
    backward to TileLang (tilelang installed, not disabled by FLA_TILELANG=0, an nvcc found: fla's own test)."""

    torch: str
    triton: str | None
    fla: str | None
    capability: tuple[int, int] | None = None
    device_name: str | None = None
    tilelang: bool = False

    def describe(self) -> str:
        device = f"{self.device_name} (compute capability {self.capability[0]}.{self.capability[1]})" \
            if self.capability else "no CUDA device"
        return f"{device}, torch {self.torch}, Triton {self.triton or 'not installed'}, " \
               f"fla {self.fla or 'not installed'}{', TileLang usable' if self.tilelang else ''}"


@dataclass(frozen=True)
class StackRule:
    """One row of the table: the stacks it covers, what goes wrong there, the fix, and where that is written.
    `hard`: fla itself raises on such a stack (so `fla` is refused too); otherwise the stack is outside what fla
    supports or what this table was checked against (`auto` refuses, `fla` warns)."""

    applies: Callable[[Stack], bool]
    problem: str
    fix: str
    source: str
    hard: bool


def version_tuple(version: str | None) -> tuple[int, ...]:
    """(3, 7, 1) of "3.7.1", "3.7.1rc1" or "3.7.1+git..."; (2, 11, 0) of "2.11.0+cu130"; () for None."""
    return Version(version).release if version else ()


def _hopper_broken_backward(stack: Stack) -> bool:
    return (stack.capability is not None and stack.capability[0] == 9 and not stack.tilelang
            and (3, 4, 0) <= version_tuple(stack.triton) < (3, 7, 1))


FLA_RULES: tuple[StackRule, ...] = (
    StackRule(lambda s: s.fla is None or s.triton is None,
              "fla-core or Triton is not installed, so there is no fla kernel",
              f"fla-core=={FLA_CHECKED} installed (it brings Triton)", "constraints.txt", hard=True),
    StackRule(_hopper_broken_backward,
              "Triton >= 3.4.0 and < 3.7.1 computes fla's gated chunk backward (dq, dk, dg, dbeta) wrong on Hopper "
              "GPUs, and fla refuses it at the first backward",
              "torch >= 2.12.1 (it ships Triton 3.7.1), Triton >= 3.7.1, or TileLang installed (pip install tilelang; "
              "it needs an nvcc)",
              "fla 0.6.0 fla/ops/common/chunk_o.py (chunk_bwd_dqkwg); "
              "github.com/fla-org/flash-linear-attention/issues/640", hard=True),
    StackRule(lambda s: s.fla is not None and version_tuple(s.fla) != version_tuple(FLA_CHECKED),
              f"this table was checked against fla {FLA_CHECKED} only",
              f"fla-core=={FLA_CHECKED}, trainer.gdn_kernel=fla to run this fla unchecked",
              "constraints.txt", hard=False),
    StackRule(lambda s: version_tuple(s.torch) < (2, 7, 0) or (s.triton is not None
                                                                and version_tuple(s.triton) < (3, 3, 0)),
              "below fla-core 0.6.0's CUDA requirements (torch >= 2.7.0, Triton >= 3.3; fla warns that errors on "
              "older Triton will not be fixed)",
              "torch >= 2.7.0 with the Triton it ships",
              "fla-core 0.6.0 package metadata (extra `cuda`), fla/utils/env.py", hard=False),
)


def gdn_kernel_for(choice: str, on_cuda: bool, stack: Stack | None = None) -> str:
    """`fla` or `torch`: the kernel the delta rule's multi-token calls use on this process's device, or a one-line
    ConfigError naming the stack, what goes wrong on it and the fix. Off CUDA it is `torch` (fla's Triton kernels
    need a GPU), and `fla` asked there is refused."""
    if choice not in GDN_KERNELS:
        raise ConfigError(f"trainer.gdn_kernel={choice!r}; expected one of {', '.join(GDN_KERNELS)}")
    if choice == "torch":
        return "torch"
    if not on_cuda:
        if choice == "fla":
            raise ConfigError("trainer.gdn_kernel='fla' needs a CUDA device (fla's Triton kernels do not run on a "
                              "CPU); expected trainer.gdn_kernel=auto or torch here")
        return "torch"
    stack = stack or read_stack()
    for rule in FLA_RULES:
        if not rule.applies(stack):
            continue
        if rule.hard or choice == "auto":
            raise ConfigError(f"trainer.gdn_kernel={choice}: {stack.describe()}: {rule.problem} ({rule.source}); "
                              f"expected {rule.fix}, or {TORCH_PATH_FIX}")
        log.warning("trainer.gdn_kernel=fla on %s: %s (%s); running fla as asked", stack.describe(), rule.problem,
                    rule.source)
    return "fla"


@functools.lru_cache(maxsize=None)
def read_stack(device_index: int | None = None) -> Stack:
    """This machine's stack, from package metadata and the CUDA device (`device_index`, the current one by default);
    nothing is imported from Triton or fla, so reading it compiles nothing."""
    import torch

    capability = name = None
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device_index is None else device_index
        capability, name = tuple(torch.cuda.get_device_capability(index)), torch.cuda.get_device_name(index)
    return Stack(torch=torch.__version__, triton=_installed("triton"), fla=_installed("fla-core"),
                 capability=capability, device_name=name, tilelang=_tilelang_usable())


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tilelang_usable() -> bool:
    """fla's own test for its TileLang backend: the package, not switched off by FLA_TILELANG=0, and an nvcc in
    CUDA_HOME / CUDA_PATH, on PATH, from the nvidia-cuda-nvcc wheel, or in /usr/local/cuda."""
    if importlib.util.find_spec("tilelang") is None:
        return False
    if os.environ.get("FLA_TILELANG") == "0":
        return False
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if any(home and (Path(home) / "bin" / "nvcc").exists() for home in homes) or shutil.which("nvcc"):
        return True
    try:
        return any(f.name == "nvcc" for f in importlib.metadata.files("nvidia-cuda-nvcc") or [])
    except importlib.metadata.PackageNotFoundError:
        return False
