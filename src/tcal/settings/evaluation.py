"""`eval`: what the final evaluation (and every point of a training curve) measures (conf/eval/; the
measurements: tcal.evaluate). Perplexity on every eval set, the lm-eval harness (`eval/harness`), RULER-style
needles (`eval/ruler`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from tcal.registry import HARNESSES, RULERS
from tcal.settings.fields import (
    HARNESS,
    PPL,
    RULER,
    Key,
    SettingError,
    Settings,
    bad,
    declared,
    each,
    is_int,
    one_of,
    optional,
    positive_int,
    seed_value,
    setting,
    window_length,
)

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
NEEDLE_TASKS = ("niah_single", "niah_multikey", "niah_multivalue")  # read one stated value back; the rest track


@declared
@dataclass
class HarnessSettings(Settings):
    """`none`: no lm-eval harness."""

    name: str = setting("none", affects=[HARNESS], check=one_of(HARNESSES.names))


@declared
@dataclass
class LocalHarnessSettings(HarnessSettings):
    """`local`: lm-eval on tasks built from held-out text (offline)."""

    name: str = setting("local", affects=[HARNESS])
    n_examples: int = setting(200, affects=[HARNESS], check=positive_int)  # examples generated per task
    # examples evaluated per task (null: all); keeps the CPU main job short
    limit: Optional[int] = setting(40, affects=[HARNESS], check=optional(positive_int))
    seed: int = setting(0, affects=[HARNESS], check=seed_value)
    batch_size: int = setting(8, affects=[HARNESS], check=positive_int)
    max_length: int = setting(512, affects=[HARNESS], check=positive_int)


@declared
@dataclass
class PaperHarnessSettings(HarnessSettings):
    """`paper`: the paper's zero-shot tasks and MMLU 5-shot (needs the dataset hub)."""

    name: str = setting("paper", affects=[HARNESS])
    limit: Optional[int] = setting(None, affects=[HARNESS], check=optional(positive_int))
    batch_size: int = setting(8, affects=[HARNESS], check=positive_int)
    max_length: int = setting(2048, affects=[HARNESS], check=positive_int)


@declared
@dataclass
class RulerSettings(Settings):
    """`none`: no RULER-style needles."""

    name: str = setting("none", affects=[RULER], check=one_of(RULERS.names))


@declared
@dataclass
class NeedleRulerSettings(RulerSettings):
    """`default`: RULER-style needle-in-a-haystack tasks over held-out text, `n` examples per task and length."""

    name: str = setting("default", affects=[RULER])
    lengths: List[int] = setting(affects=[RULER], factory=lambda: [512, 1024, 2048, 4096], check=each(positive_int))
    tasks: List[str] = setting(affects=[RULER], factory=lambda: list(RULER_TASKS), check=each(one_of(RULER_TASKS)))
    n: int = setting(10, affects=[RULER], check=positive_int)
    seed: int = setting(0, affects=[RULER], check=seed_value)
    # examples of one length and task decoded together (tcal.evaluate.ruler.generate_batch): the same greedy replies
    # as one by one up to a near-tie broken by rounding, so it is in the scores' key. At 4 a process generating
    # SmolLM2's RULER at 4,096 tokens on a CPU peaked at 2.6 GB (4.1 GB at 8); a GPU takes more
    batch_size: int = setting(4, affects=[RULER], check=positive_int)

    def check(self) -> None:
        if not self.lengths or not self.tasks:
            raise SettingError(Key("lengths"), f"={list(self.lengths)}, ", Key("tasks"), f"={list(self.tasks)}; "
                               f"expected at least one of each (or eval/ruler=none)")


def an_option_of(registry):
    """The settings of one of `registry`'s options (`eval/harness=<name>`)."""
    def check(key: str, value) -> None:
        options = registry.settings_classes()
        if not isinstance(value, tuple(options.values())):
            raise bad(key, value, f"an option of {registry.group}: {', '.join(options)} ({registry.group}=none turns "
                                  f"it off)")
    return check


@declared
@dataclass
class EvalSettings(Settings):
    """Perplexity of teacher and student on every eval set (`num_windows` windows of `seq_len` tokens), plus the
    harness and RULER."""

    schema = "eval/eval"

    seq_len: int = setting(512, affects=[PPL], check=window_length)
    num_windows: int = setting(16, affects=[PPL], check=positive_int)
    batch_size: int = setting(4, affects=[PPL], check=positive_int)
    position_buckets: Optional[List[int]] = setting(None, affects=[PPL])  # first position of each bucket
    harness: Any = setting(affects=[HARNESS], factory=LocalHarnessSettings, check=an_option_of(HARNESSES))
    ruler: Any = setting(affects=[RULER], factory=RulerSettings, check=an_option_of(RULERS))

    def check(self) -> None:
        starts = self.position_buckets
        if starts is not None:
            ok = (starts and starts[0] == 0 and all(is_int(s) for s in starts)
                  and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < self.seq_len)
            if not ok:
                raise SettingError(Key("position_buckets"), f"={list(starts)}; expected null or increasing integers "
                                   f"from 0, each below ", Key("seq_len"), f"={self.seq_len} (the first position of "
                                   f"each bucket)")

    def lengths(self) -> list[tuple[str, int]]:
        """(key, length) of every sequence this evaluation feeds the teacher."""
        lengths = [("eval.seq_len", self.seq_len)]
        if self.ruler.name != "none":
            lengths.append(("eval.ruler.lengths", max(self.ruler.lengths)))
        return lengths
