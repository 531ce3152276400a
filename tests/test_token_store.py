"""The token store (`tcal.data.token_store`) and what the stages read of it (`tcal.training.data.plan_reading`), on an
offline jsonl corpus of a few MB that this file writes, read through `datasets`' local json builder as a stream."""

from __future__ import annotations

import json
import os
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose, isolated_cache_dir, repo_cache_dir

from tcal.data import token_store
from tcal.data.documents import Document, StreamedDocuments, load_splits, token_stream, tokenize_documents
from tcal.errors import DataError
from tcal.teachers.load import load_tokenizer
from tcal.training.data import (
    EpochWindows,
    PackedTextDataModule,
    Windows,
    distinct_tokens,
    pack,
    plan_reading,
    window_sample_indices,
)

WORDS = ("river stone light ember quiet harbor meadow signal copper lantern orchard thunder velvet marble "
         "falcon winter garden silver canyon whisper").split()
DOCUMENTS = 2000  # about 2.4 MB of text
HELD_OUT = (5, 7)  # calibration, evaluation documents
SHARD_TOKENS = 100_000


def write_corpus(path: Path) -> Path:
    """`DOCUMENTS` jsonl rows of seeded random words (some with an empty text, which the source skips)."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(DOCUMENTS):
            words = [rng.choice(WORDS) for _ in range(rng.randint(50, 300))]
            text = "" if i % 97 == 13 else " ".join(words).capitalize() + "."
            handle.write(json.dumps({"text": text, "id": i}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "fineweb_sample.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())


def local_data(corpus: Path, *overrides: str) -> tuple[str, ...]:
    """`data=fineweb_edu` read from the local copy `corpus` (the json builder, streamed)."""
    return ("data=fineweb_edu", "data.dataset=json", "data.subset=null", f"data.data_files={{train:['{corpus}']}}",
            f"data.calibration_docs={HELD_OUT[0]}", f"data.evaluation_docs={HELD_OUT[1]}",
            f"data.shard_tokens={SHARD_TOKENS}", "data.workers=1", *overrides)


def corpus_documents(corpus: Path) -> list[Document]:
    """Every non-empty row of the corpus, named as the source names them, read at once."""
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    return [Document(f"json:{i}", row["text"]) for i, row in enumerate(rows) if row["text"].strip()]


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.bin"))}


def test_streamed_split_holds_out_the_head_and_trains_on_the_rest(corpus, data):
    splits = load_splits(data)
    docs = corpus_documents(corpus)
    head = sum(HELD_OUT)
    assert isinstance(splits.train, StreamedDocuments)
    assert (len(splits.calibration), len(splits.evaluation)) == HELD_OUT
    assert sorted(d.name for d in splits.calibration + splits.evaluation) == sorted(d.name for d in docs[:head])
    assert [d.name for d in splits.train] == [d.name for d in docs[head:]]  # disjoint, in stream order
    assert [d.name for d in load_splits(data).calibration] == [d.name for d in splits.calibration]  # seeded
    other = load_splits(compose(*local_data(corpus), "data.split_seed=1").data)
    assert {d.name for d in other.calibration} != {d.name for d in splits.calibration}


@pytest.fixture(scope="module")
def data(corpus):
    return compose(*local_data(corpus)).data


@pytest.fixture(scope="module")
def whole(corpus, tokenizer, data, tmp_path_factory):
    """The corpus's store, prepared once in a folder of its own."""
    return token_store.open_store(load_splits(data).train, tokenizer, tmp_path_factory.mktemp("whole"), data)


def test_the_store_is_the_in_memory_tokenization_of_the_training_documents(corpus, tokenizer, whole):
    expected = tokenize_documents(corpus_documents(corpus)[sum(HELD_OUT):], tokenizer)
    assert whole.num_tokens == expected.numel() > 3 * SHARD_TOKENS and len(whole.shards) >= 3
    assert torch.equal(whole.tokens(0, whole.num_tokens), expected)
    middle = whole.offsets[1]  # a slice across a shard boundary
    assert torch.equal(whole.tokens(middle - 5, middle + 5), expected[middle - 5:middle + 5])


def test_a_second_run_prepares_nothing(tokenizer, data, whole, monkeypatch):
    mtimes = {p.name: p.stat().st_mtime_ns for p in whole.folder.iterdir()}
    monkeypatch.setattr(token_store, "tokenized", lambda *a: pytest.fail("tokenized again"))
    again = token_store.open_store(load_splits(data).train, tokenizer, whole.folder.parents[1], data)
    assert again.folder == whole.folder and again.num_tokens == whole.num_tokens
    assert {p.name: p.stat().st_mtime_ns for p in again.folder.iterdir()} == mtimes


def test_a_killed_preparation_continues_where_it_stopped(tokenizer, data, whole, tmp_path, monkeypatch):
    train = load_splits(data).train
    written = []
    real_write = token_store.write_shard

    def killed_after_two(folder, index, pieces):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(index)
        return real_write(folder, index, pieces)

    monkeypatch.setattr(token_store, "write_shard", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        token_store.open_store(train, tokenizer, tmp_path, data)
    folder = tmp_path / "token_store" / whole.key
    manifest = json.loads((folder / token_store.MANIFEST).read_text())
    assert not manifest["complete"] and [s["file"] for s in manifest["shards"]] == ["shard-00000.bin",
                                                                                     "shard-00001.bin"]
    monkeypatch.setattr(token_store, "write_shard", real_write)
    documents = []
    real_tokenized = token_store.tokenized
    monkeypatch.setattr(token_store, "tokenized",
                        lambda docs, *a: real_tokenized((documents.append(d) or d for d in docs), *a))
    continued = token_store.open_store(train, tokenizer, tmp_path, data)
    assert documents[0].name == list(train)[manifest["documents"]].name  # the finished shards were not redone
    assert shard_bytes(continued.folder) == shard_bytes(whole.folder)


def test_a_damaged_shard_is_prepared_again(tokenizer, data, whole, tmp_path):
    import shutil

    folder = tmp_path / "token_store" / whole.key
    shutil.copytree(whole.folder, folder)
    damaged = folder / whole.shards[1].file
    damaged.write_bytes(damaged.read_bytes()[:-4])  # one token short: a torn copy
    store = token_store.open_store(load_splits(data).train, tokenizer, tmp_path, data)
    assert shard_bytes(store.folder) == shard_bytes(whole.folder)


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewritten", "rewritten_with_its_mtime_put_back"])
def test_a_shard_whose_bytes_change_but_not_its_size_is_prepared_again(keep_mtime, tokenizer, data, whole, tmp_path):
    """Its seal (sha256 and file identity) finds it, not its size: a store read by a resumed run is the one its
    documents make, never bytes changed under it."""
    import os
    import shutil

    folder = tmp_path / "token_store" / whole.key
    shutil.copytree(whole.folder, folder)
    token_store.open_store(load_splits(data).train, tokenizer, tmp_path, data)  # a copy: hashed once, sealed again
    changed = folder / whole.shards[1].file
    before = changed.stat()
    tokens = np.fromfile(changed, dtype=token_store.TOKEN_DTYPE)
    tokens[:8] = tokens[8:16]  # other tokens, the same size
    tokens.tofile(changed)
    if keep_mtime:
        os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert changed.stat().st_size == before.st_size
    store = token_store.open_store(load_splits(data).train, tokenizer, tmp_path, data)
    assert shard_bytes(store.folder) == shard_bytes(whole.folder)
    manifest = json.loads((folder / token_store.MANIFEST).read_text())
    assert [s["sealed"]["sha256"] for s in manifest["shards"]] == [s.sealed["sha256"] for s in whole.shards]


def test_a_store_without_seals_is_sealed_once(tokenizer, data, whole, tmp_path):
    """A store prepared before shards were sealed is trusted by its sizes once, then sealed."""
    import shutil

    from tcal.store.fingerprint import file_identity

    folder = tmp_path / "token_store" / whole.key
    shutil.copytree(whole.folder, folder)
    manifest = json.loads((folder / token_store.MANIFEST).read_text())
    for shard in manifest["shards"]:
        del shard["sealed"]
    (folder / token_store.MANIFEST).write_text(json.dumps(manifest))
    store = token_store.open_store(load_splits(data).train, tokenizer, tmp_path, data)
    assert shard_bytes(store.folder) == shard_bytes(whole.folder)
    sealed = json.loads((folder / token_store.MANIFEST).read_text())["shards"]
    assert all(s["sealed"]["identity"] == file_identity(folder / s["file"]) for s in sealed)


def test_a_local_copy_changed_in_place_makes_another_store(corpus, tokenizer, tmp_path):
    """A local dataset file whose text changes but not its size (one word for another of the same length) is
    another source: its store key is another, not the old store's."""
    copy = tmp_path / corpus.name
    copy.write_bytes(corpus.read_bytes())
    data = compose(*local_data(copy)).data
    first = token_store.store_key(load_splits(data).train, tokenizer, None)
    text = copy.read_text()
    word = next(w for w in WORDS if f" {w} " in text and len(w) == 5)
    other = next(w for w in WORDS if len(w) == 5 and w != word and f" {w} " in text)
    copy.write_text(text.replace(f" {word} ", f" {other} ", 1))
    assert copy.stat().st_size == corpus.stat().st_size
    assert token_store.store_key(load_splits(data).train, tokenizer, None) != first


def test_shard_size_and_workers_change_the_files_not_the_tokens(corpus, tokenizer, whole, tmp_path):
    """`data.shard_tokens` and `data.workers` are declared as changing nothing: the tokens are the same."""
    pooled = compose(*local_data(corpus, "data.workers=2", "data.shard_tokens=1000000000")).data
    two = token_store.open_store(load_splits(pooled).train, tokenizer, tmp_path, pooled)
    assert two.key == whole.key and len(two.shards) == 1 < len(whole.shards)
    assert torch.equal(two.tokens(0, two.num_tokens), whole.tokens(0, whole.num_tokens))


def test_the_cap_keeps_the_first_max_tokens(corpus, tokenizer, whole, tmp_path):
    capped = compose(*local_data(corpus, "data.max_tokens=123457")).data
    cut = token_store.open_store(load_splits(capped).train, tokenizer, tmp_path, capped)
    assert cut.key != whole.key and cut.num_tokens == 123457
    assert torch.equal(cut.tokens(0, cut.num_tokens), whole.tokens(0, 123457))


def test_two_preparations_at_once_build_one_store(tokenizer, data, tmp_path, monkeypatch):
    train = load_splits(data).train
    calls, real_tokenized = [], token_store.tokenized
    monkeypatch.setattr(token_store, "tokenized", lambda *a: calls.append(1) or real_tokenized(*a))
    stores = [None, None]

    def prepare(i):
        stores[i] = token_store.open_store(train, tokenizer, tmp_path, data)

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert torch.equal(stores[0].tokens(0, stores[0].num_tokens), stores[1].tokens(0, stores[1].num_tokens))


def test_shakespeare_store_is_its_token_stream_and_keeps_its_windows(tokenizer, tmp_path):
    data = compose().data
    splits = load_splits(data)
    store = token_store.open_store(splits.train, tokenizer, tmp_path, data)
    stream = token_stream(splits.train, tokenizer)
    assert store.documents == splits.train  # the retrieval mix keeps reading the whole split's words
    assert torch.equal(store.tokens(0, store.num_tokens), stream)
    windows, packed = Windows(store, 512), pack(stream, 512)
    assert len(windows) == len(packed) and all(torch.equal(windows[i], packed[i]) for i in (0, 7, len(packed) - 1))


def test_a_local_parquet_copy_is_read_offline(corpus, tokenizer, whole, tmp_path):
    """The same rows as parquet shards (a folder matched by a pattern) give the same training tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    for part in range(2):
        half = rows[part * len(rows) // 2:(part + 1) * len(rows) // 2]
        pq.write_table(pa.Table.from_pylist(half), tmp_path / f"train-{part:05d}.parquet")
    data = compose(*local_data(corpus), "data.dataset=parquet",
                   f"data.data_files={{train:'{tmp_path}/train-*.parquet'}}").data
    store = token_store.open_store(load_splits(data).train, tokenizer, tmp_path / "cache", data)
    assert store.key != whole.key  # another source, another store
    assert torch.equal(store.tokens(0, store.num_tokens), whole.tokens(0, whole.num_tokens))


def test_a_streamed_retrieval_mix_reads_a_bounded_sample(tokenizer, whole):
    module = PackedTextDataModule(whole, tokenizer, 192, 4, 6, 0, retrieval_mix=0.25, retrieval_sample_tokens=20_000)
    assert module.sequences.stream.numel() == 20_000
    assert set(module.sequences.words) <= set(WORDS)  # key words of the sample's text
    assert module.dataset()[3].shape == (192,)  # sample 3 of a quarter mix is a retrieval sequence


def test_missing_local_shards_fail_before_work_on_one_line(corpus, compose_cfg, tmp_path):
    from test_errors import run_fails

    from tcal.errors import ConfigError

    missing = f"{tmp_path}/nowhere/*.parquet"
    match = rf"^data.data_files: '{re.escape(missing)}' matches no file \(data.dataset='parquet' reads local files\)"
    with pytest.raises(ConfigError, match=match):
        load_splits(compose(*local_data(corpus), "data.dataset=parquet", f"data.data_files={{train:'{missing}'}}").data)
    run_fails(compose_cfg, tmp_path, ConfigError, match, *local_data(corpus), "data.dataset=parquet",
              f"data.data_files={{train:'{missing}'}}")


def test_a_streamed_source_needs_the_store(tokenizer, data):
    with pytest.raises(DataError, match=r"data.dataset='json' is streamed .* expected stage.cache_tokens=true"):
        token_store.training_tokens(load_splits(data).train, tokenizer, None, data)


# ---------------------------------------------------------------------------------------------------------------
# Which windows each stage reads


def starts_of(reading) -> set[int]:
    return set(reading.read_starts().tolist())


def test_the_first_stage_reads_todays_windows_and_a_later_stage_unread_ones():
    first, second = plan_reading(100_000, [("align", 16, 300), ("distill", 64, 200)], seed=0)
    assert first.numbers is None and first.region == "store"  # every window, in today's seeded order
    order = EpochWindows(range(100_000 // 16), 0).order(0)
    assert np.array_equal(first.read, order[:300].numpy())
    assert second.region == "unread" and second.read is not None
    read_by_first = {t for s in starts_of(first) for t in range(s, s + 16)}
    assert not any(t in read_by_first for s in starts_of(second) for t in range(s, s + 64))
    assert distinct_tokens([first, second]) == 300 * 16 + 200 * 64  # each window at most once
    assert first.passes < 1 and second.passes < 1


def test_a_budget_past_the_store_reads_every_window_more_than_once():
    (only,) = plan_reading(1000, [("distill", 10, 250)], seed=0)
    assert only.read is None and only.passes == 2.5 and distinct_tokens([only]) == 1000
    first, second = plan_reading(1000, [("align", 10, 50), ("distill", 10, 80)], seed=0)
    assert second.region == "store" and second.numbers is None  # 50 unread windows cannot hold 80 samples


def test_retrieval_samples_read_no_window():
    g = window_sample_indices(8, 0.25)
    assert g.tolist() == [0, 1, 2, 4, 5, 6]  # samples 3 and 7 are retrieval sequences
    (reading,) = plan_reading(10_000, [("distill", 10, 8)], seed=0, fraction=0.25)
    assert reading.window_samples == 6 and len(reading.read) == 6


# ---------------------------------------------------------------------------------------------------------------
# A run states what it reads


def test_a_run_past_its_store_says_so_before_work_and_records_it(corpus, tmp_path, capsys):
    from tcal.pipeline import run

    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=zero_gate",
                  *local_data(corpus, "data.max_tokens=1024"), "stage=distill", "stage.batch_size=2",
                  "stage.seq_len=32", "stage.max_tokens=2048", "stage.eval_every_tokens=2048", "eval.num_windows=2",
                  "logger=none", "save_student=false")
    result = run(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("data: "))
    assert re.search(r"holds 1,024 distinct training tokens; distill reads 2,048 tokens from 1,024 \(every window\): "
                     r"2 passes; .*2 passes over the store; the budget exceeds the distinct tokens", line)
    assert out.index(line) < out.index("stage distill:")  # before the stage ran
    assert result["data"]["store"]["tokens"] == 1024
    assert result["data"]["stages"]["distill"] == {"tokens": 2048, "seq_len": 32, "region": "store",
                                                   "region_tokens": 1024, "passes": 2.0}
    assert result["data"]["distinct_tokens"] == 1024 and result["data"]["passes"] == 2.0
    recorded = json.loads((tmp_path / "run" / "results.json").read_text())
    assert recorded["data"] == result["data"]


class RecordingPool:
    """A ProcessPoolExecutor's stand-in that runs each task here and records how many workers it was asked for (no
    process is forked, whatever the count)."""

    sizes: list = []

    def __init__(self, max_workers, **kwargs):
        RecordingPool.sizes.append(max_workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args, tokenizer=self.tokenizer))
        return future


@pytest.mark.parametrize("asked,batches,cpus,started", [(100_000, 3, 8, 3), (100_000, 40, 8, 8), (None, 2, 8, 2),
                                                         (5, 40, 8, 5), (100_000, 1, 8, None)])
def test_the_token_store_s_pool_is_bounded_where_it_forks(asked, batches, cpus, started, tokenizer, monkeypatch,
                                                          caplog):
    """However many workers are asked (the Python API has no preflight), the pool has at most one per CPU this
    process may use and one per batch of documents; a single batch is tokenized here; more than the CPUs is said."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(RecordingPool, "sizes", [])
    monkeypatch.setattr(RecordingPool, "tokenizer", tokenizer, raising=False)
    monkeypatch.setattr(token_store, "ProcessPoolExecutor", RecordingPool)
    docs = [Document(f"d{i}", f"{WORDS[i % len(WORDS)]} {i}.")
            for i in range(batches * token_store.DOCUMENTS_PER_TASK)]
    ids = list(token_store.tokenized(docs, tokenizer, asked))
    assert [a.tolist() for a in ids] == [a.tolist() for a in token_store.token_arrays([d.text for d in docs],
                                                                                      tokenizer)]
    assert RecordingPool.sizes == ([] if started is None else [started])
    assert (f"data.workers={asked}: at most {cpus} worker processes" in caplog.text) == bool(asked and asked > cpus)
