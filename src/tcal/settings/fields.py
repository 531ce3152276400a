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

Checks: a field declares its own bound beside its default, a function of (key, value) that raises `SettingError`:

    steps: int = setting(300, affects=[INIT], check=positive_int)
    probe: str = setting("bypass", affects=[SCORES], check=one_of(PROBES))

Each settings object runs its fields' bounds when it is built (`check_fields`, from `__post_init__`), each under
the field's own name, then its `check()`: the checks that relate several fields. A subclass that declares a field
again (another default) keeps the bound of its base's field unless it declares its own. The errors name the field
relative to the object; whoever knows where the object sits places them (`SettingError.placed`): `tcal`'s
converter says `init.pool.tokens=...`, a notebook that built `PoolSettings(tokens=-1)` reads `PoolSettings.tokens=-1`.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Iterable

from tcal.errors import ConfigError

PRODUCTS = ("scores", "keep", "init", "train", "ppl", "harness", "ruler")
SCORES, KEEP, INIT, TRAIN, PPL, HARNESS, RULER = PRODUCTS
RESULT = (SCORES, KEEP, INIT, TRAIN)  # what the run builds
EVALUATION = (PPL, HARNESS, RULER)  # what it measures of it
EVERYTHING = PRODUCTS
NOTHING: tuple[str, ...] = ()
AFFECTS = "affects"  # the field metadata keys: the products a field changes, and its bound
CHECK = "check"
REQUIRED = "???"  # OmegaConf's mark of a value a config must set (`omegaconf.MISSING`)


def setting(default: Any = dataclasses.MISSING, *, affects: Iterable[str], factory=None,
            check: Check | None = None) -> Any:
    """A settings field with its default (or `factory` for a mutable default), the products it changes and its
    bound (`check(key, value)`, raising SettingError)."""
    products = frozenset(affects)
    unknown = sorted(products - set(PRODUCTS))
    if unknown:
        raise ValueError(f"affects={sorted(products)}: {unknown} are not products; expected some of {PRODUCTS}")
    if check is not None and not callable(check):
        raise TypeError(f"check={check!r}: expected a function of (key, value), e.g. tcal.settings.fields.positive_int")
    metadata = {AFFECTS: products, **({CHECK: check} if check is not None else {})}
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
    otherwise), so no settings field can be added without saying whether it changes the result. A field declared
    again without a bound takes its base's."""
    base = next((b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)), None)
    inherited = {f.name: f.metadata[CHECK] for f in dataclasses.fields(base) if CHECK in f.metadata} if base else {}
    for field in dataclasses.fields(cls):
        if AFFECTS not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name}: a settings field must declare what it affects "
                            f"(tcal.settings.fields.setting(..., affects=...))")
        if CHECK not in field.metadata and field.name in inherited:
            field.metadata = types.MappingProxyType({**field.metadata, CHECK: inherited[field.name]})
    return cls


def check_fields(settings) -> None:
    """Each field's declared bound, run on its value under its name."""
    for field in dataclasses.fields(settings):
        if CHECK in field.metadata:
            field.metadata[CHECK](field.name, getattr(settings, field.name))


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
        self.checked(self.check)

    def checked(self, *relations: Callable[[], None]) -> None:
        """The fields' bounds, then `relations`; a SettingError owned by this class."""
        try:
            check_fields(self)
            for relation in relations:
                relation()
        except SettingError as err:
            raise err.owned_by(type(self).__name__) from None

    def check(self) -> None:
        """Raise SettingError for fields that do not fit together (each field's own bound is declared with it)."""


# ------------------------------------------------------------------------------------------------ checks
# A check is a function of (key, value) that raises SettingError naming the key: a field's bound (`setting(...,
# check=...)`), also callable by hand.

Check = Callable[[str, Any], None]


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def bound(test: Callable[[Any], bool], expected: str) -> Check:
    """`<key>=<value>; expected <expected>` for a value that fails `test`."""
    def check(key: str, value) -> None:
        if not test(value):
            raise bad(key, value, expected)
    return check


def at_least(low, expected: str | None = None, *, integer: bool = False) -> Check:
    """A number (`integer`: an integer) >= `low`."""
    kind = is_int if integer else is_number
    return bound(lambda v: kind(v) and v >= low, expected or f"{'an integer' if integer else 'a number'} >= {low}")


def above(low, expected: str | None = None, *, integer: bool = False) -> Check:
    """A number (`integer`: an integer) > `low`."""
    kind = is_int if integer else is_number
    return bound(lambda v: kind(v) and v > low, expected or f"{'an integer' if integer else 'a number'} > {low}")


def between(low, high, expected: str | None = None) -> Check:
    """A number in [low, high]."""
    return bound(lambda v: is_number(v) and low <= v <= high, expected or f"a number in [{low}, {high}]")


def one_of(allowed: Iterable | Callable[[], Iterable], *, as_text: bool = False) -> Check:
    """One of `allowed` (or of what it returns when called: a registry's `names`, read when checked); `as_text`:
    the value's text is (`16` for "16")."""
    def check(key: str, value) -> None:
        names = list(allowed() if callable(allowed) else allowed)
        value = str(value) if as_text else value
        if value not in names:
            raise bad(key, value, f"one of {', '.join(map(str, names))}")
    return check


def distinct(allowed: Iterable | Callable[[], Iterable]) -> Check:
    """A non-empty list without repeats of names from `allowed` (or of what it returns when called)."""
    def check(key: str, values) -> None:
        values, names = list(values), list(allowed() if callable(allowed) else allowed)
        if not values or any(v not in names for v in values) or len(set(values)) != len(values):
            raise SettingError(Key(key), f"={values}; expected a non-empty list without repeats of {', '.join(names)}")
    return check


def optional(check: Check) -> Check:
    """None, or what `check` takes."""
    return lambda key, value: None if value is None else check(key, value)


def each(check: Check) -> Check:
    """A list whose every entry `check` takes (named `<key> entry`)."""
    def check_entries(key: str, values) -> None:
        for value in values:
            check(f"{key} entry", value)
    return check_entries


positive_int = above(0, "a positive integer", integer=True)
positive_number = above(0)
learning_rate = above(0, "a learning rate > 0")
non_negative = at_least(0)
# a window the run predicts tokens in: with 1 token nothing is predicted, and a token budget becomes a step a token
window_length = at_least(2, "an integer >= 2 (a window needs a next token to predict)", integer=True)


def nonblank(expected: str) -> Check:
    """Text that is not blank."""
    return bound(lambda v: isinstance(v, str) and bool(v.strip()), expected)


SEED_LIMIT = 2 ** 64  # torch.manual_seed's range; seeds derived from a run's seed are folded into it
seed_value = bound(lambda v: is_int(v) and 0 <= v < SEED_LIMIT, "an integer in [0, 2**64)")


def derived_seed(seed: int, scale: int, offset: int) -> int:
    """`seed * scale + offset` folded into torch's seed range [0, 2**64) (`seed` may be any 64-bit seed): the
    same number as unfolded wherever that fits."""
    return (int(seed) * scale + offset) % SEED_LIMIT
