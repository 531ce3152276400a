"""The settings a config may hold, read from the files of conf/ and their schemas (registered with Hydra's
ConfigStore on import, so that every later compose finds them).

A key is a setting when a config file sets it: the chosen option of its group, an option that option includes,
the schema it opens with (`tcal.config`), the root config, an experiment or a sweep; plus the mappings passed on
as they are (`FREE_FORM`). Anything else is a misspelling or a key added with `+` that no code reads, and the
run refuses it before any work.
"""

from __future__ import annotations

import difflib
import functools
from pathlib import Path

from omegaconf import OmegaConf

from tcal.config import register_schemas, schema_defaults

register_schemas()  # before any compose: conf/'s options open with these schemas

CONF = Path(__file__).resolve().parents[2] / "conf"
GLOBAL_GROUPS = ("experiment", "sweep")  # `# @package _global_` files: their keys are settings anywhere
NOT_SETTINGS = ("hydra", "defaults")
FREE_FORM = ("teacher.config", "data.data_files")  # mappings passed on as they are (a model config, builder files)
SCHEMA_PREFIX = "/schema/"


def leaf_items(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a.b": value} of the settings in a nested dict (lists and empty mappings are values)."""
    items = {}
    for key, value in tree.items():
        if key in NOT_SETTINGS and not prefix:
            continue
        path = f"{prefix}{key}"
        items.update(leaf_items(value, path + ".") if isinstance(value, dict) and value else {path: value})
    return items


def leaf_keys(tree: dict) -> set[str]:
    return set(leaf_items(tree))


@functools.lru_cache(maxsize=None)
def option_values(group: str, option: str) -> tuple[tuple[str, object], ...]:
    """((key, value), ...) that `group=option` sets, relative to the group's node, with those of the options it
    includes and of its schema (as written: interpolations unresolved)."""
    data = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"), resolve=False) or {}
    values = {}
    for entry in data.get("defaults") or []:
        if isinstance(entry, str) and entry.startswith(SCHEMA_PREFIX):
            values.update(leaf_items(schema_defaults(entry[len(SCHEMA_PREFIX):].split("@")[0])))
        elif isinstance(entry, str) and entry != "_self_" and not entry.startswith("override "):
            name, _, package = entry.partition("@")
            values.update({f"{package}.{k}" if package else k: v for k, v in option_values(group, name)})
    values.update(leaf_items(data))
    return tuple(values.items())


def option_keys(group: str, option: str) -> frozenset[str]:
    return frozenset(key for key, _ in option_values(group, option))


@functools.lru_cache(maxsize=None)
def config_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((group, its options), ...) for every group of conf/ whose options are settings."""
    groups = []
    for folder in sorted(p for p in CONF.rglob("*") if p.is_dir()):
        group = folder.relative_to(CONF).as_posix()
        options = tuple(sorted(p.stem for p in folder.glob("*.yaml")))
        if options and group.split("/")[0] not in ("hydra", *GLOBAL_GROUPS):
            groups.append((group, options))
    return tuple(groups)


@functools.lru_cache(maxsize=None)
def global_keys() -> frozenset[str]:
    """Keys set by conf/config.yaml and by every experiment and sweep."""
    keys = set(option_keys(".", "config"))
    for group in GLOBAL_GROUPS:
        for path in (CONF / group).glob("*.yaml"):
            keys |= option_keys(group, path.stem)
    return frozenset(keys)


def known_keys(cfg) -> set[str]:
    """Every setting this config may hold: the keys of the chosen option of each group (of every option when the
    node does not say which by its `name`), and those of the root config, experiments and sweeps."""
    keys = set(global_keys())
    for group, options in config_groups():
        node = OmegaConf.select(cfg, group.replace("/", "."), default=None)
        chosen = node.get("name") if OmegaConf.is_dict(node) else None
        prefix = group.replace("/", ".") + "."
        for option in [chosen] if chosen in options else options:
            keys |= {prefix + k for k in option_keys(group, option)}
    return keys


def is_known(key: str, known: set[str]) -> bool:
    parts = key.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return bool(ancestors & (known | set(FREE_FORM)))


@functools.lru_cache(maxsize=None)
def every_key() -> frozenset[str]:
    """The keys of every option of every group, wherever they are set (for suggestions)."""
    keys = set(global_keys())
    for group, options in config_groups():
        keys |= {group.replace("/", ".") + "." + k for option in options for k in option_keys(group, option)}
    return frozenset(keys)


def unknown_key_message(setting: str, key: str, known=None, where: str = "") -> str:
    """`<key>=<value>: no such setting (did you mean <closest>?); expected ...`, one line."""
    candidates = sorted(set(known if known is not None else every_key()) - {key})
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"{setting}: no such setting{where}{hint}; expected a setting of the config (conf/), not one added "
            f"with + or ++")


def group_options(group: str) -> list[str] | None:
    """The options of config group `group` (a folder of conf/), or None when `group` is not a group."""
    folder = CONF / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else None
