"""`retention`: which layers keep softmax attention (conf/retention/; the policies: tcal.retention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from tcal.registry import POLICIES
from tcal.settings.fields import (
    KEEP,
    NOTHING,
    REQUIRED,
    SCORES,
    Key,
    SettingError,
    Settings,
    at_least,
    bad,
    bound,
    declared,
    is_int,
    is_number,
    one_of,
    optional,
    positive_int,
    setting,
    window_length,
)

PROBES = ("bypass", "gdn")  # recall's probe: a layer's attention output zeroed, or replaced by its initialized GDN
FILLS = ("text", "uniform")  # how recall places the kept layers its score does not choose
# recall's search on the converted student after the rule (docs/method.md, "Retained-layer policies": the search)
SEARCHES = ("none", "greedy", "prune")
MIN_PROBE_LEN = 128  # a retrieval sequence holds needles, a question and an answer besides its text
probe_length = at_least(MIN_PROBE_LEN, f"an integer >= {MIN_PROBE_LEN} (a probe sequence holds needles, a question "
                        f"and an answer besides its text)", integer=True)


def num_kept(ratio: float, num_layers: int) -> int:
    """K = round(ratio * L), halves rounded up, at least 1; ratio must lie in (0, 1]."""
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"retention.ratio={ratio} must lie in (0, 1]")
    return max(1, min(num_layers, int(ratio * num_layers + 0.5)))


def uniform_layers(num_layers: int, ratio: float) -> list[int]:
    """Every (L / K)-th layer from layer 0 (L=28, K=7: 0, 4, ..., 24)."""
    k = num_kept(ratio, num_layers)
    return [i * num_layers // k for i in range(k)]


def validate_keep_layers(keep_layers, num_layers: int) -> list[int]:
    """Sorted keep list; errors name the bad value."""
    keep = [int(i) for i in keep_layers]
    if not keep:
        raise ValueError("keep_layers is empty: at least one layer must stay softmax attention")
    out_of_range = [i for i in keep if not 0 <= i < num_layers]
    if out_of_range:
        raise ValueError(f"keep_layers {out_of_range} out of range for a teacher with {num_layers} layers "
                         f"(0..{num_layers - 1})")
    repeated = sorted({i for i in keep if keep.count(i) > 1})
    if repeated:
        raise ValueError(f"keep_layers repeats {repeated}")
    return sorted(keep)


def keep_ratio(key: str, ratio) -> None:
    if not is_number(ratio) or not 0.0 < ratio <= 1.0:
        raise SettingError(Key(key), f"={ratio} must lie in (0, 1]")


def layer_indices(key: str, keep) -> None:
    """A list of whole numbers >= 0 (whether each is a layer of the teacher is `check_keep`'s)."""
    if keep is None or isinstance(keep, str):
        raise SettingError(Key(key), "=None; expected a list of layer indices, e.g. ", Key(key), "=[0,2]")
    negative = [i for i in keep if i < 0]
    if negative:
        raise SettingError(Key(key), f"={list(keep)} holds {negative}, not layer indices; expected whole numbers >= 0, "
                           f"e.g. ", Key(key), "=[0,2]")


class PolicySettings(Settings):
    """What a policy's settings answer for the run, which asks them instead of the policy's name: how many layers
    it keeps, its keep list when known without the teacher (`tcal-plan`), what it needs of the teacher and of the
    calibration split (keys under `retention.`)."""

    def kept(self, num_layers: int) -> int:
        raise NotImplementedError

    def keep_setting(self) -> str:
        """The setting that decides how many layers are kept, as `key=value`."""
        raise NotImplementedError

    def planned_keep(self, num_layers: int) -> list[int] | None:
        """The keep list when it is known before the teacher is read; None when it is scored."""
        return None

    def check_keep(self, num_layers: int) -> None:
        """What the settings need of a teacher of `num_layers` layers (SettingError)."""

    def teacher_lengths(self) -> list[tuple[str, int]]:
        """(key, length) of the sequences the policy feeds the teacher."""
        return []

    def initializes_layers(self) -> bool:
        """Whether scoring initializes GDN layers with the run's init (which then reads the calibration split)."""
        return False

    def split_needs(self) -> list[tuple[str, int]]:
        """(what, tokens) the policy reads of the calibration split, what naming the keys that set it."""
        return []

    def needle_probe(self) -> tuple[int, int, int] | None:
        """(seq_len, sequences, seed) of the needle sequences it cuts from the calibration split, if any."""
        return None


@declared
@dataclass
class RetentionSettings(PolicySettings):
    """`uniform`: round(ratio * L) layers kept, evenly spaced."""

    name: str = setting("uniform", affects=[SCORES, KEEP], check=one_of(POLICIES.names))
    ratio: float = setting(0.5, affects=[KEEP], check=keep_ratio)

    def kept(self, num_layers: int) -> int:
        return num_kept(self.ratio, num_layers)

    def keep_setting(self) -> str:
        return f"ratio={self.ratio}"

    def planned_keep(self, num_layers: int) -> list[int]:
        return uniform_layers(num_layers, self.ratio)


@declared
@dataclass
class ScoredRetentionSettings(RetentionSettings):
    """`ar` and `ga_s2`: layers scored on windows of the calibration split (scores cached unless cache=false)."""

    name: str = setting("ar", affects=[SCORES, KEEP])
    # scoring windows from the calibration split
    seq_len: int = setting(256, affects=[SCORES], check=window_length)
    num_windows: int = setting(8, affects=[SCORES], check=positive_int)
    batch_size: int = setting(4, affects=[SCORES], check=positive_int)
    # reuse scores computed with the same key (false: score again, write nothing)
    cache: bool = setting(True, affects=NOTHING)

    def planned_keep(self, num_layers: int) -> None:
        return None

    def teacher_lengths(self) -> list[tuple[str, int]]:
        return [("retention.seq_len", self.seq_len)]

    def split_needs(self) -> list[tuple[str, int]]:
        return [(f"retention.num_windows={self.num_windows} windows of retention.seq_len={self.seq_len}",
                 self.num_windows * self.seq_len)]


@declared
@dataclass
class GaS2RetentionSettings(ScoredRetentionSettings):
    """`ga_s2`: as `ar`, each layer scored by a probe student whose other layers the run's init initializes."""

    name: str = setting("ga_s2", affects=[SCORES, KEEP])

    def initializes_layers(self) -> bool:
        return True


@declared
@dataclass
class RecallRetentionSettings(RetentionSettings):
    """`recall`: layers scored by the rise of the teacher's loss on retrieved answers beyond its rise on text, on
    synthetic needle sequences cut from the calibration split. The layers whose score stands `noise_z` standard
    errors (over the probe's sequences) above 0 are kept (`scored=N`: the N highest instead), the rest by `fill`;
    `search=greedy` then swaps fill layers for converted ones by the answer loss of the converted student;
    `search=prune` instead removes layers one at a time from a larger keep list (`prune_from`, or the rule's list at
    `prune_from_ratio`) down to `ratio`'s count, each time the one the student's answer loss misses least."""

    name: str = setting("recall", affects=[SCORES, KEEP])
    # tokens per probe sequence: as long as the shortest RULER length measured (512) and more, so that layers whose
    # retrieval shows only past a few hundred tokens are seen (docs/results.md, "What the probe sees")
    seq_len: int = setting(1024, affects=[SCORES], check=probe_length)
    # probe sequences (the probe reads num_prompts x seq_len tokens per layer, plus one base pass)
    num_prompts: int = setting(8, affects=[SCORES], check=positive_int)
    batch_size: int = setting(4, affects=[SCORES], check=positive_int)
    # draws the sequences: text slices, keys, values, wording, needle depths
    probe_seed: int = setting(0, affects=[SCORES], check=at_least(0, integer=True))
    # bypass: the layer's attention outputs 0; gdn: it is replaced by its initialized GDN (init=...)
    probe: str = setting("bypass", affects=[SCORES], check=one_of(PROBES))
    # how many of the kept layers the recall score chooses (null: those above the probe's noise, the rule)
    scored: Optional[int] = setting(None, affects=[KEEP], check=optional(at_least(
        0, "null (the layers above the probe's noise) or an integer >= 0", integer=True)))
    # the rule's margin: a layer is chosen when score - noise_z * (its standard error over the sequences) > 0
    noise_z: float = setting(3.0, affects=[KEEP], check=at_least(0, "a number >= 0 (standard errors above 0)"))
    # the rest: text (highest text-loss rise, as AR would keep) or uniform (the uniform policy's slots)
    fill: str = setting("text", affects=[KEEP], check=one_of(FILLS))
    # greedy: then swap fill layers for converted layers by the answer loss of the student itself (run's init);
    # prune: remove layers one at a time from a larger keep list by the same student figures, down to ratio's count
    search: str = setting("none", affects=[KEEP], check=one_of(SEARCHES))
    # the search's student forwards over the probe's sequences at most, the start's included
    search_budget: int = setting(32, affects=[KEEP], check=positive_int)
    # how far the search's swaps may raise the student's text loss over the start's, in nats a token (ln 1.03)
    text_margin: float = setting(0.0296, affects=[KEEP], check=at_least(0, "a number >= 0 (nats a text token)"))
    # prune: the keep list the elimination starts from (null: the rule's own list at prune_from_ratio; a list given
    # here skips the rule's probe)
    prune_from: Optional[List[int]] = setting(None, affects=[KEEP], check=optional(bound(
        lambda keep: not isinstance(keep, str) and bool(keep) and all(is_int(i) and i >= 0 for i in keep),
        "null (the rule's list at prune_from_ratio) or a non-empty list of layer indices >= 0, e.g. [0,1,16,18]")))
    # prune with prune_from=null: the ratio whose rule list (score's layers and fill) the elimination starts from
    prune_from_ratio: float = setting(0.5, affects=[KEEP], check=bound(lambda r: is_number(r) and 0.0 < r <= 1.0,
                                                                        "a number in (0, 1]"))
    # reuse scores computed with the same key (false: score again, write nothing)
    cache: bool = setting(True, affects=NOTHING)

    def check(self) -> None:
        if self.scored is None and self.num_prompts < 2:
            raise bad("num_prompts", self.num_prompts, "at least 2 with scored=null (the rule reads the spread over "
                                                       "the probe's sequences)")

    def planned_keep(self, num_layers: int) -> None:
        return None

    def teacher_lengths(self) -> list[tuple[str, int]]:
        return [("retention.seq_len", self.seq_len)]

    def check_keep(self, num_layers: int) -> None:
        kept = self.kept(num_layers)
        if self.scored is not None and self.scored > kept:
            raise SettingError(Key("scored"), f"={self.scored} is more than the {kept} layers ", Key("ratio"),
                               f"={self.ratio} keeps of {num_layers}")
        if self.search != "prune":
            return
        if self.prune_from is None:
            start = num_kept(self.prune_from_ratio, num_layers)
            if start < kept:
                raise SettingError(Key("prune_from_ratio"), f"={self.prune_from_ratio} keeps {start} of {num_layers} "
                                   f"layers, fewer than the {kept} that ", Key("ratio"), f"={self.ratio} keeps")
            return
        try:
            start = len(validate_keep_layers(list(self.prune_from), num_layers))
        except ValueError as err:
            raise SettingError(Key("prune_from"),
                               f"={list(self.prune_from)}: {str(err).replace('keep_layers ', '')}") from None
        if start < kept:
            raise SettingError(Key("prune_from"), f"={list(self.prune_from)} keeps {start} layers, fewer than the "
                               f"{kept} that ", Key("ratio"), f"={self.ratio} keeps of {num_layers}")

    def initializes_layers(self) -> bool:
        return self.probe == "gdn" or self.search != "none"

    def needle_probe(self) -> tuple[int, int, int]:
        return self.seq_len, self.num_prompts, self.probe_seed


@declared
@dataclass
class ExplicitRetentionSettings(PolicySettings):
    """`explicit`: exactly the layers in `keep`."""

    name: str = setting("explicit", affects=[SCORES, KEEP], check=one_of(["explicit"]))
    keep: List[int] = setting(REQUIRED, affects=[KEEP], check=layer_indices)

    def kept(self, num_layers: int) -> int:
        return len(set(self.keep))

    def keep_setting(self) -> str:
        return f"keep={list(self.keep)}"

    def planned_keep(self, num_layers: int) -> list[int]:
        return sorted(int(i) for i in self.keep)

    def check_keep(self, num_layers: int) -> None:
        try:
            validate_keep_layers(list(self.keep), num_layers)
        except ValueError as err:  # the student's words (`keep_layers`) told as the key the user wrote
            raise SettingError(Key("keep"), f"={list(self.keep)}: {str(err).replace('keep_layers ', '')}") from None
