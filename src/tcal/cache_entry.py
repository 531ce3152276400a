"""One rule for every on-disk cache of the project (calibration artifacts, retention scores, teacher figures,
token streams, Stage 1 results).

An entry is one file, written whole (a temporary file renamed over it, `tcal.results.write_atomic`), so
parallel jobs racing on one key each leave a whole file and the last rename wins; the keys are digests of
everything an entry depends on, so racing writers write the same content. `get_or_build` also holds a lock
file per key while it builds, so the jobs of a sweep that need one entry build it once and the others wait
and read it. Reading is forgiving: a missing
entry is a miss, and an entry that fails to load (truncated, foreign, from an older layout) is a miss with a
warning. It is then rebuilt and rewritten, never trusted and never a crash.

Tensors and their record share one safetensors file (the record as JSON in its metadata): no pickle, so no
`torch.load` of cache files at all. Every entry also carries its own key (its file name, which is the digest of
what it depends on), checked when read: an entry copied or renamed under another key is rebuilt with a
warning, not trusted by its name.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tcal.results import write_atomic, write_json_atomic

log = logging.getLogger(__name__)

RECORD = "tcal_record"  # safetensors metadata key holding the JSON record
KEY = "tcal_key"  # the entry's key: a safetensors metadata key, a field of a JSON entry


class ForeignEntry(ValueError):
    """An entry written under another key (copied or renamed), or without one."""


def entry_key(path: Path) -> str:
    """An entry's key is its file name without the extension."""
    return Path(path).name.split(".")[0]


def check_key(path: Path, written_as) -> None:
    if written_as is None:
        raise ForeignEntry("it carries no key (written by an older tcal, or not a cache entry)")
    if written_as != entry_key(path):
        raise ForeignEntry(f"it was written under the key {written_as!r}, not {entry_key(path)!r} (copied or renamed)")


def read_entry(path: str | Path, load: Callable[[Path], Any], what: str) -> Any | None:
    """`load(path)`, or None when the entry is missing or unreadable (warned: the caller rebuilds it)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return load(path)
    except ForeignEntry as err:
        log.warning("%s %s is not the entry of its key: %s; rebuilding it", what, path, err)
    except Exception as err:  # noqa: BLE001 - any failure to read means "rebuild", never "crash"
        log.warning("%s %s is unreadable (%s: %s); rebuilding it", what, path, type(err).__name__, err)
    return None


def read_json(path: str | Path, what: str, parse: Callable[[dict], Any]) -> Any | None:
    """`parse(data)` of a JSON file, or None when missing or unreadable (`parse` raising means foreign)."""
    return read_entry(path, lambda p: parse(json.loads(p.read_text(encoding="utf-8"))), what)


def read_json_entry(path: str | Path, what: str, parse: Callable[[dict], Any]) -> Any | None:
    """`read_json` of a cache entry written by `write_json`: one written under another key is a miss."""
    def checked(data: dict) -> Any:
        check_key(Path(path), data.get(KEY) if isinstance(data, dict) else None)
        return parse(data)

    return read_json(path, what, checked)


def write_json(path: str | Path, data: dict) -> None:
    """A JSON cache entry, carrying its key."""
    write_json_atomic(path, {**data, KEY: entry_key(Path(path))})
    log.info("cache entry written: %s", path)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], record: Any) -> None:
    """Tensors and a JSON-able record in one safetensors file, written whole."""
    plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {RECORD: json.dumps(record), KEY: entry_key(Path(path))}
    write_atomic(path, lambda tmp: save_file(plain, str(tmp), metadata=metadata))
    log.info("cache entry written: %s", path)


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        if RECORD not in metadata:
            raise KeyError(f"no {RECORD!r} in its metadata (not a tcal cache entry)")
        check_key(path, metadata.get(KEY))
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    return tensors, json.loads(metadata[RECORD])


def load_tensors(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], Any] | None:
    """(tensors, record) of an entry written by `save_tensors`, or None (missing or unreadable)."""
    return read_entry(path, _load_tensors, what)


@contextlib.contextmanager
def key_lock(path: str | Path):
    """An exclusive lock on `<folder>.locks/<entry>.lock`, beside the entries' folder so listings of entries
    stay entries only (POSIX flock; released when the holder exits, even when killed)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): racing writers still leave one whole file
        yield
        return
    path = Path(path)
    lock = path.parent.with_name(path.parent.name + ".locks") / (path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def get_or_build(path: str | Path, read: Callable[[Path], Any | None], build: Callable[[], Any],
                 write: Callable[[Path, Any], None]) -> Any:
    """The entry at `path` (`read` returns None for a miss), or `build()` written there, built once across
    processes: under the key's lock the entry is read again before building."""
    path = Path(path)
    value = read(path)
    if value is not None:
        return value
    with key_lock(path):
        value = read(path)
        if value is None:
            value = build()
            write(path, value)
    return value
