"""What every settings field declares besides its type and default: the products of a run it changes.

    ratio: float = setting(0.5, affects=KEEP)          # changes which layers are kept, not their scores

A run makes, in order: retention `scores`, the `keep` list, the initialized GDN layers (`init`), the trained
student (`train`), and the evaluation figures (`ppl`, `harness`, `ruler`). A field names the products it changes
directly (what changes downstream of them follows from the run, and a cache of a later product keys the earlier
ones by their own digests). From that one declaration:

- a field is *result*-relevant when it changes scores, keep list, init or training, *eval*-only when it changes
  only evaluation figures, and changes *nothing* when it names no product (paths, loggers, cache switches);
- a cache key holds exactly the fields that change its product (`tcal.settings.relevance.settings_key`);
- a resumed run may change only fields that change nothing; `tcal-report` names variants by result fields.

A field without the declaration is refused when its class is defined (`declared`), so a new knob cannot drop out
of the cache keys.

Checks: each settings class checks its own fields when it is built (`Settings.check`, run from `__post_init__`),
raising `SettingError` with the field's name relative to the object. Whoever knows where the object sits places
the error (`SettingError.placed`): `tcal`'s converter says `init.pool.tokens=...`, a notebook that built
`PoolSettings(tokens=-1)` reads `PoolSettings.tokens=-1`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from tcal.errors import ConfigError

PRODUCTS = ("scores", "keep", "init", "train", "ppl", "harness", "ruler")
SCORES, KEEP, INIT, TRAIN, PPL, HARNESS, RULER = PRODUCTS
RESULT = (SCORES, KEEP, INIT, TRAIN)  # what the run builds
EVALUATION = (PPL, HARNESS, RULER)  # what it measures of it
EVERYTHING = PRODUCTS
NOTHING: tuple[str, ...] = ()
AFFECTS = "affects"  # the field metadata key
REQUIRED = "???"  # OmegaConf's mark of a value a config must set (`omegaconf.MISSING`)


def setting(default: Any = dataclasses.MISSING, *, affects: Iterable[str], factory=None) -> Any:
    """A settings field with its default (or `factory` for a mutable default) and the products it changes."""
    products = frozenset(affects)
    unknown = sorted(products - set(PRODUCTS))
    if unknown:
        raise ValueError(f"affects={sorted(products)}: {unknown} are not products; expected some of {PRODUCTS}")
    metadata = {AFFECTS: products}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def affects(field: dataclasses.Field) -> frozenset[str]:
    return field.metadata[AFFECTS]


def relevance(products: Iterable[str]) -> str:
    """`result`, `eval` or `none`: what changing a field of these products changes."""
    products = set(products)
    return "result" if products & set(RESULT) else "eval" if products else "none"


def declared(cls):
    """Class decorator after @dataclass: every field of `cls` declares what it affects (TypeError naming the field
    otherwise), so no settings field can be added without saying whether it changes the result."""
    for field in dataclasses.fields(cls):
        if AFFECTS not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name}: a settings field must declare what it affects "
                            f"(tcal.settings.fields.setting(..., affects=...))")
    return cls


# ------------------------------------------------------------------------------------------------ errors


class Key(str):
    """A field's name inside an error message: the error's place is written before it when it is shown."""


class SettingError(ConfigError):
    """A bad value, named by its field. Built from parts: plain text, and `Key`s that are shown under the place
    of the object that checked them (`placed`); without a place, under the object's class name."""

    def __init__(self, *parts: str):
        self.parts, self.place, self.owner = parts, None, None
        super().__init__(str(self))

    def placed(self, place: str) -> SettingError:
        """This error with `place` (`init.pool.`, or "" at the run's root) before each key; returns itself."""
        self.place = place
        self.args = (str(self),)
        return self

    def owned_by(self, owner: str) -> SettingError:
        if self.owner is None:
            self.owner = owner
            self.args = (str(self),)
        return self

    def __str__(self) -> str:
        prefix = self.place if self.place is not None else f"{self.owner}." if self.owner else ""
        return "".join(prefix + part if isinstance(part, Key) else part for part in self.parts)


def bad(key: str, value: Any, expected: str) -> SettingError:
    """`<key>=<value>; expected <expected>`."""
    return SettingError(Key(key), f"={value!r}; expected {expected}")


class Settings:
    """Base of the settings dataclasses: an object checks its own fields when it is built."""

    def __post_init__(self):
        try:
            self.check()
        except SettingError as err:
            raise err.owned_by(type(self).__name__) from None

    def check(self) -> None:
        """Raise SettingError for a bad field (nothing to check by default)."""


# ------------------------------------------------------------------------------------------------ checks


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def one_of(key: str, value, allowed: Iterable) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise bad(key, value, f"one of {', '.join(map(str, allowed))}")


def positive_int(key: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise bad(key, value, "a positive integer")


def optional_positive_int(key: str, value) -> None:
    if value is not None:
        positive_int(key, value)


def positive_number(key: str, value, what: str = "a number > 0") -> None:
    if not is_number(value) or value <= 0:
        raise bad(key, value, what)


def learning_rate(key: str, value) -> None:
    positive_number(key, value, "a learning rate > 0")


def non_negative(key: str, value) -> None:
    if not is_number(value) or value < 0:
        raise bad(key, value, "a number >= 0")


def fraction(key: str, value, what: str = "a number in [0, 1]") -> None:
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise bad(key, value, what)


def window_length(key: str, value) -> None:
    """A window the run predicts tokens in: at least 2 tokens (with 1 nothing is predicted, and a token budget
    becomes one step per token)."""
    if not is_int(value) or value < 2:
        raise bad(key, value, "an integer >= 2 (a window needs a next token to predict)")


def distinct_names(key: str, values, allowed: Iterable[str], what: str) -> None:
    """A non-empty list without repeats of names from `allowed`."""
    values, allowed = list(values), list(allowed)
    if not values or any(v not in allowed for v in values) or len(set(values)) != len(values):
        raise SettingError(Key(key), f"={values}; expected a non-empty list without repeats of {', '.join(allowed)}"
                           + (f" ({what})" if what else ""))


SEED_LIMIT = 2 ** 64  # torch.manual_seed's range; seeds derived from a run's seed are folded into it


def seed_value(key: str, value) -> None:
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise bad(key, value, "an integer in [0, 2**64)")


def derived_seed(seed: int, scale: int, offset: int) -> int:
    """`seed * scale + offset` folded into torch's seed range [0, 2**64) (`seed` may be any 64-bit seed): the
    same number as unfolded wherever that fits."""
    return (int(seed) * scale + offset) % SEED_LIMIT
