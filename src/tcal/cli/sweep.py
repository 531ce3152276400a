"""Sweeps (`tcal -m`) in which every job stands alone.

A job that fails (a bad setting, a refused folder, divergence, a crash) does not stop the sweep: it is recorded
in its own folder (results.json with status "failed" and the error; a record already there keeps what it held,
and a folder holding a run of another config is not touched), logged, and listed in
`<sweep dir>/failed_jobs.jsonl`. When the sweep ends, `SweepSummary` (a Hydra callback, conf/config.yaml)
prints one line per failed job and `tcal` exits with code 1.

A signal (`tcal.runtime.signals`) stops the whole sweep instead: the job it stopped is recorded as interrupted, and the
summary lists that job and every job of the sweep that did not run (also in `failed_jobs.jsonl`, with the error
`not run: ...`), so a scheduler never reads an interrupted sweep as a successful one; `tcal` exits with 128 + the
signal's number. The same command again skips the finished jobs and continues the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from tcal.store.files import write_text_atomic

log = logging.getLogger(__name__)

FAILURES = "failed_jobs.jsonl"
_failed: list[dict] = []  # the failed jobs of the sweep that ended last in this process
_mine: list[dict] = []  # the jobs that failed in the sweep running in this process (not another sweep's, same folder)
_planned: list[list[str]] = []  # every job's overrides, in order, of the sweep running in this process


def in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def add_failure_lines(sweep_dir: Path, lines: list[dict]) -> None:
    with open(Path(sweep_dir) / FAILURES, "a", encoding="utf-8") as handle:
        handle.writelines(json.dumps(line) + "\n" for line in lines)


def record_job_failure(cfg, run_dir: Path, err: BaseException) -> None:
    """The failed job's record in its folder (when it has none yet), its log, and its line in the sweep's list."""
    from hydra.core.hydra_config import HydraConfig

    from tcal.cli.rank import RankFailed
    from tcal.errors import ConfigError, Divergence, FolderHeld
    from tcal.runtime.distributed import is_rank_zero
    from tcal.runtime.signals import as_interrupt
    from tcal.store.record import RESULTS, describe, record_failure

    if not (Path(run_dir) / RESULTS).exists():
        record_failure(run_dir, err, job_config(cfg), create=True)
    if isinstance(err, (ConfigError, Divergence, RankFailed)) or as_interrupt(err):  # a failed rank logged its own traceback
        log.error("job failed: %s", describe(err))
    else:
        log.exception("job failed: %s", describe(err))
    if not is_rank_zero():  # ranks started from outside (SLURM tasks) run the job each: rank 0 lists it
        return
    hydra = HydraConfig.get()
    line = {"job": hydra.job.num, "overrides": list(hydra.overrides.task), "folder": str(run_dir),
            "error": describe(err), "held": isinstance(err, FolderHeld)}
    _mine.append(line)
    add_failure_lines(Path(hydra.sweep.dir), [line])


def job_config(cfg) -> dict | None:
    """What a failed job's record holds as its config: its settings, else its composed config as it resolves
    (a job refused for a bad setting has no settings), else nothing."""
    from omegaconf import OmegaConf

    from tcal.settings.conversion import run_settings

    try:
        return run_settings(cfg).tree()
    except Exception:  # noqa: BLE001 - the job failed for it; its record says why
        try:
            return OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - a config that does not resolve is recorded without it
            return None


def record_sweep_interrupt(err: BaseException, run_dir: Path) -> None:
    """The interrupted job's place in the sweep, and a `not run` line for each later job, in the sweep's list."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    job, sweep_dir = int(hydra.job.num), Path(hydra.sweep.dir)
    failed = [entry for entry in _mine if entry["job"] != job]
    later = [{"job": num, "overrides": overrides, "folder": str(sweep_dir / str(num)),
              "error": f"not run: the sweep was {err}"} for num, overrides in enumerate(_planned) if num > job]
    add_failure_lines(sweep_dir, later)
    common = set.intersection(*map(set, _planned)) if len(_planned) > 1 else set()
    err.sweep = {"job": job, "folder": str(run_dir), "sweep_dir": str(sweep_dir), "not_run": later,
                 "planned": len(_planned) or None, "common": common, "failed": failed}


@contextlib.contextmanager
def sweep_job(cfg, run_dir: Path):
    """Around one job: in a sweep, an error is recorded and the sweep goes on; a signal is recorded and stops the
    sweep (the jobs left are listed); outside a sweep everything passes."""
    from tcal.runtime.signals import Interrupted, as_interrupt

    if not in_sweep():
        yield
        return
    try:
        yield
    except Exception as err:  # noqa: BLE001 - whatever failed, the other jobs run
        record_job_failure(cfg, Path(run_dir), err)
    except (Interrupted, KeyboardInterrupt) as err:
        interrupt = as_interrupt(err)
        record_job_failure(cfg, Path(run_dir), interrupt)
        record_sweep_interrupt(interrupt, Path(run_dir))
        if interrupt is err:
            raise
        raise interrupt from None


def interrupted_lines(err) -> list[str]:
    """What `tcal` prints when a signal stopped a run or a sweep: the interrupt, then each job that did not run."""
    sweep = getattr(err, "sweep", None)
    if sweep is None:
        where = getattr(err, "run_dir", None)
        record = f" (record: {Path(where) / 'results.json'}; the same command continues it)" if where else ""
        return [f"{err}{record}"]
    total = f" of {sweep['planned']}" if sweep["planned"] else ""
    lines = [f"sweep {err} in job {sweep['job']}{total}; the same command skips finished jobs and continues"]
    lines += [f"sweep job {job['job']} failed ({job['folder']}): {job['error']}" for job in sweep["failed"]]
    lines.append(f"sweep job {sweep['job']} did not finish ({sweep['folder']}): {err}")
    lines += [f"sweep job {job['job']} did not run ({job['folder']}): "
              f"{' '.join(o for o in job['overrides'] if o not in sweep['common'])}" for job in sweep["not_run"]]
    if not sweep["planned"]:
        lines.append("sweep: the jobs after it, if any, did not run (its launcher does not list them)")
    return lines


def planned_jobs(config) -> list[list[str]]:
    """Every job's overrides, in the order Hydra's basic launcher runs them in this process (the sweeper's own
    expansion); none for another launcher or sweeper, or a sweep it cannot expand here (a glob)."""
    from hydra.errors import HydraException

    from tcal.settings.compose import sweep_jobs

    hydra = config.hydra
    if not str(hydra.sweeper.get("_target_", "")).endswith("BasicSweeper") or \
            not str(hydra.launcher.get("_target_", "")).endswith("BasicLauncher"):
        return []
    try:
        return sweep_jobs(list(hydra.overrides.task), dict(hydra.sweeper.get("params") or {}))
    except HydraException:
        return []


def done_elsewhere(job: dict) -> bool:
    """Whether a job this sweep found held by another live run was finished by that run: the sweep waits for the
    hold to end (the other run works on it), then reads the job's record."""
    from tcal.store.locks import describe_holder, locked
    from tcal.store.record import read_record
    from tcal.store.rerun import RUN_LOCK

    if not job.get("held"):
        return False

    def waiting(holder: dict) -> None:
        print(f"tcal: sweep job {job['job']} ({job['folder']}) is held by {describe_holder(holder)}; waiting for it "
              f"to end", file=sys.stderr, flush=True)

    with locked(Path(job["folder"]) / RUN_LOCK, on_wait=waiting, remove=True):
        record = read_record(Path(job["folder"]))
    return bool(record) and record.get("status") == "complete"


def failures_path(config) -> Path:
    return Path(str(config.hydra.sweep.dir)) / FAILURES


def failed_jobs() -> list[dict]:
    return list(_failed)


class SweepSummary(Callback):
    """Starts each sweep with an empty list of failed jobs; ends it with one line per failed job on stderr."""

    def on_multirun_start(self, config, **kwargs) -> None:
        failures_path(config).unlink(missing_ok=True)
        _failed.clear()
        _mine.clear()
        _planned[:] = planned_jobs(config)

    def on_multirun_end(self, config, **kwargs) -> None:
        """This sweep's failures (another sweep into the same folder lists its own), less the jobs it found held by
        another live run that are complete now: that run did them. The list file is this sweep's, written whole."""
        _failed[:] = [job for job in _mine if not done_elsewhere(job)]
        if _failed:
            write_text_atomic(failures_path(config), "".join(json.dumps(job) + "\n" for job in _failed))
        else:
            failures_path(config).unlink(missing_ok=True)
        for job in _failed:
            print(f"tcal: sweep job {job['job']} failed ({job['folder']}): {job['error']}", file=sys.stderr, flush=True)
