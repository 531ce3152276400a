"""argparse `type`s for the tools' numeric and list options (tcal-export, tcal-plan, tcal-report, the benchmarks, the
scripts): a value that cannot mean anything (NaN, infinity, a negative size, zero of a count) is refused by argparse
itself, one line naming the option and the value, exit code 2, before any work rather than after it.

    parser.add_argument("--tolerance", type=number(at_least=0), default=1e-4)
    parser.add_argument("--contexts", type=numbers(number(int, above=0)), default=(4096,))
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def number(kind: type = float, *, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None, unit: str = "") -> Callable[[str], float]:
    """A finite `kind` (float or int) within the bounds given; `above` is exclusive, `at_least` and `at_most`
    inclusive. The error says what was expected, e.g. "'nan': expected a finite number > 0"."""
    bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
              f"<= {at_most:g}" if at_most is not None else ""]
    what = ("an integer" if kind is int else "a finite number") + (f" of {unit}" if unit else "")
    expected = " ".join([what, *filter(None, bounds)])

    def parse(text: str):
        try:
            value = kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
        if not math.isfinite(value) or (above is not None and not value > above) or \
                (at_least is not None and not value >= at_least) or (at_most is not None and not value <= at_most):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return value

    parse.__name__ = expected  # argparse names the type in some messages
    return parse


def numbers(item: Callable[[str], object]) -> Callable[[str], tuple]:
    """A comma list, each item read by `item` (e.g. `number(int, above=0)`); an empty list or item is refused."""
    def parse(text: str) -> tuple:
        parts = text.split(",")
        if not text.strip() or any(not part.strip() for part in parts):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list with no empty item")
        return tuple(item(part) for part in parts)

    parse.__name__ = "comma list"
    return parse


def name(text: str) -> str:
    """One name (an init, a project), not empty and not a list."""
    if not text.strip() or "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one name")
    return text.strip()


def names(text: str) -> list[str]:
    """A comma list of names (inits, checks, tasks), none of them empty."""
    found = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(found):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of names with no empty item")
    return found


def one_of(options) -> Callable[[str], str]:
    """A comma list's item that must be one of `options` (e.g. RULER's tasks): `numbers(one_of(TASKS))`."""
    def parse(text: str) -> str:
        if text.strip() not in options:
            raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(options)}")
        return text.strip()

    parse.__name__ = "one of " + ", ".join(options)
    return parse
