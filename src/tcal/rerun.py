"""Runs and their folders: which run a folder holds, what may change when a run continues, and whether its
checkpoints can be read.

- One folder, one config. A run or sweep folder holding a run of another config is refused with one line
  naming the folder and the keys that differ (`FolderInUse`), never written over or beside: a rerun of a sweep
  into its folder stays a rerun, and no result is lost. A record that failed before any work (a bad setting of
  a sweep job) holds no result and takes the new config.
- One folder, one live run. A run holds its folder while it works (`holding_folder`: a lock file,
  `.tcal-run.lock`, naming its pid and host, removed when it ends); a second run into it (the same command
  twice, a SLURM requeue while the old job lives) is refused with one line naming the holder, and writes nothing there. A hold left by
  a process that died is no hold: the next run takes it over.
- Keys safe to change on resume (`SAFE_ON_RESUME`) do not change the result: where outputs and caches live,
  whether caches are used, the metrics logger, whether the student is exported. A resume or rerun that changes
  any other key of the recorded run is refused; the safe ones take their new values.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from pathlib import Path

from omegaconf import OmegaConf

from tcal.errors import DamagedCheckpoint, FolderInUse
from tcal.locks import describe_holder, holder_of, locked
from tcal.settings import group_options, leaf_items

SAFE_ON_RESUME = ("resume", "task_name", "paths.*", "logger.*", "save_student", "*.cache", "*.cache_tokens")
SHOWN = 4  # differing keys named in a message
RUN_LOCK = ".tcal-run.lock"


def is_safe(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in SAFE_ON_RESUME)


def differing_keys(recorded: dict, current: dict, keys=None) -> list[tuple[str, object, object]]:
    """(key, recorded value, current value) of every key (of `keys`, default all) whose values differ and that is
    not safe to change; a key missing on one side has the value None there."""
    old, new = leaf_items(recorded), leaf_items(current)
    keys = sorted(set(old) | set(new) if keys is None else keys)
    return [(k, old.get(k), new.get(k)) for k in keys if not is_safe(k) and old.get(k) != new.get(k)]


def describe(differences: list[tuple[str, object, object]]) -> str:
    shown = ", ".join(f"{k}={new!r} (that run: {old!r})" for k, old, new in differences[:SHOWN])
    more = len(differences) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def holds_work(record: dict) -> bool:
    """Whether a record is more than a failure before any work."""
    return not (record.get("status") == "failed" and record.get("failed_after") is None)


def folder_state(run_dir: Path, record: dict | None, config: dict) -> str:
    """What `run_dir` holds for `config` (resolved): "none" (nothing, or a record without work), "complete" or
    "unfinished"; a run of another config there raises FolderInUse."""
    if record is None or not holds_work(record) and record.get("config") != config:
        return "none"
    differences = differing_keys(record.get("config") or {}, config)
    if differences:
        raise FolderInUse(f"{run_dir} holds a run of another config ({describe(differences)}); expected an empty "
                          f"folder or one of this config: pass another hydra.run.dir / hydra.sweep.dir")
    return "complete" if record.get("status") == "complete" else "unfinished"


def override_key(override: str) -> str | None:
    """The key or group a command-line override names (`+a.b=1` -> a.b); None for Hydra's own settings."""
    key = override.lstrip("+~").split("=", 1)[0].split("@")[0]
    return None if key == "hydra" or key.startswith(("hydra.", "hydra/")) else key


def selected_groups(overrides: list[str]) -> list[str]:
    """The config groups (as dotted nodes) that `group=option` overrides select."""
    keys = [override_key(o) for o in overrides]
    return [k.replace("/", ".") for k in keys if k and group_options(k) is not None]


def overridden_keys(overrides: list[str], cfg) -> set[str]:
    """The keys of `cfg` that command-line `overrides` name: `key=value` names key; `group=option` names
    the group's `name` (or all its keys)."""
    keys = set()
    for key in filter(None, map(override_key, overrides)):
        dotted = key.replace("/", ".")
        if group_options(key) is None:
            keys.add(dotted)
            continue
        node = OmegaConf.select(cfg, dotted, default=None)
        if OmegaConf.is_dict(node):
            keys |= {f"{dotted}.name"} if "name" in node else {f"{dotted}.{k}" for k in leaf_items(
                OmegaConf.to_container(node, resolve=True))}
    return keys


def resume_config(run_dir: Path, recorded, cfg, defaults, overrides: list[str]):
    """The recorded config of the run in `run_dir`, with the safe overrides of this command applied. `cfg` is
    the config this command composed, `defaults` the one without overrides: a key counts as overridden when the
    command names it or when its value differs from the default (an experiment's keys; a group selected on the
    command line counts by its name, not by its default values). Any other change is refused: a resumed run
    continues with the settings it was started with."""
    current = OmegaConf.to_container(cfg, resolve=True)
    default = leaf_items(OmegaConf.to_container(defaults, resolve=True))
    selected = tuple(f"{group}." for group in selected_groups(overrides))
    touched = overridden_keys(overrides, cfg) | {k for k, v in leaf_items(current).items()
                                                 if default.get(k) != v and not k.startswith(selected)}
    recorded_values = OmegaConf.to_container(recorded, resolve=True)
    differences = differing_keys(recorded_values, current, touched)
    if differences:
        raise FolderInUse(f"resume={run_dir}: the run was started with other settings ({describe(differences)}); "
                          f"expected only keys safe to change on resume ({', '.join(SAFE_ON_RESUME)})")
    current_values, old_values = leaf_items(current), leaf_items(recorded_values)
    for key in sorted(touched):
        if key in current_values and current_values[key] != old_values.get(key):
            OmegaConf.update(recorded, key, current_values[key], force_add=True)
    return recorded


def checkpoint_progress(path: Path) -> dict:
    """{"step", "tokens_seen"} of a stage checkpoint (read lazily); DamagedCheckpoint naming it when it cannot
    be read. A sharded checkpoint (`trainer=fsdp`) is a folder: its progress is in its `meta.pt`."""
    path = Path(path)
    import torch

    try:
        checkpoint = (torch.load(path / "meta.pt", map_location="cpu", weights_only=True) if path.is_dir() else
                      torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        return {"step": int(checkpoint["global_step"]), "tokens_seen": int(checkpoint["tcal"]["tokens_seen"])}
    except Exception as err:  # noqa: BLE001 - whatever fails, the file is not a checkpoint of ours
        cause = " ".join(str(err).split()).split(". ")[0][:200]
        raise DamagedCheckpoint(f"checkpoint {path} cannot be read ({type(err).__name__}: {cause}); expected a "
                                f"whole checkpoint: restore it, or delete it to train its stage again from the "
                                f"start") from None


def check_checkpoints(run_dir: Path) -> None:
    """Every stage checkpoint of `run_dir` can be read: a resume fails before any work otherwise."""
    for path in sorted((Path(run_dir) / "checkpoints").glob("*/last.ckpt")):
        checkpoint_progress(path)


@contextlib.contextmanager
def holding_folder(run_dir: Path):
    """Hold `run_dir` for this run; FolderInUse naming the holder when a live run holds it."""
    lock = Path(run_dir) / RUN_LOCK
    with locked(lock, wait=False, remove=True) as held:
        if not held:
            raise FolderInUse(f"{run_dir} is in use by a live run: {describe_holder(holder_of(lock))}; expected one "
                              f"run per folder: wait for it to end or stop it, or pass another hydra.run.dir / "
                              f"hydra.sweep.dir")
        yield


def holds_folder(run):
    """Decorate `run(cfg, run_dir, ..., ranks=None)`: rank 0 holds `run_dir` while the run works."""
    @functools.wraps(run)
    def wrapper(cfg, run_dir, *args, **kwargs):
        ranks = kwargs.get("ranks")
        with holding_folder(Path(run_dir)) if ranks is None or ranks.is_main else contextlib.nullcontext():
            return run(cfg, run_dir, *args, **kwargs)

    return wrapper
