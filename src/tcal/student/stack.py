"""The GPU software stack a run meets, and which delta-rule kernel is right on it, decided before any work.

fla's chunked kernels are Triton code, and some stacks compute them wrong. fla 0.6.0 itself refuses one (Hopper GPUs
with Triton >= 3.4.0, < 3.7.1), but only at the first backward: after the teacher load and the calibration forward.
`gdn_kernel_for` reads the facts fla reads, up front (nothing is compiled): the version of the `triton` module fla
imports, whichever distribution installed it, compared as fla compares it (`packaging.version`, so 3.7.1rc1 is below
3.7.1); the device as fla's `IS_NVIDIA_HOPPER` sees it (NVIDIA only: a name with "NVIDIA H" or compute capability
9.x); and whether fla's backend dispatch can send the backward to TileLang or FlashQLA. It judges them against
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

from packaging.version import InvalidVersion, Version

from tcal.errors import ConfigError
from tcal.settings.trainer import GDN_KERNELS

log = logging.getLogger(__name__)

FLA_CHECKED = "0.6.0"  # the fla version `FLA_RULES` was written against (constraints.txt pins it)
TORCH_PATH_FIX = "trainer.gdn_kernel=torch (tcal's torch chunk path on CUDA: correct, slower)"


@dataclass(frozen=True)
class Stack:
    """What decides whether fla's kernels are right here, as fla reads it. `triton`: the importable `triton` module's
    `__version__` (None: not importable), whatever distribution installed it; `fla`: the version of the distribution
    that installed the `fla` module (None: not installed); `capability`: the current CUDA device's compute
    capability (None without one); `device_name`: device 0's name; `platform`: Triton's backend, `cuda` (NVIDIA) or
    `hip` (AMD ROCm, where torch also says CUDA). `tilelang` / `flash_qla`: fla's backend dispatch can send the
    gated backward to TileLang / the whole GDN to FlashQLA (package importable, not switched off, fla's own test of
    an nvcc for TileLang, dispatch not disabled by FLA_DISABLE_BACKEND_DISPATCH=1)."""

    torch: str
    triton: str | None
    fla: str | None
    capability: tuple[int, int] | None = None
    device_name: str | None = None
    tilelang: bool = False
    platform: str = "cuda"
    flash_qla: bool = False

    def describe(self) -> str:
        device = f"{self.device_name} (compute capability {self.capability[0]}.{self.capability[1]}" \
                 f"{', ROCm' if self.platform == 'hip' else ''})" if self.capability else "no CUDA device"
        routes = "".join(f", {name} usable" for name, usable in (("TileLang", self.tilelang),
                                                                 ("FlashQLA", self.flash_qla)) if usable)
        return f"{device}, torch {self.torch}, Triton {self.triton or 'not installed'}, " \
               f"fla {self.fla or 'not installed'}{routes}"


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


def parsed_version(version: str | None) -> Version | None:
    """`version` as fla compares it (`packaging.version.Version`); None when missing or not a version."""
    try:
        return Version(version) if version else None
    except InvalidVersion:
        return None


def at_least(version: str | None, floor: str) -> bool:
    """fla's `package_version.parse(version) >= package_version.parse(floor)`: a pre-release of `floor` is below it,
    a local build (`+git...`) of it is not."""
    found = parsed_version(version)
    return found is not None and found >= Version(floor)


def is_nvidia_hopper(stack: Stack) -> bool:
    """fla 0.6.0's `IS_NVIDIA_HOPPER` (fla/utils/hardware.py): Triton's backend is `cuda` and device 0's name holds
    "NVIDIA H" or the device's compute capability is 9.x."""
    return stack.platform == "cuda" and stack.capability is not None and (
        "NVIDIA H" in (stack.device_name or "") or stack.capability[0] == 9)


def _hopper_broken_backward(stack: Stack) -> bool:
    """fla's guard in `chunk_bwd_dqkwg` would be reached: Hopper, TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1,
    and its dispatch has no TileLang backend to send the backward to."""
    return (is_nvidia_hopper(stack) and not stack.tilelang and at_least(stack.triton, "3.4.0")
            and not at_least(stack.triton, "3.7.1"))


HOPPER_PROBLEM = ("Triton >= 3.4.0 and < 3.7.1 (compared as fla compares versions: a pre-release of 3.7.1 is below "
                  "it) computes fla's gated chunk backward (dq, dk, dg, dbeta) wrong on Hopper GPUs")
HOPPER_FIX = ("torch >= 2.12.1 (it ships Triton 3.7.1), Triton >= 3.7.1, or TileLang installed (pip install tilelang; "
              "it needs an nvcc)")
HOPPER_SOURCE = ("fla 0.6.0 fla/ops/common/chunk_o.py (chunk_bwd_dqkwg), fla/utils/hardware.py (IS_NVIDIA_HOPPER); "
                 "github.com/fla-org/flash-linear-attention/issues/640")


FLA_RULES: tuple[StackRule, ...] = (
    StackRule(lambda s: s.fla is None,
              "fla is not installed (no module `fla`), so there is no fla kernel",
              f"fla-core=={FLA_CHECKED} installed (it brings Triton)", "constraints.txt", hard=True),
    StackRule(lambda s: s.triton is None,
              "Triton is not importable (no module `triton`, under whichever distribution), and fla imports it",
              f"the Triton your torch ships (pip install fla-core=={FLA_CHECKED} brings it)",
              "fla 0.6.0 fla/utils/env.py (import triton)", hard=True),
    StackRule(lambda s: parsed_version(s.triton) is None,
              "fla cannot read this Triton's version: `import fla` parses triton.__version__ with packaging and "
              "raises InvalidVersion",
              "a Triton whose __version__ is a PEP 440 version (the one your torch ships)",
              "fla 0.6.0 fla/utils/env.py (TRITON_ABOVE_3_4_0)", hard=True),
    StackRule(lambda s: _hopper_broken_backward(s) and not s.flash_qla,
              f"{HOPPER_PROBLEM}, and fla refuses it at the first backward", HOPPER_FIX, HOPPER_SOURCE, hard=True),
    StackRule(lambda s: _hopper_broken_backward(s) and s.flash_qla,
              f"{HOPPER_PROBLEM}; fla sends the whole GDN to FlashQLA only for float16/bfloat16 q, k, v with head_dim "
              f"128 (its verifier), and refuses any other call at the first backward",
              f"{HOPPER_FIX}; trainer.gdn_kernel=fla where every GDN layer is 16-bit with head_dim 128",
              f"{HOPPER_SOURCE}; fla/ops/gated_delta_rule/backends/flash_qla.py", hard=False),
    StackRule(lambda s: s.fla is not None and (parsed_version(s.fla) is None
                                               or version_tuple(s.fla) != version_tuple(FLA_CHECKED)),
              f"this table was checked against fla {FLA_CHECKED} only",
              f"fla-core=={FLA_CHECKED}, trainer.gdn_kernel=fla to run this fla unchecked",
              "constraints.txt", hard=False),
    StackRule(lambda s: not at_least(s.torch, "2.7.0") or not at_least(s.triton, "3.3.0"),
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
    """This machine's stack as fla reads it: the `triton` module's own version (Triton is imported, as fla imports
    it; nothing is compiled), the version of whichever distribution installed `fla` (fla is not imported), device
    0's name and the compute capability of `device_index` (the current device by default)."""
    import torch

    capability = name = None
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device_index is None else device_index
        capability, name = tuple(torch.cuda.get_device_capability(index)), torch.cuda.get_device_name(0)
    return Stack(torch=torch.__version__, triton=_triton_version(), fla=_module_distribution_version("fla"),
                 capability=capability, device_name=name, tilelang=_tilelang_usable(),
                 platform="hip" if getattr(torch.version, "hip", None) else "cuda", flash_qla=_flash_qla_usable())


def _triton_version() -> str | None:
    """`triton.__version__`, the string fla parses, whichever distribution (triton, pytorch-triton, triton-nightly)
    installed the module; None where it does not import."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception as err:  # a broken Triton: fla's own import fails on it
        log.warning("Triton is installed but does not import (%s: %s)", type(err).__name__, err)
        return None
    return str(getattr(triton, "__version__", "")) or None


def _module_distribution_version(module: str) -> str | None:
    """The version of the distribution whose files hold `module`/__init__.py (fla-core, or an older
    flash-linear-attention that carried the module itself); None where the module is not installed."""
    if importlib.util.find_spec(module) is None:
        return None
    owners = importlib.metadata.packages_distributions().get(module, [])
    for distribution in dict.fromkeys(owners):
        files = importlib.metadata.files(distribution) or []
        if any(str(f).replace("\\", "/") == f"{module}/__init__.py" for f in files):
            return importlib.metadata.version(distribution)
    return importlib.metadata.version(owners[0]) if owners else "unknown"


def _dispatch_enabled(env_var: str, backend_type: str) -> bool:
    """fla 0.6.0's `BaseBackend.is_enabled` for a backend enabled by default (fla/backends.py), and its dispatch
    not switched off by FLA_DISABLE_BACKEND_DISPATCH=1."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    if os.environ.get(f"FLA_{backend_type.upper()}", "0") != "0":
        return True
    return os.environ.get(env_var, "1") != "0"


def _tilelang_usable() -> bool:
    """fla's own test for its TileLang backend: the package importable, enabled (`_dispatch_enabled`), and an nvcc
    (`fla.utils.env.has_usable_nvcc`: in CUDA_HOME, else CUDA_PATH, on PATH, from the nvidia-cuda-nvcc wheel, or in
    /usr/local/cuda)."""
    if importlib.util.find_spec("tilelang") is None or not _dispatch_enabled("FLA_TILELANG", "tilelang"):
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is not None and (Path(home) / "bin" / "nvcc").exists():
        return True
    if shutil.which("nvcc") is not None:
        return True
    try:
        if any(f.name in ("nvcc", "nvcc.exe") for f in importlib.metadata.files("nvidia-cuda-nvcc") or []):
            return True
    except importlib.metadata.PackageNotFoundError:
        pass
    return (Path("/usr/local/cuda") / "bin" / "nvcc").exists()


def _flash_qla_usable() -> bool:
    """fla's FlashQLA backend can take calls: the package importable and enabled (FLA_FLASH_QLA)."""
    return importlib.util.find_spec("flash_qla") is not None and _dispatch_enabled("FLA_FLASH_QLA", "flash_qla")
