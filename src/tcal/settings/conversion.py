"""The one converter from a composed config (or a results.json's `config`, or a rank's spec) to `RunSettings`.

Nothing below the entry points sees a DictConfig. The class of a group's mapping comes from the config's declared
schema, the registry (an init mode's or a policy's name), `RunSettings`' own field types, or the mapping's shape
(`data.source`, `stage`); the converter refuses what Hydra lets through (a key added with `+`), and building each
dataclass runs its checks (`tcal.settings.fields`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tcal.errors import ConfigError
from tcal.registry import HARNESSES, INIT_MODES, POLICIES, RULERS
from tcal.settings.data import DataSettings, HubDataSettings
from tcal.settings.evaluation import EvalSettings, HarnessSettings, RulerSettings
from tcal.settings.fields import REQUIRED, SettingError
from tcal.settings.init import InitSettings
from tcal.settings.retention import RetentionSettings
from tcal.settings.run import GROUPS, RunSettings
from tcal.settings.schemas import ROOT_KEYS
from tcal.settings.stage import stage_settings_class


def run_settings(config) -> RunSettings:
    """The typed settings of a composed config, of a results.json's `config`, or of a rank's spec (a mapping):
    the one converter. Raises SettingError (a ConfigError) naming the key of a bad or unknown setting."""
    declared = {}
    if OmegaConf.is_config(config):
        declared = {group: OmegaConf.get_type(config[group]) for group in GROUPS if group in config}
        try:
            tree = OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
        except InterpolationResolutionError as err:
            first = str(err).strip().splitlines()[0]
            raise ConfigError(f"{err.full_key}: {first}; expected an interpolation that resolves (a key of the config "
                              f"such as ${{init.name}}, or ${{oc.env:NAME,default}})") from None
    else:
        tree = dict(config)
    tree.pop("hydra", None)
    _unknown_keys(tree, list(GROUPS) + list(ROOT_KEYS), "")
    groups = {group: _group(group, tree.get(group) or {}, declared.get(group)) for group in GROUPS if group in tree}
    root = {key: _value(tree[key]) for key in ROOT_KEYS if key in tree}
    try:
        return RunSettings(**groups, **root)
    except SettingError as err:
        raise (err if err.place is not None else err.placed("")) from None


# The config groups whose class is the option's that `<group>.name` names: its registry, and the base class a name
# no option has keeps (whose check then names the bad name).
GROUPS_CHOSEN_BY_NAME = {"retention": (POLICIES, RetentionSettings), "init": (INIT_MODES, InitSettings)}
# The same for each field whose settings an option of its own config group fills (`eval/harness`).
FIELDS_CHOSEN_BY_NAME = {(EvalSettings, "harness"): (HARNESSES, HarnessSettings),
                         (EvalSettings, "ruler"): (RULERS, RulerSettings)}


def group_class(group: str, node: dict, declared: type | None = None) -> type:
    """The dataclass of a group's mapping: by the option's name (`init.name`), source (`data`) or shape (`stage`);
    a name no option has keeps the class its schema declared (whose check then names the bad name)."""
    if group == "data":
        return HubDataSettings if node.get("source") == "datasets" else DataSettings
    if group == "stage":
        return stage_settings_class(node)
    if group not in GROUPS_CHOSEN_BY_NAME:
        return typing.get_type_hints(RunSettings)[group]
    registry, base = GROUPS_CHOSEN_BY_NAME[group]
    fallback = declared if _is_dataclass(declared) else base
    return registry[node["name"]].settings if node.get("name") in registry else fallback


def _is_dataclass(cls) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def _group(group: str, node: dict, declared: type | None) -> Any:
    cls = group_class(group, node, declared)
    if group in GROUPS_CHOSEN_BY_NAME and _is_dataclass(declared) and declared is not cls:
        name = node.get("name")
        raise ConfigError(f"{group}.name={name!r}: the option chosen holds the settings of another {group} "
                          f"({declared.__name__}); expected {group}={name} to choose that option")
    return _build(cls, node, f"{group}.")


def _build(cls: type, node: dict, place: str):
    """`cls(**node)` with nested settings built the same way; errors placed under `place`."""
    _unknown_keys(node, [f.name for f in dataclasses.fields(cls)], place)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in node:
            continue
        value, kind = node[field.name], hints[field.name]
        chosen = FIELDS_CHOSEN_BY_NAME.get((cls, field.name))
        if chosen is not None and isinstance(value, dict):
            registry, base = chosen
            option = value.get("name")
            value = _build(registry[option].settings if option in registry else base, value, f"{place}{field.name}.")
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(value, dict):
            value = _build(kind, value, f"{place}{field.name}.")
        else:
            value = _value(value)
        kwargs[field.name] = value
    try:
        return cls(**kwargs)
    except SettingError as err:
        raise err.placed(place) from None


def _value(value):
    return None if value == REQUIRED else value


def _unknown_keys(node: dict, known: list[str], place: str) -> None:
    for key in node:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {place}{close[0]}?)" if close else ""
            raise ConfigError(f"{place}{key}={node[key]!r}: no such setting{hint}; expected a setting of the "
                              f"config (conf/), not one added with + or ++")
