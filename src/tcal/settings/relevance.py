"""What the declarations of `tcal.settings.fields` decide: the fields a cache key holds, which settings may change
when a run continues, and which differences between two runs' settings tell their results apart."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from tcal.settings.fields import HARNESS, INIT, PPL, RULER, SCORES, TRAIN, affects, relevance

# The products each on-disk cache holds: its key holds every setting that changes them (`cache_settings`), besides
# the digests of what it reads (teacher weights, tokens, starting weights).
KEYED_BY = {
    "calibration": (INIT,),  # a calibrated GDN layer
    "retention": (SCORES,),  # a policy's layer scores (ga_s2 and recall's gdn probe add INIT: they initialize)
    "stage1": (TRAIN, PPL),  # a finished Stage 1: the GDN weights and the stage's record with its curve
    "ppl": (PPL,), "ppl_by_position": (PPL,), "harness": (HARNESS,), "ruler": (RULER,),  # the teacher's figures
}


def leaves(node, prefix: str = "") -> dict[str, tuple[Any, frozenset[str]]]:
    """{dotted key: (value, products it changes)} of every field of a settings object, nested settings walked
    (a field holding settings is described by the fields inside it)."""
    found = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            found.update(leaves(value, f"{prefix}{field.name}."))
        else:
            found[f"{prefix}{field.name}"] = (_plain(value), affects(field))
    return found


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def settings_key(node, products: Iterable[str]) -> dict[str, Any]:
    """{key: value} of the fields of `node` (a settings object) that change any of `products`: what a cache entry
    of those products is keyed by. A field added to a settings class enters every key whose products it names."""
    wanted = set(products)
    return {key: value for key, (value, changes) in leaves(node).items() if changes & wanted}


def cache_settings(kind: str, settings, also: Iterable[str] = ()) -> dict[str, Any]:
    """The settings part of a `kind` cache entry's key (`KEYED_BY`; `also`: products a policy's entry depends on
    besides its own)."""
    return settings_key(settings, (*KEYED_BY[kind], *also))


def levels(node) -> dict[str, str]:
    """{dotted key: "result" | "eval" | "none"} of every field of `node`."""
    return {key: relevance(changes) for key, (_, changes) in leaves(node).items()}


def differences(old, new, counted: Iterable[str] = ("result", "eval")) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of each field whose level is in `counted` and whose values differ between two
    settings objects (a field one of them lacks, e.g. of another init mode, has the value None there)."""
    counted = set(counted)
    before, after = leaves(old), leaves(new)
    kinds = {key: relevance(changes) for key, (_, changes) in {**before, **after}.items()}
    return [(key, before.get(key, (None,))[0], after.get(key, (None,))[0]) for key in sorted(kinds)
            if kinds[key] in counted and before.get(key, (None,))[0] != after.get(key, (None,))[0]]


def with_values(settings, source, keys: Iterable[str]):
    """`settings` with the values `source` holds for the dotted `keys` (those either object lacks are skipped),
    every other field as it is: what a resumed run takes of the command that continues it."""
    keys = set(keys)
    if not dataclasses.is_dataclass(settings) or type(settings) is not type(source):
        return settings
    changes = {}
    for field in dataclasses.fields(settings):
        mine, theirs = getattr(settings, field.name), getattr(source, field.name)
        inside = {key[len(field.name) + 1:] for key in keys if key.startswith(f"{field.name}.")}
        if dataclasses.is_dataclass(mine) and inside:
            changes[field.name] = with_values(mine, theirs, inside)
        elif field.name in keys and not dataclasses.is_dataclass(mine):
            changes[field.name] = theirs
    return dataclasses.replace(settings, **changes) if changes else settings
