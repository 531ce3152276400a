"""Sweeps (`tcal -m`) in which every job stands alone.

A job that fails (a bad setting, a refused folder, divergence, a crash) does not stop the sweep: it is recorded
in its own folder (results.json with status "failed" and the error; a record already there keeps what it held,
and a folder holding a run of another config is not touched), logged, and listed in
`<sweep dir>/failed_jobs.jsonl`. When the sweep ends, `SweepSummary` (a Hydra callback, conf/config.yaml)
prints one line per failed job and `tcal` exits with code 1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)

FAILURES = "failed_jobs.jsonl"
_failed: list[dict] = []  # the failed jobs of the sweep that ended last in this process


def in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def record_job_failure(cfg, run_dir: Path, err: Exception) -> None:
    """The failed job's record in its folder (when it has none yet), its log, and its line in the sweep's list."""
    from hydra.core.hydra_config import HydraConfig

    from tcal.distributed import is_rank_zero
    from tcal.errors import ConfigError, Divergence
    from tcal.rank import RankFailed
    from tcal.record import RESULTS, describe, record_failure

    if not (Path(run_dir) / RESULTS).exists():
        record_failure(run_dir, err, cfg, create=True)
    if isinstance(err, (ConfigError, Divergence, RankFailed)):  # a failed rank logged its own traceback
        log.error("job failed: %s", describe(err))
    else:
        log.exception("job failed: %s", describe(err))
    if not is_rank_zero():  # ranks started from outside (SLURM tasks) run the job each: rank 0 lists it
        return
    hydra = HydraConfig.get()
    line = {"job": hydra.job.num, "overrides": list(hydra.overrides.task), "folder": str(run_dir),
            "error": describe(err)}
    with open(Path(hydra.sweep.dir) / FAILURES, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")


@contextlib.contextmanager
def sweep_job(cfg, run_dir: Path):
    """Around one job: in a sweep, an error is recorded and the sweep goes on; otherwise errors pass."""
    if not in_sweep():
        yield
        return
    try:
        yield
    except Exception as err:  # noqa: BLE001 - whatever failed, the other jobs run
        record_job_failure(cfg, Path(run_dir), err)


def failures_path(config) -> Path:
    return Path(str(config.hydra.sweep.dir)) / FAILURES


def failed_jobs() -> list[dict]:
    return list(_failed)


class SweepSummary(Callback):
    """Starts each sweep with an empty list of failed jobs; ends it with one line per failed job on stderr."""

    def on_multirun_start(self, config, **kwargs) -> None:
        failures_path(config).unlink(missing_ok=True)
        _failed.clear()

    def on_multirun_end(self, config, **kwargs) -> None:
        path = failures_path(config)
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        _failed[:] = [json.loads(line) for line in lines if line.strip()]
        for job in _failed:
            print(f"tcal: sweep job {job['job']} failed ({job['folder']}): {job['error']}", file=sys.stderr, flush=True)
