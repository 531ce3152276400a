"""`trainer`, `logger`, `paths`: where and how a run works (conf/trainer/, conf/logger/, conf/paths/). Whether the
machine has what the trainer asks for (GPUs, bfloat16) is checked by `tcal.preflight`, not here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tcal.settings.fields import (
    EVALUATION,
    INIT,
    NOTHING,
    SCORES,
    TRAIN,
    Key,
    SettingError,
    Settings,
    bad,
    bound,
    declared,
    is_int,
    one_of,
    positive_int,
    setting,
)

PRECISIONS = ("16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true", "64-true", "32", "16", "bf16", "64",
              "transformer-engine", "transformer-engine-float16")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LOGGERS = ("none", "csv", "wandb")
GDN_KERNELS = ("auto", "fla", "torch")  # tcal.student.stack: which is right on a machine's GPU stack
STRATEGIES = ("auto", "ddp", "fsdp")  # what tcal runs and resumes (docs/scale.md)


def device_list(key: str, devices) -> None:
    """What Lightning takes for `devices`: a count >= 1, -1 or "auto" (all), or a non-empty list of device ids."""
    if isinstance(devices, str) and devices.strip() in ("auto", "-1"):
        return
    if isinstance(devices, str):
        parts = [p.strip() for p in devices.split(",") if p.strip()]
        ids = [int(p) for p in parts if p.isdigit()]
        ok = len(ids) == len(parts) > 0 and (len(ids) > 1 or devices.strip().endswith(",") or ids[0] >= 1)
    elif isinstance(devices, (list, tuple)):
        ids = list(devices)
        ok = bool(ids) and all(is_int(i) and i >= 0 for i in ids) and len(set(ids)) == len(ids)
    else:
        ok = is_int(devices) and (devices >= 1 or devices == -1)
    if not ok:
        raise bad(key, devices, "a number of devices >= 1, -1 or auto (every device), or a non-empty list of device "
                                "ids such as [0,1]")


def strategy_name(key: str, value) -> None:
    if str(value).startswith("deepspeed"):
        raise SettingError(Key(key), f"={value!r}: DeepSpeed is not supported (its resume and export were never "
                           f"tested; docs/scale.md); expected trainer=fsdp for sharded training")
    one_of(STRATEGIES, as_text=True)(key, value)


@declared
@dataclass
class TrainerSettings(Settings):
    """Lightning Trainer settings of the training stages and the evaluation; also the device of the init."""

    schema = "trainer/trainer"

    accelerator: str = setting("cpu", affects=[SCORES, INIT, TRAIN, *EVALUATION],
                               check=one_of(ACCELERATORS, as_text=True))
    # a count, a list of device ids, -1 or "auto"
    devices: Any = setting(1, affects=[TRAIN, *EVALUATION], check=device_list)
    num_nodes: int = setting(1, affects=[TRAIN, *EVALUATION], check=positive_int)
    # auto (one device) | ddp | fsdp (FSDP2, tcal.training.run.ShardedStrategy)
    strategy: str = setting("auto", affects=[TRAIN], check=strategy_name)
    precision: str = setting("32-true", affects=[TRAIN, *EVALUATION], check=one_of(PRECISIONS, as_text=True))
    deterministic: bool = setting(False, affects=[TRAIN])
    # the GDN delta rule's multi-token kernel on CUDA: auto (fla where the stack is safe for it, else refused before
    # any work), fla, or torch (tcal's chunk path: correct everywhere, slower); docs/gpu.md, "The stack check"
    gdn_kernel: str = setting("auto", affects=[SCORES, INIT, TRAIN, *EVALUATION],
                              check=one_of(GDN_KERNELS, as_text=True))

    def check(self) -> None:
        if self.accelerator == "cpu" and not (is_int(self.devices) and self.devices >= 1):
            raise bad("devices", self.devices, "a number of CPU processes >= 1 with trainer.accelerator=cpu (a list "
                                               "of device ids, -1 and auto name GPUs)")
        if self.accelerator == "cpu" and (str(self.precision) in ("16-mixed", "16")
                                          or str(self.precision).startswith("transformer-engine")):
            raise SettingError(Key("precision"), f"={self.precision!r} is not supported on the CPU; expected "
                               f"32-true, bf16-mixed or bf16-true")

    @property
    def wants_gpu(self) -> bool:
        return str(self.accelerator) in ("gpu", "cuda")

    @property
    def mixed(self) -> bool:
        """Mixed precision: float32 weights (and optimizer states), reduced-precision compute."""
        return str(self.precision).endswith("-mixed")


@declared
@dataclass
class LoggerSettings(Settings):
    """Where metrics go: `csv` (RUN_DIR/logs/metrics.csv), `wandb` (`project`, runs grouped by `group`, or by the
    run's init mode when it is null), `none`."""

    schema = "logger/logger"

    name: str = setting("csv", affects=NOTHING, check=one_of(LOGGERS))
    project: Optional[str] = setting(None, affects=NOTHING)
    group: Optional[str] = setting(None, affects=NOTHING)


folder = bound(lambda v: bool(str(v).strip()), "a folder (an empty path would be the working folder itself)")


@declared
@dataclass
class PathsSettings(Settings):
    """Where runs (`output_dir`) and the shared caches (`cache_dir`) go, relative to the working directory."""

    schema = "paths/paths"

    output_dir: str = setting("outputs", affects=NOTHING, check=folder)
    cache_dir: str = setting(".cache/tcal", affects=NOTHING, check=folder)
