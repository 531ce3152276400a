"""A run's record, `results.json`: how far the run got, and everything it found, kept whole across kills,
resumes and failures.

- `status` says how far the run got: converted, initialized, trained_<stage> (in stage order), complete; or
  failed, with `error` (what stopped it, on one line) and `failed_after` (the status it had reached).
- A resumed run starts from the record on disk: what it writes replaces those fields, everything else it held
  (curves, stage records) stays until replaced, and the status never goes back.
- Strict JSON: NaN and infinite numbers are written as null and listed under `non_finite`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from omegaconf import OmegaConf

from tcal.errors import ConfigError
from tcal.results import null_non_finite, write_json_atomic

log = logging.getLogger(__name__)

RESULTS = "results.json"
FAILURE_KEYS = ("error", "failed_after")
NON_FINITE = "non_finite"


def _object(data):
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def read_record(run_dir: str | Path) -> dict | None:
    """The record in `run_dir`, or None (none there; a damaged one is warned about)."""
    from tcal.cache import read_json  # imports torch: not before a config error could stop the job

    return read_json(Path(run_dir) / RESULTS, "results of an earlier run", _object)


def reached(record: dict) -> str | None:
    """The step a record's run reached (for a failed run, the one before the failure)."""
    status = record.get("status")
    return record.get("failed_after") if status == "failed" else status


def progress(record: dict) -> int:
    """How far along `record` is: -1 for nothing, then converted, initialized, each stage, complete."""
    stage = (record.get("config") or {}).get("stage") or {}
    kinds = list(stage.get("sequence") or ([stage["kind"]] if stage.get("kind") else []))
    order = ["converted", "initialized", *(f"trained_{kind}" for kind in kinds), "complete"]
    status = reached(record)
    return order.index(status) if status in order else -1


def write_record(path: str | Path, results: dict, earlier: dict | None = None) -> None:
    """Write `results` atomically, first brought up to what is recorded: the fields of `earlier` (the record
    this run continues) it does not have yet, the further of the two statuses, non-finite values as null."""
    if earlier:
        for key, value in earlier.items():
            if key not in FAILURE_KEYS and key != NON_FINITE:
                results.setdefault(key, value)
        if progress(earlier) > progress(results):
            results["status"] = reached(earlier)
    results.pop(NON_FINITE, None)
    found = null_non_finite(results)
    if found:
        results[NON_FINITE] = {"note": "NaN or infinite values, written as null", "values": found}
    write_json_atomic(path, results)


def describe(err: BaseException) -> str:
    """An error on one line, with what kind of error it is."""
    text = " ".join(str(err).split())
    kind = "configuration error" if isinstance(err, ConfigError) else type(err).__name__
    return f"{kind}: {text}" if text else kind


def record_failure(run_dir: str | Path, err: BaseException, cfg=None, create: bool = False) -> Path | None:
    """Mark the record in `run_dir` failed with `err`, keeping everything it held; with `create`, write one (with
    the config) when there is none. Returns its path, or None when nothing was written (and on ranks but 0)."""
    from tcal.distributed import is_rank_zero

    path = Path(run_dir) / RESULTS
    record = read_record(run_dir) if is_rank_zero() else None
    if record is None and not (create and is_rank_zero()):
        return None
    record = record or {"status": None}
    if "config" not in record and cfg is not None:
        try:
            record["config"] = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - a config that does not resolve is recorded without it
            pass
    if record.get("status") != "failed":
        record["failed_after"] = record.get("status")
    record.update(status="failed", error=describe(err))
    write_record(path, record)
    return path


def records_failure(run):
    """Decorate `run(cfg, run_dir, ...)`: an error once the record exists (divergence, a crash) marks it failed.
    A ConfigError leaves the record as it is (nothing was done, or a resume was refused)."""
    @functools.wraps(run)
    def wrapper(cfg, run_dir, *args, **kwargs):
        try:
            return run(cfg, run_dir, *args, **kwargs)
        except ConfigError:
            raise
        except Exception as err:
            ranks = kwargs.get("ranks")
            if ranks is not None and not ranks.is_main:
                raise  # rank 0 writes the record
            path = record_failure(run_dir, err, cfg)
            if path is not None:
                log.error("run failed: %s (record: %s)", describe(err), path)
            raise

    return wrapper
