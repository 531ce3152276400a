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
- What may change when a run continues is declared on the settings' fields (`tcal.settings.fields`): a field
  that changes nothing (where outputs and caches live, whether caches are used, the metrics logger, whether the
  student is exported) takes the new value; a resume or rerun that changes any other setting of the recorded run
  is refused, naming it.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from tcal.errors import ConfigError, DamagedCheckpoint, FolderHeld, FolderInUse
from tcal.settings import RunSettings
from tcal.settings.relevance import differences, leaves, with_values
from tcal.store.locks import describe_holder, holder_of, locked

SHOWN = 4  # differing keys named in a message
RUN_LOCK = ".tcal-run.lock"
SAFE = "only settings that change nothing (paths, logger, save_student, task_name, cache switches)"


def describe(diffs: list[tuple[str, object, object]]) -> str:
    shown = ", ".join(f"{k}={new!r} (that run: {old!r})" for k, old, new in diffs[:SHOWN])
    more = len(diffs) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def holds_work(record: dict) -> bool:
    """Whether a record is more than a failure before any work."""
    return not (record.get("status") == "failed" and record.get("failed_after") is None)


def recorded_settings(run_dir: Path, record: dict) -> RunSettings:
    """The settings a record's run was started with; FolderInUse when they cannot be read (another tcal's)."""
    from tcal.settings.conversion import run_settings

    try:
        return run_settings(record.get("config") or {})
    except ConfigError as err:
        raise FolderInUse(f"{run_dir} holds a run whose settings this tcal cannot read ({err}); expected an empty "
                          f"folder or one of this config: pass another hydra.run.dir / hydra.sweep.dir") from None


def folder_state(run_dir: Path, record: dict | None, settings: RunSettings) -> str:
    """What `run_dir` holds for `settings`: "none" (nothing, or a record without work), "complete" or
    "unfinished"; a run of other settings there raises FolderInUse."""
    if record is None or not holds_work(record) and record.get("config") != settings.tree():
        return "none"
    diffs = differences(recorded_settings(run_dir, record), settings)
    if diffs:
        raise FolderInUse(f"{run_dir} holds a run of another config ({describe(diffs)}); expected an empty "
                          f"folder or one of this config: pass another hydra.run.dir / hydra.sweep.dir")
    return "complete" if record.get("status") == "complete" else "unfinished"


def resumed_settings(run_dir: Path, record: dict, current: RunSettings, defaults: RunSettings,
                     chosen_groups: tuple[str, ...] = (), named: tuple[str, ...] = ()) -> RunSettings:
    """The settings of the run recorded in `run_dir`, continued with what this command sets. `current` is what the
    command composed and `defaults` what no override composes. A setting the command does not set keeps the run's
    recorded value (its teacher's name, task name, logger, paths): a bare `tcal resume=DIR` continues the run as
    it was. A setting it sets (`commanded_keys`) is honoured when it changes nothing and refused, naming it, when it
    changes the run's result or evaluation."""
    recorded = recorded_settings(run_dir, record)
    commanded = commanded_keys(current, defaults, chosen_groups, named)
    diffs = [d for d in differences(recorded, current) if d[0] in commanded]
    if diffs:
        raise FolderInUse(f"resume={run_dir}: the run was started with other settings "
                          f"({describe(by_option(diffs, chosen_groups))}); expected {SAFE} to change on resume")
    return with_values(recorded, current, commanded)


def commanded_keys(current: RunSettings, defaults: RunSettings, chosen_groups: tuple[str, ...] = (),
                   named: tuple[str, ...] = ()) -> set[str]:
    """The dotted keys a command sets: those it changed from their defaults (an override, an experiment's key), every
    key of a config group it chooses (`chosen_groups`, dotted: `eval.harness`; a group counts by everything its
    option holds, so `trainer=ddp` sets `trainer.devices`), and the keys it names (`named`)."""
    every = ("result", "eval", "none")
    commanded = {key for key, _, _ in differences(defaults, current, counted=every)}
    for group in chosen_groups:
        commanded |= {key for key in leaves(current) if key.startswith(f"{group}.")}
    return commanded | set(named)


def by_option(diffs: list[tuple[str, object, object]], chosen_groups: tuple[str, ...]) -> list:
    """`diffs` with those inside a chosen group whose option's name differs told once, as that name."""
    renamed = [group for group in chosen_groups if any(d[0] == f"{group}.name" for d in diffs)]
    return [d for d in diffs if d[0] in (f"{g}.name" for g in renamed) or not d[0].startswith(
        tuple(f"{g}." for g in renamed))]


def check_same_inputs(run_dir: Path, changed: list[str]) -> None:
    """A run continues on the data it started with: `changed` (what differs from its record's `inputs`, in words)
    refuses it, naming what changed, before any work."""
    if changed:
        shown = ", ".join(changed[:SHOWN]) + (f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else "")
        raise FolderInUse(f"{run_dir} holds a run that read other data than this command would: {shown} changed "
                          f"since it started; expected the data it started with (put it back), or a new run of the "
                          f"new data: another hydra.run.dir, without resume=")


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


_held: set[str] = set()  # the folders this process holds (a run holds its folder once, however deep its calls)


@contextlib.contextmanager
def holding_folder(run_dir: Path):
    """Hold `run_dir` for this run; FolderInUse naming the holder when a live run holds it. Within a hold of this
    process (the pipeline's, around the library's `distill`) the folder is held already."""
    key = str(Path(run_dir).resolve())
    if key in _held:
        yield
        return
    lock = Path(run_dir) / RUN_LOCK
    with locked(lock, wait=False, remove=True) as held:
        if not held:
            raise held_by_live_run(run_dir, lock)
        _held.add(key)
        try:
            yield
        finally:
            _held.discard(key)


def held_by_live_run(run_dir: Path, lock: Path) -> FolderHeld:
    """The refusal of a folder whose lock a live run holds, naming the holder."""
    return FolderHeld(f"{run_dir} is in use by a live run: {describe_holder(holder_of(lock))}; expected one run per "
                      f"folder: wait for it to end or stop it, or pass another hydra.run.dir / hydra.sweep.dir")


def check_not_held(run_dir: Path) -> None:
    """FolderInUse naming the holder when a live run holds `run_dir` now: said before this command announces
    anything about the folder (the run itself takes the hold, `holding_folder`)."""
    lock = Path(run_dir) / RUN_LOCK
    if str(Path(run_dir).resolve()) in _held or not lock.exists():
        return
    with locked(lock, wait=False, remove=True) as held:
        if not held:
            raise held_by_live_run(run_dir, lock)


def check_student_saved(run_dir: Path, record: dict | None, settings: RunSettings) -> None:
    """A complete run asked again with `save_student=true` whose student was never saved: nothing can export it
    (a zero-shot run keeps no weights), so it is one line rather than a silent "nothing to do"."""
    if settings.save_student and record is not None and not record.get("student_path"):
        raise ConfigError(f"{run_dir} holds this run, complete, without its student (it ran with save_student=false): "
                          f"save_student=true has nothing to export there; expected another hydra.run.dir to run it "
                          f"again with its student saved")


def holds_folder(run):
    """Decorate `run(settings, run_dir, ..., ranks=None)`: rank 0 holds `run_dir` while the run works."""
    @functools.wraps(run)
    def wrapper(settings, run_dir, *args, **kwargs):
        ranks = kwargs.get("ranks")
        with holding_folder(Path(run_dir)) if ranks is None or ranks.is_main else contextlib.nullcontext():
            return run(settings, run_dir, *args, **kwargs)

    return wrapper
