"""A run's record, `results.json`: its schema, how far the run got, and everything it found, kept whole across
kills, resumes and failures (docs/method.md, section "The record: results.json").

- One schema (`FIELDS`, version `SCHEMA_VERSION`): a run's `Record` writes it (through `write_record`, which checks
  it before every write, on rank 0 only), `load_record` checks it on every read.
- `status` says how far the run got: converted, initialized, trained_<stage> (in stage order), complete; or
  failed, with `error` (what stopped it, on one line; `interrupted by SIGTERM (signal 15)` for a signal) and
  `failed_after` (the status it had reached). The fields a
  record must hold grow with its status.
- A resumed run starts from the record on disk: what it writes replaces those fields, everything else it held
  (curves, stage records) stays until replaced, and the status never goes back.
- Strict JSON: NaN and infinite numbers are written as null and listed under `non_finite`.
- The settings are in `config` alone; versions 0 (no `schema_version`) and 1 also copied six to the top level.
  `recorded_setting` reads them from a record of any version; a record rewritten takes this version.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tcal.errors import ConfigError, FolderInUse
from tcal.runtime.signals import Interrupted
from tcal.store.files import null_non_finite, write_json_atomic

log = logging.getLogger(__name__)

RESULTS = "results.json"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (0, 1, 2)
OLD = (0, 1)  # the versions that copied settings to the top level (`COPIES`)
FAILURE_KEYS = ("error", "failed_after")
NON_FINITE = "non_finite"
STEPS = ("converted", "initialized", "trained", "complete")  # what a status has reached, in order
STATUS = re.compile(r"converted|initialized|trained_[a-z0-9_]+|complete|failed")


class RecordError(ValueError):
    """A results.json that is not a record of this schema: the file, the field (dotted; None for the whole file)
    and why."""

    def __init__(self, path: str | Path, field: str | None, why: str):
        self.path, self.field, self.why = Path(path), field, why
        super().__init__(f"{path}: {self.problem}")

    @property
    def problem(self) -> str:
        return f"field {self.field!r}: {self.why}" if self.field else self.why


class _Mismatch(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(why)
        self.field, self.why = field, why


# --- types: each check takes (value, dotted field) and raises _Mismatch ---

Check = Callable[[object, str], None]


def _is(types: tuple, expected: str, allow_none: bool = False) -> Check:
    def check(value, field):
        if value is None and allow_none:
            return
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise _Mismatch(field, f"expected {expected}, got {value!r:.60}")
    return check


TEXT = _is((str,), "a string")
INTEGER = _is((int,), "an integer")
FLAG = _is((bool,), "true or false")
NUMBER = _is((int, float), "a number (null for NaN or infinite)", allow_none=True)
OBJECT = _is((dict,), "a JSON object")  # free-form: a resolved config, an init's measurements


def nullable(check: Check) -> Check:
    return lambda value, field: None if value is None else check(value, field)


def list_of(item: Check) -> Check:
    def check(value, field):
        _is((list,), "a list")(value, field)
        for i, element in enumerate(value):
            item(element, f"{field}[{i}]")
    return check


def dict_of(item: Check) -> Check:
    def check(value, field):
        OBJECT(value, field)
        for key, element in value.items():
            item(element, f"{field}.{key}")
    return check


def shape(required: dict[str, Check], optional: dict[str, Check] | None = None) -> Check:
    """A JSON object with exactly these keys (the optional ones may be absent)."""
    optional = optional or {}

    def check(value, field):
        OBJECT(value, field)
        for key, item in required.items():
            if key not in value:
                raise _Mismatch(f"{field}.{key}", "missing")
        for key, element in value.items():
            item = required.get(key) or optional.get(key)
            if item is None:
                raise _Mismatch(f"{field}.{key}", "not a field of this object")
            item(element, f"{field}.{key}")
    return check


def _status(value, field):
    TEXT(value, field)
    if not STATUS.fullmatch(value):
        raise _Mismatch(field, f"{value!r} is not a status (converted, initialized, trained_<stage>, complete, "
                               f"failed)")


CURVE = dict_of(list_of(shape({"tokens": INTEGER, "ppl": NUMBER})))  # eval set -> points
STAGE_RECORD = shape(
    {"kind": TEXT, "settings": OBJECT, "steps": INTEGER, "tokens_seen": INTEGER, "tokens_per_step": INTEGER,
     "world_size": INTEGER, "seconds_this_process": NUMBER, "loss_first": NUMBER, "loss_last": NUMBER,
     "rank_weight_digests": list_of(TEXT), "curve": CURVE, "resumed": FLAG, "cached": FLAG})
STAGE_RUNNING = shape({"curve": CURVE})  # a stage still training holds its curve so far


def is_stage_record(data) -> bool:
    """Whether `data` is a finished stage's record (`results.json` `stages.<kind>`) of this schema."""
    try:
        STAGE_RECORD(data, "stage")
    except _Mismatch:
        return False
    return True


def _stage(value, field):
    (STAGE_RUNNING if isinstance(value, dict) and set(value) == {"curve"} else STAGE_RECORD)(value, field)


POSITION_BUCKET = shape({"start": INTEGER, "end": INTEGER, "tokens": INTEGER, "teacher_ppl": NUMBER,
                         "student_ppl": NUMBER})
EVAL_SET = shape({"teacher_ppl": NUMBER, "student_ppl": NUMBER}, {"by_position": list_of(POSITION_BUCKET)})
HARNESS = shape({"teacher": dict_of(dict_of(NUMBER)), "student": dict_of(dict_of(NUMBER))})  # task -> metric
SUMMARY_CELL = nullable(shape({"mean": NUMBER, "se": NUMBER, "n": INTEGER}))
RULER = shape({"teacher": dict_of(dict_of(NUMBER)), "student": dict_of(dict_of(NUMBER))},  # length -> task
              {"n": dict_of(dict_of(INTEGER)),  # length -> task -> examples
               "summary": dict_of(shape({"needle": SUMMARY_CELL, "other": SUMMARY_CELL, "all": SUMMARY_CELL}))})


@dataclass(frozen=True)
class Field:
    """One top-level field: its type, the step from which every record holds it (None: it may be absent;
    "failed": only a failed record holds it), and the schema versions whose records hold it then."""

    check: Check
    since: str | None
    about: str
    versions: tuple[int, ...] = READABLE_VERSIONS


FIELDS: dict[str, Field] = {
    "schema_version": Field(INTEGER, None, "the version of this schema the record follows (absent: 0)"),
    "status": Field(_status, "always", "how far the run got"),
    "error": Field(TEXT, "failed", "what stopped a failed run, on one line"),
    "failed_after": Field(nullable(_status), "failed", "the status a failed run had reached (null: nothing)"),
    "config": Field(OBJECT, "converted", "the resolved Hydra config of the run"),
    "num_layers": Field(INTEGER, "converted", "the teacher's depth", (2,)),
    "teacher": Field(shape({"name": TEXT, "num_layers": INTEGER}), "converted", "0-1: the teacher, its depth", OLD),
    "retention": Field(TEXT, "converted", "versions 0-1: the retention policy", OLD),
    "ratio": Field(NUMBER, "converted", "versions 0-1: the share of layers kept (null: explicit policy)", OLD),
    "keep_layers": Field(list_of(INTEGER), "converted", "the layers that stay softmax attention"),
    "retention_scores": Field(dict_of(NUMBER), "converted", "layer -> the policy's score"),
    "retention_details": Field(OBJECT, None, "what the policy measured besides the scores (recall: both loss "
                                             "rises per layer, the layers chosen by the score, scoring seconds)"),
    "init_mode": Field(TEXT, "converted", "versions 0-1: the init mode", OLD),
    "gqa_expansion": Field(TEXT, "converted", "versions 0-1: how KV heads were expanded", OLD),
    "stage": Field(TEXT, "converted", "versions 0-1: the training stages (none: zero-shot)", OLD),
    "kernel_path": Field(TEXT, "converted", "the GDN kernel the run used"),
    "timings": Field(dict_of(NUMBER), "converted", "step -> seconds"),
    "calibration": Field(OBJECT, "initialized", "what the init mode measured"),
    "init_weights_digest": Field(TEXT, "initialized", "digest of the initialized student's weights"),
    "stages": Field(dict_of(_stage), None, "stage kind -> its record (a stage still training: its curve)"),
    "curve": Field(CURVE, None, "the last stage's perplexity curve: eval set -> [{tokens, ppl}]"),
    "metrics": Field(dict_of(EVAL_SET), "complete", "eval set -> teacher and student perplexity"),
    "harness": Field(HARNESS, None, "lm-eval: teacher / student -> task -> metric -> value"),
    "ruler": Field(RULER, None, "RULER: teacher / student -> length -> task -> exact match; n: length -> task -> "
                                "examples; summary: role -> needle / other / all -> {mean, se, n}"),
    "student_path": Field(TEXT, None, "where the student was exported"),
    "inputs": Field(shape({"files": dict_of(TEXT), "splits": dict_of(TEXT)}), None,
                    "digests of what the run read: each named file's bytes, each split's documents (a resume whose "
                    "inputs differ is refused)"),
    "data": Field(OBJECT, None, "what the stages read of the token store: its distinct tokens, each stage's "
                                "tokens, region and passes, the run's passes (tcal.training.data.describe_reading)"),
    "wandb": Field(shape({"id": TEXT, "project": nullable(TEXT), "group": nullable(TEXT)}), None,
                   "the W&B run a `logger=wandb` run logs to (a resume continues it)"),
    NON_FINITE: Field(shape({"note": TEXT, "values": list_of(TEXT)}), None, "the values written as null"),
}


def _step(status: str | None) -> int:
    """How far `status` has reached in STEPS (-1: nothing)."""
    if status is None or status == "failed":
        return -1
    return STEPS.index("trained" if status.startswith("trained_") else status)


def required_fields(status: str, failed_after: str | None = None, version: int = SCHEMA_VERSION) -> list[str]:
    """The fields every record of `status` and schema `version` holds (a failed one: those of the status it had
    reached, and its error)."""
    reached = _step(failed_after if status == "failed" else status)
    return [name for name, spec in FIELDS.items() if version in spec.versions and (
            spec.since == "always" or spec.since == "failed" and status == "failed"
            or spec.since in STEPS and reached >= STEPS.index(spec.since))]


def _check_fields(data: dict) -> None:
    for name, value in data.items():
        if name not in FIELDS:
            raise _Mismatch(name, "not a field of a results.json record")
        FIELDS[name].check(value, name)
    if "status" not in data:
        raise _Mismatch("status", "missing")
    status = data["status"]
    for name in required_fields(status, data.get("failed_after"), data.get("schema_version", 0)):
        if name not in data:
            raise _Mismatch(name, f"missing (a record with status {status!r} holds it)")
    for name in FAILURE_KEYS:
        if status != "failed" and name in data:
            raise _Mismatch(name, f"only a failed record holds it (status is {status!r})")


def schema_version(data: dict, path: str | Path) -> int:
    """The record's schema version (0 when it has none), or RecordError when this code cannot read it."""
    version = data.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise RecordError(path, "schema_version", f"version {json.dumps(version)} is not one this tcal reads "
                                                  f"({', '.join(map(str, READABLE_VERSIONS))}); written by another "
                                                  f"version of tcal?")
    return version


def check_record(data, path: str | Path) -> dict:
    """`data` if it is a record of a readable schema version; RecordError naming `path` and the field otherwise."""
    if not isinstance(data, dict):
        raise RecordError(path, None, "not a JSON object")
    schema_version(data, path)
    try:
        _check_fields(data)
    except _Mismatch as err:
        raise RecordError(path, err.field, err.why) from None
    return data


def _refuse_constant(token: str):
    raise ValueError(f"{token} is not strict JSON")


def load_record(path: str | Path) -> dict:
    """The record in the file `path`, checked against the schema; RecordError naming the file and the field
    (or the problem with the whole file: unreadable, not JSON) otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecordError(path, None, f"cannot be read ({type(err).__name__}: {err})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as err:
        raise RecordError(path, None, f"not valid JSON ({err})") from None
    return check_record(data, path)


def read_record(run_dir: str | Path) -> dict | None:
    """The record in `run_dir`, or None: none there, or a damaged one (warned about: the run starts again). One of
    an unknown schema version may hold another tcal's results: FolderInUse, and the folder is left as it is."""
    path = Path(run_dir) / RESULTS
    if not path.is_file():
        return None
    try:
        return load_record(path)
    except RecordError as err:
        if err.field == "schema_version":
            raise FolderInUse(f"{err}; expected a folder without a record or with one this tcal reads: pass another "
                              f"hydra.run.dir / hydra.sweep.dir") from None
        log.warning("results of an earlier run cannot be used: %s; starting again", err)
        return None


def new_record(config: dict, num_layers: int, keep_layers: list[int], retention_scores: dict, kernel_path: str,
               timings: dict, **optional) -> dict:
    """The record of a run that has just converted its student: `config` is its settings' tree; `optional`
    fields given None are left out."""
    return {"schema_version": SCHEMA_VERSION, "status": "converted", "config": config, "num_layers": num_layers,
            "keep_layers": list(keep_layers), "retention_scores": {str(k): v for k, v in retention_scores.items()},
            "kernel_path": kernel_path, "timings": timings,
            **{name: value for name, value in optional.items() if value is not None}}


class Record:
    """The record of the run in progress, `run_dir/results.json`, and the only writer of its fields: one method per
    step of the run. Begun when the student is converted (`converted`, `new_record`); saved at each status and every
    curve point so a crash leaves a readable record, by the writing rank (rank 0) alone, each time merged with the
    record `earlier` that a resumed run continues (`write_record`). Its `timings` gather from the run's start."""

    def __init__(self, run_dir: str | Path, earlier: dict | None = None, writer: bool = True):
        self.path, self.earlier, self.writer = Path(run_dir) / RESULTS, earlier, writer
        self.fields: dict = {}
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, step: str):
        """The seconds the block takes, as `timings.<step>`."""
        start = time.perf_counter()
        yield
        self.timings[step] = round(time.perf_counter() - start, 3)

    def converted(self, config: dict, num_layers: int, keep_layers: list[int], retention_scores: dict,
                  kernel_path: str, **optional) -> None:
        """The record begun: the run's settings, the keep list and its scores, the kernel (`new_record`)."""
        self.fields = new_record(config, num_layers, keep_layers, retention_scores, kernel_path, self.timings,
                                 **optional)
        self._save()

    def initialized(self, calibration: dict, weights_digest: str) -> None:
        self._save(status="initialized", calibration=calibration, init_weights_digest=weights_digest)

    def stage_point(self, kind: str, curve: dict) -> None:
        """The curve of stage `kind` so far, at each of its evaluations."""
        self.fields.setdefault("stages", {}).setdefault(kind, {})["curve"] = curve
        self._save(curve=curve)

    def stage_finished(self, kind: str, stage: dict, seconds: float) -> None:
        """Stage `kind`'s record (`STAGE_RECORD`) and the seconds it took."""
        self.timings[f"stage_{kind}"] = seconds
        self.fields.setdefault("stages", {})[kind] = stage
        self._save(status=f"trained_{kind}", curve=stage["curve"])

    def evaluated(self, results: dict) -> None:
        """The final evaluation's `metrics` (and `harness`, `ruler`); written with the status complete."""
        self.fields.update(results)

    def saved(self, folder: str | Path) -> None:
        self.fields["student_path"] = str(folder)

    def complete(self) -> None:
        self._save(status="complete")

    def _save(self, **fields) -> None:
        self.fields.update(fields)
        if self.writer:
            write_record(self.path, self.fields, self.earlier)


_ABSENT = object()
# the settings versions 0 and 1 copied to the top level: config key -> the field of the copy
COPIES = {"teacher.name": "teacher", "retention.name": "retention", "retention.ratio": "ratio",
          "init.name": "init_mode", "init.gqa_expansion": "gqa_expansion", "stage": "stage"}


def recorded_setting(record: dict, key: str):
    """The setting `key` (one of `COPIES`) of a record's run: from its `config`, else from the top-level copy an
    older record holds (its config may lack the key). The stage is its label (`align_distill`). KeyError when the
    record holds neither."""
    node = record.get("config") or {}
    for part in key.split("."):
        node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
    if node is not _ABSENT:
        return ("_".join(node["sequence"]) if node.get("sequence") else node["name"]) if key == "stage" else node
    if COPIES[key] in record:
        return record["teacher"]["name"] if key == "teacher.name" else record[COPIES[key]]
    if key == "retention.ratio" and "retention" in (record.get("config") or {}):
        return None  # the explicit policy has no ratio
    raise KeyError(key)


def recorded_num_layers(record: dict) -> int:
    """The teacher's depth (in versions 0 and 1: its copy's)."""
    return record["num_layers"] if "num_layers" in record else record["teacher"]["num_layers"]


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
    """Write `results` atomically, first brought up to what is recorded: the fields of `earlier` (the record this run
    continues) it lacks but the old versions' copies of settings, the further status, non-finite values as null, this
    version (`num_layers` from an old teacher copy). One not fitting the schema is refused (RecordError) unwritten."""
    if earlier:
        for key, value in earlier.items():
            if key not in FAILURE_KEYS and key != NON_FINITE and FIELDS[key].versions != OLD:
                results.setdefault(key, value)
        if progress(earlier) > progress(results):
            results["status"] = reached(earlier)
    if isinstance(results.get("teacher"), dict):
        results.setdefault("num_layers", results["teacher"]["num_layers"])
    results.pop(NON_FINITE, None)
    found = null_non_finite(results)
    if found:
        results[NON_FINITE] = {"note": "NaN or infinite values, written as null", "values": found}
    results["schema_version"] = SCHEMA_VERSION
    check_record(results, path)
    write_json_atomic(path, results)


def describe(err: BaseException) -> str:
    """An error on one line, with what kind of error it is (an interrupt: `interrupted by SIGTERM (signal 15)`)."""
    from tcal.runtime.signals import as_interrupt

    interrupt = as_interrupt(err)
    if interrupt is not None:
        return str(interrupt)
    text = " ".join(str(err).split())
    kind = "configuration error" if isinstance(err, ConfigError) else type(err).__name__
    return f"{kind}: {text}" if text else kind


def record_failure(run_dir: str | Path, err: BaseException, config: dict | None = None,
                   create: bool = False) -> Path | None:
    """Mark the record in `run_dir` failed with `err`, keeping everything it held; with `create`, write one (with
    `config`, the run's settings as a mapping) when there is none. Returns its path, or None when nothing was
    written (and on ranks but 0)."""
    from tcal.runtime.distributed import is_rank_zero

    path = Path(run_dir) / RESULTS
    record = read_record(run_dir) if is_rank_zero() else None
    if record is None and not (create and is_rank_zero()):
        return None
    record = record or {"status": None}
    if "config" not in record and config is not None:
        record["config"] = config
    if record.get("status") != "failed":
        record["failed_after"] = record.get("status")
    record.update(status="failed", error=describe(err))
    write_record(path, record)
    return path


def records_failure(run):
    """Decorate `run(settings, run_dir, ...)`: an error once the record exists (divergence, a crash, a signal: see
    `tcal.runtime.signals`) marks it failed. A ConfigError leaves the record as it is (nothing was done, or a resume was
    refused)."""
    @functools.wraps(run)
    def wrapper(settings, run_dir, *args, **kwargs):
        try:
            return run(settings, run_dir, *args, **kwargs)
        except ConfigError:
            raise
        except (Exception, KeyboardInterrupt, Interrupted) as err:
            ranks = kwargs.get("ranks")
            if ranks is not None and not ranks.is_main:
                raise  # rank 0 writes the record
            try:
                path = record_failure(run_dir, err, settings.tree(),
                                      create=isinstance(err, (KeyboardInterrupt, Interrupted)))
            except OSError as unwritten:  # a full disk: the error that stopped the run is the one to report
                log.error("run failed: %s; its record could not be updated: %s", describe(err), unwritten)
                raise err from None
            if path is not None:
                log.error("run failed: %s (record: %s)", describe(err), path)
            raise

    return wrapper
