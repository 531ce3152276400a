"""The closed schemas conf/'s options open with (`- /schema/<group>/<name>@_here_`), stored in Hydra's ConfigStore.

A fixed group's settings class names its schema (`schema = "trainer/trainer"`); an option of a registry's config
group (an init mode, a retention policy, a harness, a RULER) has its schema built from its registry entry
(`/schema/init/<mode>`: the entry's settings class with the option's own defaults, `name` and, for phase1,
`phases`). Hydra refuses an override of a key the schema does not have, or a value
of the wrong type, naming the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tcal.registry import CONFIG_GROUP_REGISTRIES, plugin_packages
from tcal.settings.evaluation import EvalSettings
from tcal.settings.fields import Settings
from tcal.settings.run import GROUPS, RunSettings

ROOT_KEYS = tuple(f.name for f in dataclasses.fields(RunSettings) if f.name not in GROUPS)

RootSchema = dataclasses.make_dataclass(
    "RootSchema", [(f.name, typing.get_type_hints(RunSettings)[f.name], dataclasses.field(default=f.default))
                   for f in dataclasses.fields(RunSettings) if f.name in ROOT_KEYS]
    + [(group, Any, dataclasses.field(default=None)) for group in GROUPS])
RootSchema.__doc__ = "The root config's own keys and its groups (each group typed by its option's schema)."

# Fields a group's own options fill: left unset in the schema so that an option's keys are not mixed with another's.
FILLED_BY_OPTIONS = {EvalSettings: ("harness", "ruler")}


def fixed_schemas() -> dict[str, type]:
    """`<group>/<name>` -> the settings class that declares it (`schema = ...` in its own body)."""
    classes, found = [Settings], {}
    for cls in classes:
        classes.extend(cls.__subclasses__())
        if "schema" in vars(cls):
            found[cls.schema] = cls
    return found


def schema_class(path: str) -> type | None:
    """The settings class of schema `<group>/<name>` (`stage/distill`, `init/full`), None for one that is not."""
    group, _, name = path.rpartition("/")
    for registry in CONFIG_GROUP_REGISTRIES:
        if group == registry.group:
            return registry[name].settings if name in registry else None
    return fixed_schemas().get(path)


def schema_node(cls: type, values: dict | None = None) -> DictConfig:
    """The schema of `cls` as Hydra merges it: typed, closed to keys it does not declare; `values` its defaults."""
    node = OmegaConf.structured(cls)
    for name in FILLED_BY_OPTIONS.get(cls, ()):
        with _open(node):
            node[name] = None
    for key, value in (values or {}).items():
        node[key] = value
    return node


@contextlib.contextmanager
def _open(node):
    OmegaConf.set_struct(node, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(node, True)


def register_schemas() -> None:
    """`store_schemas` once per set of plugin packages (`TCAL_PLUGINS` set after a first composition adds its
    options' schemas at the next)."""
    store_schemas(tuple(plugin_packages()))


@functools.lru_cache(maxsize=None)
def store_schemas(plugins: tuple[str, ...]) -> None:
    """Store every schema in Hydra's ConfigStore (`/schema/<group>/<name>`, the root's `/schema/root`), and the
    `join` resolver sweep files name their job folders with (`${join:${stage.sequence}}` -> align_distill)."""
    from hydra.core.config_store import ConfigStore

    for registry in CONFIG_GROUP_REGISTRIES:  # first: a default built below checks its name (a plugin fails on its own)
        registry.load()
    OmegaConf.register_new_resolver("join", lambda items, sep="_": sep.join(map(str, items)), replace=True)
    store = ConfigStore.instance()
    for path, cls in fixed_schemas().items():
        group, _, option = f"schema/{path}".rpartition("/")
        store.store(group=group, name=option, node=schema_node(cls))
    for registry in CONFIG_GROUP_REGISTRIES:
        classes = registry.settings_classes()
        for option in registry.options():
            if option.name not in classes:  # a plugin's settings path that does not resolve: named where it is chosen
                store.store(group=f"schema/{registry.group}", name=option.name, node={"name": option.name})
                continue
            node = schema_node(classes[option.name], {"name": option.name, **option.defaults})
            store.store(group=f"schema/{registry.group}", name=option.name, node=node)
    store.store(group="schema", name="root", node=schema_node(RootSchema))
