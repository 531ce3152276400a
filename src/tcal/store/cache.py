"""The one on-disk cache of the project: calibrated layers, Stage 1 results, retention scores, the teacher's
evaluation figures and token streams all go through `get_or_build` (or `get_or_build_each` for several entries
built together).

Every entry gets the same guarantees:
- one file, written whole (a temporary file renamed over it, `tcal.store.files.write_atomic`);
- tensors and their record in one safetensors file (the record as JSON in its metadata; no pickle, so no
  `torch.load` of cache files), or a JSON file for entries without tensors; either way the entry carries its
  own key (its file name, a digest of everything it depends on), checked when read, so an entry copied or
  renamed under another key is rebuilt, not trusted by its name;
- a lock file per key while it is built, so the processes of a sweep that need one entry build it once and the
  others wait and reuse it;
- a missing entry is a miss; a damaged one (truncated, foreign, from an older layout, or refused by the
  caller's `decode`) is rebuilt with a warning, never trusted and never a crash;
- one INFO line per entry and process, `cache <kind>: built <key>` or `cache <kind>: reused <key>`, so a
  sweep's logs show that each entry was built once.

Several ranks of one run (`tcal.runtime.distributed`) build an entry together (the build may use collectives), so no
rank may wait in a lock while the others sit in a collective: rank 0 reads and decides for all, takes the
keys' locks without waiting, and writes what was built; a key whose lock another job holds is built here too
(both write the same whole file). Each of these steps is shared (`Ranks.decide`, `Ranks.together`): a read
or a write that fails on one rank stops every rank with its error.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Hashable, Iterable, Iterator, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tcal.runtime.distributed import Ranks
from tcal.store.files import make_folder, write_atomic, write_json_atomic
from tcal.store.locks import describe_holder, locked

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

RECORD = "tcal_record"  # safetensors metadata key holding the JSON record
KEY = "tcal_key"  # the entry's key: a safetensors metadata key, a field of a JSON entry


class ForeignEntry(ValueError):
    """An entry written under another key (copied or renamed), or without one."""


def check_key(key: str, written_as) -> None:
    if written_as is None:
        raise ForeignEntry("it carries no key (written by an older tcal, or not a cache entry)")
    if written_as != key:
        raise ForeignEntry(f"it was written under the key {written_as!r}, not {key!r} (copied or renamed)")


# ---------------------------------------------------------------------------------------------------------------
# The two file formats


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], record: Any, key: str) -> None:
    """Tensors and a JSON-able record in one safetensors file, written whole, carrying `key`."""
    plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {RECORD: json.dumps(record), KEY: key}
    write_atomic(path, lambda tmp: save_file(plain, str(tmp), metadata=metadata))


def load_tensors(path: str | Path, key: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors, record) of a file written by `save_tensors` under `key`; raises when it is not that."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        metadata = handle.metadata() or {}
        if RECORD not in metadata:
            raise KeyError(f"no {RECORD!r} in its metadata (not a tcal cache entry)")
        check_key(key, metadata.get(KEY))
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    return tensors, json.loads(metadata[RECORD])


def save_json(path: str | Path, record: dict, key: str) -> None:
    """A JSON object written whole, carrying `key`."""
    write_json_atomic(path, {**record, KEY: key})


def load_json(path: str | Path, key: str) -> dict:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    check_key(key, data.get(KEY) if isinstance(data, dict) else None)
    return data


@dataclass(frozen=True)
class Codec(Generic[T]):
    """How a value becomes an entry file and back. `decode` raising means the entry is damaged or foreign."""

    suffix: str
    write: Callable[[Path, T, str], None]
    read: Callable[[Path, str], T]


def tensor_codec(encode: Callable[[T], tuple[dict[str, torch.Tensor], Any]],
                 decode: Callable[[dict[str, torch.Tensor], Any], T]) -> Codec[T]:
    """Values stored as (tensors, JSON record) in one safetensors file."""
    return Codec(".safetensors", lambda path, value, key: save_tensors(path, *encode(value), key),
                 lambda path, key: decode(*load_tensors(path, key)))


def json_codec(encode: Callable[[T], dict] = lambda value: {"value": value},
               decode: Callable[[dict], T] = lambda record: record["value"]) -> Codec[T]:
    """Values stored as one JSON object (by default `{"value": value}`)."""
    return Codec(".json", lambda path, value, key: save_json(path, encode(value), key),
                 lambda path, key: decode(load_json(path, key)))


# ---------------------------------------------------------------------------------------------------------------
# Locks


def lock_path(path: Path) -> Path:
    """`<folder>.locks/<entry>.lock`, beside the entries' folder, so listings of entries stay entries only."""
    return path.parent.with_name(path.parent.name + ".locks") / (path.name + ".lock")


@contextlib.contextmanager
def key_lock(path: str | Path, wait: bool = True):
    """An exclusive lock on the entry at `path` (`tcal.store.locks`: released when the holder exits, even when killed).
    Yields whether it is held: with `wait=False` it is not when another process holds it. Waiting for another
    process, it first logs which entry it waits for and who is building it."""
    lock = lock_path(Path(path))

    def say_waiting(holder: dict) -> None:
        log.warning("cache: waiting for %s, being built by %s", Path(path), describe_holder(holder))

    make_folder(lock.parent)
    with locked(lock, wait=wait, on_wait=say_waiting) as held:
        yield held


# ---------------------------------------------------------------------------------------------------------------
# get_or_build


@dataclass
class Store(Generic[T]):
    """The entries of one kind in one folder."""

    kind: str
    folder: Path
    codec: Codec[T]

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{self.codec.suffix}"

    def read(self, key: str) -> tuple[T | None, str | None]:
        """(value, None) for a good entry, (None, None) for a missing one, (None, why) for a damaged one."""
        path = self.path(key)
        if not path.is_file():
            return None, None
        try:
            return self.codec.read(path, key), None
        except ForeignEntry as err:
            return None, f"is not the entry of its key: {err}"
        except Exception as err:  # noqa: BLE001 - any failure to read means "rebuild", never "crash"
            return None, f"is unreadable ({type(err).__name__}: {err})"

    def write(self, key: str, value: T) -> None:
        self.codec.write(self.path(key), value, key)
        log.info("cache %s: built %s", self.kind, key)

    def reused(self, key: str) -> None:
        log.info("cache %s: reused %s", self.kind, key)

    def damaged(self, key: str, why: str) -> None:
        log.warning("cache %s: %s %s; rebuilding it", self.kind, self.path(key), why)


def get_or_build(kind: str, key: str, build: Callable[[], T], *, folder: str | Path | None,
                 codec: Codec[T] | None = None, ranks: Ranks | None = None) -> T:
    """The entry `key` of `kind` in `folder`, or `build()` written there (once across processes, see the module
    doc). `folder=None` turns the cache off: `build()` only. With several `ranks`, every rank calls this and
    `build` runs on all of them together."""
    return get_or_build_each(kind, {None: key}, lambda items: {None: build()}, folder=folder, codec=codec,
                             ranks=ranks)[None]


def get_or_build_each(kind: str, keys: dict[K, str],
                      build_some: Callable[[list[K]], dict[K, T] | Iterable[tuple[K, T]]], *,
                      folder: str | Path | None, codec: Codec[T] | None = None,
                      ranks: Ranks | None = None) -> dict[K, T]:
    """{item: value} for the entries `keys[item]`: the ones in the cache read, the others built together by
    `build_some(items)` (one call for all that this process may build, so a batched build such as one teacher
    pass for several layers stays batched). `build_some` returns {item: value}, or yields (item, value) pairs
    so that each entry is written as soon as it is built (a crash keeps the finished ones). With several
    `ranks`, every rank calls this with the same keys and `build_some` runs on all of them together."""
    if folder is None:
        return dict(built_pairs(build_some(list(keys))))
    store = Store(kind, Path(folder), codec or json_codec())
    if ranks is not None and ranks.distributed:
        return _collective(store, keys, build_some, ranks)
    values: dict[K, T] = {}
    for item, key in keys.items():
        value, _ = store.read(key)  # a damaged entry is reported when it is rebuilt, under its lock
        if value is not None:
            store.reused(key)
            values[item] = value
    missing = [item for item in keys if item not in values]
    with contextlib.ExitStack() as held:
        locks: dict[K, contextlib.ExitStack] = {}
        for item in missing:
            lock = held.enter_context(contextlib.ExitStack())
            if lock.enter_context(key_lock(store.path(keys[item]), wait=False)):
                locks[item] = lock
            else:
                lock.close()
        values.update(_read_or_build(store, keys, list(locks), build_some, done=lambda item: locks[item].close()))
    for item in missing:  # another process was building these: wait for it, then read (or build after a crash)
        if item not in values:
            with key_lock(store.path(keys[item])):
                values.update(_read_or_build(store, keys, [item], build_some))
    return {item: values[item] for item in keys}


def _read_or_build(store: Store[T], keys: dict[K, str], items: list[K], build_some,
                   done: Callable[[K], None] = lambda item: None) -> dict[K, T]:
    """Under the items' locks: those now in the cache read, the others built and written; `done(item)` once an
    item's entry is read or written, so that its lock can be released before the others are built (a job waiting
    for one entry of a long batched build reads it as soon as it is written)."""
    values, todo = {}, []
    for item in items:
        value, why = store.read(keys[item])
        if value is not None:
            store.reused(keys[item])
            values[item] = value
            done(item)
        else:
            if why is not None:
                store.damaged(keys[item], why)
            todo.append(item)
    for item, value in built_pairs(build_some(todo) if todo else {}):
        store.write(keys[item], value)
        values[item] = value
        done(item)
    return values


def built_pairs(built) -> Iterator:
    """(item, value) pairs of what a `build_some` returned: a dict, or an iterable of pairs."""
    return iter(built.items()) if isinstance(built, dict) else iter(built)


def _collective(store: Store[T], keys: dict[K, str], build_some, ranks: Ranks) -> dict[K, T]:
    """Several ranks: rank 0's reading decides, the missing entries are built by all ranks together while rank 0
    holds the locks it could take without waiting, and rank 0 writes them."""
    found: dict[K, T] = {}

    def read_on_main() -> list[K]:
        for item, key in keys.items():
            value, why = store.read(key)
            if value is not None:
                store.reused(key)
                found[item] = value
            elif why is not None:
                store.damaged(key, why)
        return list(found)

    present = ranks.decide(read_on_main)
    with ranks.together():
        if not ranks.is_main:
            found.update({item: _read_present(store, keys[item]) for item in present})
    missing = [item for item in keys if item not in found]
    if not missing:
        return {item: found[item] for item in keys}
    with contextlib.ExitStack() as held:
        with ranks.together():
            if ranks.is_main:
                for item in missing:
                    if not held.enter_context(key_lock(store.path(keys[item]), wait=False)):
                        log.info("cache %s: %s is being built by another job; the ranks build it too", store.kind,
                                 keys[item])
        built, write_error = {}, None
        for item, value in built_pairs(build_some(missing)):
            if ranks.is_main and write_error is None:
                try:
                    store.write(keys[item], value)
                except Exception as err:  # noqa: BLE001 - shared below: every rank stops with it
                    write_error = err
            built[item] = value
        ranks.share_outcome(write_error)
    found.update(built)
    return {item: found[item] for item in keys}


def _read_present(store: Store[T], key: str) -> T:
    """An entry rank 0 read, read by another rank: the ranks must see one cache folder."""
    value, why = store.read(key)
    if value is None:
        raise RuntimeError(f"cache {store.kind}: rank 0 read {store.path(key)} but this rank cannot "
                           f"({why or 'missing'}); the ranks of a run must share paths.cache_dir")
    return value
