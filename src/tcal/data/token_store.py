"""The token store: a training split tokenized once into memory-mapped token files under the cache, read by every
run, rank and sweep job that trains on it.

Layout: `<paths.cache_dir>/token_store/<key>/` holds `shard-00000.bin`, `shard-00001.bin`, ... (raw little-endian
int32 token ids, each document's tokens followed by the EOS token, as `tokenize_documents` joins them) and
`manifest.json` (the key, each shard's token count, the documents read through its end and its seal: the sha256 of
its bytes and its file identity, `tcal.store.fingerprint.seal`; and whether the store is complete). The key is a digest of the tokenizer (`tokenizer_digest`) and of what decides the training documents: a
streamed source's settings (`StreamedDocuments.describe`), or the names and text of in-memory documents; and of
`data.max_tokens`. Concatenated, the shards are exactly the first `max_tokens` tokens of the split's token stream.

Preparation streams the documents (never all in memory), tokenizes batches of `DOCUMENTS_PER_TASK` documents in a
pool of `data.workers` processes (results taken in order, so the files do not depend on the pool), and closes a
shard at the first document end past `data.shard_tokens` tokens. Each shard is written whole (a temporary file
renamed) and then listed in the manifest (rewritten whole), so a killed preparation keeps its listed shards and the
next one continues after them: an unlisted or damaged shard is redone. One process prepares a store at a time (a
lock per key, `tcal.store.cache.key_lock`); the others wait and map the finished files.

Every opening checks each shard against its seal (`tcal.store.fingerprint.unchanged`): a shard whose identity is
unchanged costs a stat; one whose identity moved (a copied cache, a rewritten file) is hashed again (about 1 GB/s),
and one whose bytes changed is prepared again from there, never read. A store sealed under another identity is
sealed again; one written before shards were sealed is trusted by its sizes once and sealed.

Reading maps the shards (`numpy.memmap`): processes share the pages, and a rank's own memory holds the windows it
reads (and each stage's epoch order, 8 bytes a window: `tcal.training.data.EpochWindows`), not the corpus's tokens.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from tcal.data.documents import Document, StreamedDocuments, document_ids, token_stream
from tcal.errors import DataError
from tcal.runtime.processes import pool_size
from tcal.runtime.progress import progress
from tcal.store.cache import key_lock
from tcal.store.files import write_atomic, write_json_atomic
from tcal.store.fingerprint import digest, file_identity, seal, tokenizer_digest, unchanged

log = logging.getLogger(__name__)

STORE_VERSION = 1
TOKEN_DTYPE = np.dtype("<i4")
DOCUMENTS_PER_TASK = 256  # documents a worker tokenizes per task
TASKS_AHEAD = 4  # tasks queued per worker: bounds the documents in flight
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    documents: int  # training documents read through the end of this shard (all shards so far)
    sealed: dict | None = None  # {"sha256", "identity"} (`tcal.store.fingerprint.seal`); None in an older manifest


class MemoryTokens:
    """A token stream held in memory ([n] LongTensor), read like a store (`stage.cache_tokens=false`, tests)."""

    def __init__(self, stream: torch.Tensor, documents: list[Document] | None = None):
        self.stream, self.documents = stream, documents
        self.num_tokens = int(stream.numel())
        self.key = digest("memory", stream)

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        return self.stream[start:stop]


class TokenStore:
    """A finished store, mapped: `tokens(start, stop)` is [stop - start] LongTensor of the concatenated shards.
    `documents`: the in-memory documents it holds exactly (None for a streamed or capped source)."""

    def __init__(self, folder: Path, key: str, shards: list[Shard], documents: list[Document] | None = None):
        self.folder, self.key, self.shards, self.documents = Path(folder), key, shards, documents
        self.offsets = np.cumsum([0] + [s.tokens for s in shards]).tolist()
        self.num_tokens = int(self.offsets[-1])
        self._maps: dict[int, np.memmap] = {}

    def shard_tokens(self, index: int) -> np.memmap:
        if index not in self._maps:
            self._maps[index] = np.memmap(self.folder / self.shards[index].file, dtype=TOKEN_DTYPE, mode="r")
        return self._maps[index]

    def tokens(self, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) of a store of {self.num_tokens}")
        parts, index = [], max(bisect.bisect_right(self.offsets, start) - 1, 0)
        while start < stop:
            end = min(stop, self.offsets[index + 1])
            parts.append(self.shard_tokens(index)[start - self.offsets[index]:end - self.offsets[index]])
            start, index = end, index + 1
        joined = np.concatenate(parts) if parts else np.zeros(0, TOKEN_DTYPE)
        return torch.from_numpy(joined.astype(np.int64))


# ---------------------------------------------------------------------------------------------------------------
# Opening (and preparing) a store


def store_key(train, tokenizer, max_tokens: int | None) -> str:
    """Digest of the tokenizer, what decides the training documents, and the cap."""
    source = train.describe() if isinstance(train, StreamedDocuments) else [(d.name, d.text) for d in train]
    return digest("token_store", STORE_VERSION, tokenizer_digest(tokenizer), source, max_tokens)


def open_store(train: list[Document] | StreamedDocuments, tokenizer, cache_dir: str | Path, data) -> TokenStore:
    """The token store of the training documents `train` (`data`: the run's `DataSettings`), prepared now unless
    it is there; another process preparing it is waited for."""
    max_tokens = int(data.max_tokens) if data.max_tokens else None
    key = store_key(train, tokenizer, max_tokens)
    folder = Path(cache_dir) / "token_store" / key
    exact = None if isinstance(train, StreamedDocuments) or max_tokens else list(train)
    store = finished_store(folder, key, exact)
    if store is None or not sealed_as_now(store):
        with key_lock(folder):
            store = finished_store(folder, key, exact) or prepare(
                folder, key, documents_from(train), tokenizer, max_tokens, int(data.shard_tokens),
                data.workers, exact)
            if not sealed_as_now(store):
                store.shards = [Shard(s.file, s.tokens, s.documents, seal(folder / s.file)) for s in store.shards]
                write_manifest(folder, key, store.shards, complete=True)
    else:
        log.info("token store: reused %s (%s tokens)", folder, f"{store.num_tokens:,}")
    if store.num_tokens == 0:
        raise DataError(f"the training split of data.source={data.source!r} holds no tokens (token store {folder})")
    return store


def training_tokens(train, tokenizer, cache_dir: str | Path | None, data) -> TokenStore | MemoryTokens:
    """The training split's tokens: the token store under `cache_dir`, or (`cache_dir` None) the stream of
    in-memory documents held in memory; a streamed source has no in-memory stream."""
    if cache_dir is not None:
        return open_store(train, tokenizer, cache_dir, data)
    if isinstance(train, StreamedDocuments):
        raise DataError(f"data.dataset={data.dataset!r} is streamed (data.streaming=true): its training tokens are "
                        f"read from the token store; expected stage.cache_tokens=true")
    stream = token_stream(list(train), tokenizer)
    if data.max_tokens:
        return MemoryTokens(stream[:int(data.max_tokens)])
    return MemoryTokens(stream, list(train))


def documents_from(train) -> Callable[[int], Iterator[Document]]:
    """`start -> the training documents from the start-th on`."""
    if isinstance(train, StreamedDocuments):
        return train.from_document
    docs = list(train)
    return lambda start: iter(docs[start:])


def read_manifest(folder: Path, key: str) -> dict | None:
    """The manifest of the store at `folder` when it is this key's (None when missing, unreadable or foreign)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("key") != key or manifest.get("version") != STORE_VERSION:
        return None
    return manifest


def intact_shards(folder: Path, manifest: dict) -> list[Shard]:
    """The manifest's shards up to the first whose file is missing, of the wrong size, or holds other bytes than
    its seal (module doc)."""
    shards = []
    for entry in manifest.get("shards", []):
        shard = Shard(str(entry["file"]), int(entry["tokens"]), int(entry["documents"]), entry.get("sealed"))
        path = folder / shard.file
        if not path.is_file() or path.stat().st_size != shard.tokens * TOKEN_DTYPE.itemsize:
            log.warning("token store %s: shard %s is missing or damaged; it is prepared again", folder, shard.file)
            break
        if shard.sealed is not None and not unchanged(path, shard.sealed):
            log.warning("token store %s: shard %s holds other bytes than when it was written (sha256 %s); it is "
                        "prepared again", folder, shard.file, shard.sealed["sha256"][:12])
            break
        shards.append(shard)
    return shards


def sealed_as_now(store: TokenStore) -> bool:
    """Whether every shard of `store` carries a seal of its file's identity now (else it is sealed again)."""
    return all(s.sealed is not None and list(s.sealed["identity"]) == file_identity(store.folder / s.file)
               for s in store.shards)


def finished_store(folder: Path, key: str, documents: list[Document] | None) -> TokenStore | None:
    manifest = read_manifest(folder, key)
    if manifest is None or not manifest.get("complete"):
        return None
    shards = intact_shards(folder, manifest)
    if len(shards) != len(manifest["shards"]):
        return None
    return TokenStore(folder, key, shards, documents)


def write_manifest(folder: Path, key: str, shards: list[Shard], complete: bool) -> None:
    write_json_atomic(folder / MANIFEST, {
        "key": key, "version": STORE_VERSION, "dtype": TOKEN_DTYPE.str, "complete": complete,
        "tokens": sum(s.tokens for s in shards), "documents": shards[-1].documents if shards else 0,
        "shards": [{"file": s.file, "tokens": s.tokens, "documents": s.documents, "sealed": s.sealed}
                   for s in shards]})


def write_shard(folder: Path, index: int, pieces: list[np.ndarray]) -> tuple[str, dict]:
    """Shard `index` written whole (temporary file, fsync, rename); returns its file name and seal."""
    name = f"shard-{index:05d}.bin"
    tokens = np.concatenate(pieces).astype(TOKEN_DTYPE, copy=False)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            handle.write(tokens.tobytes())
            handle.flush()
            os.fsync(handle.fileno())

    write_atomic(folder / name, write)
    return name, seal(folder / name)


def prepare(folder: Path, key: str, documents: Callable[[int], Iterator[Document]], tokenizer,
            max_tokens: int | None, shard_tokens: int, workers: int | None,
            exact: list[Document] | None) -> TokenStore:
    """Tokenize the documents into shards after those a killed preparation left (module doc); returns the store."""
    manifest = read_manifest(folder, key)
    shards = intact_shards(folder, manifest) if manifest else []
    total = sum(s.tokens for s in shards)
    read = shards[-1].documents if shards else 0
    log.info("token store: preparing %s%s", folder, f" after {len(shards)} finished shards" if shards else "")
    bar = progress(total=max_tokens, initial=total, unit="tok", unit_scale=True, desc="token store")
    pieces, pending = [], 0
    done = max_tokens is not None and total >= max_tokens
    with bar:
        for ids in [] if done else tokenized(documents(read), tokenizer, workers):
            if max_tokens is not None:
                ids = ids[:max_tokens - total]
            pieces.append(ids)
            pending, total, read = pending + len(ids), total + len(ids), read + 1
            bar.update(len(ids))
            full = max_tokens is not None and total >= max_tokens
            if pending >= shard_tokens or full and pending:
                name, sealed = write_shard(folder, len(shards), pieces)
                shards.append(Shard(name, pending, read, sealed))
                write_manifest(folder, key, shards, complete=False)
                pieces, pending = [], 0
            if full:
                break
        if pending:
            name, sealed = write_shard(folder, len(shards), pieces)
            shards.append(Shard(name, pending, read, sealed))
    write_manifest(folder, key, shards, complete=True)
    log.info("token store: built %s (%s tokens, %d shards)", folder, f"{total:,}", len(shards))
    return TokenStore(folder, key, shards, exact)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing in a pool, in order

_worker_tokenizer = None


def _start_worker(tokenizer) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    _worker_tokenizer = tokenizer


def token_arrays(texts: list[str], tokenizer=None) -> list[np.ndarray]:
    """Each text's `document_ids` as an int32 array, with `tokenizer` or, in a pool's worker, the worker's own."""
    ids = document_ids(texts, tokenizer if tokenizer is not None else _worker_tokenizer)
    return [np.asarray(doc_ids, dtype=TOKEN_DTYPE) for doc_ids in ids]


def batches(documents: Iterable[Document], size: int) -> Iterator[list[str]]:
    batch = []
    for doc in documents:
        batch.append(doc.text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenized(documents: Iterable[Document], tokenizer, workers: int | None) -> Iterator[np.ndarray]:
    """Each document's ids (`token_arrays`), in document order: in this process for one worker or a single batch,
    else in a pool with at most `TASKS_AHEAD` batches per worker in flight. The pool has `workers` processes (None:
    one per CPU), at most the CPUs this process may use and the batches there are (`pool_size`: the first ones are
    read before it starts)."""
    texts = batches(documents, DOCUMENTS_PER_TASK)
    most = pool_size(workers, "data.workers")
    head = list(itertools.islice(texts, most))
    if not head:
        return
    size = min(most, len(head))
    if size <= 1:
        for batch in head:
            yield from token_arrays(batch, tokenizer)
        yield from (ids for batch in texts for ids in token_arrays(batch, tokenizer))
        return
    with ProcessPoolExecutor(size, mp_context=pool_context(), initializer=_start_worker,
                             initargs=(tokenizer,)) as pool:
        queued: collections.deque = collections.deque()
        try:
            for batch in itertools.chain(head, texts):
                queued.append(pool.submit(token_arrays, batch))
                if len(queued) >= size * TASKS_AHEAD:
                    yield from queued.popleft().result()
            while queued:
                yield from queued.popleft().result()
        finally:
            for future in queued:
                future.cancel()


def pool_context():
    """Workers forked where the platform forks (Linux): they inherit the tokenizer and import nothing, and a script
    without a `__main__` guard is not run again in each of them (under `spawn` it would be, and its own preparation
    would wait for this one's lock). Elsewhere, spawned."""
    import multiprocessing

    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


