"""Hydra's side of the settings: the closed schemas conf/'s options open with, the one compose helper (the `tcal`
entry, `tcal-plan`, benchmarks and tests compose here), the sweep's jobs, and the one converter from a composed
config to `RunSettings`. Nothing below the entry points sees a DictConfig.

- Every option of a group opens with its schema (`- /schema/<group>/<name>@_here_`, registered here from the
  dataclasses): Hydra refuses an override of a key the schema does not have, or a value of the wrong type, naming
  the key. The converter refuses what Hydra lets through (a key added with `+`), and building each dataclass runs
  its checks (`tcal.settings.fields`).
- A composition error is one `ConfigError` line naming the argument and the key, built from the error's own
  fields (`full_key`, `options`), never from its text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tcal.errors import ConfigError
from tcal.settings.data import DataSettings, HubDataSettings
from tcal.settings.evaluation import (
    HARNESS_OPTIONS,
    RULER_OPTIONS,
    EvalSettings,
    HarnessSettings,
    LocalHarnessSettings,
    NeedleRulerSettings,
    PaperHarnessSettings,
    RulerSettings,
)
from tcal.settings.fields import REQUIRED, SettingError
from tcal.settings.init import (
    INIT_OPTIONS,
    CalibratedInitSettings,
    CalibrationSettings,
    FullPlusSettings,
    GateInitSettings,
    InitSettings,
)
from tcal.settings.retention import (
    RETENTION_OPTIONS,
    ExplicitRetentionSettings,
    RecallRetentionSettings,
    RetentionSettings,
    ScoredRetentionSettings,
)
from tcal.settings.run import GROUPS, RunSettings
from tcal.settings.stage import (
    AlignSettings,
    DistillSettings,
    StageSequenceSettings,
    StageSettings,
    stage_settings_class,
)
from tcal.settings.teacher import TeacherSettings
from tcal.settings.trainer import LoggerSettings, PathsSettings, TrainerSettings

CONF = Path(__file__).resolve().parents[1] / "conf"  # package data (pyproject.toml), so any install finds it
ROOT_KEYS = tuple(f.name for f in dataclasses.fields(RunSettings) if f.name not in GROUPS)

RootSchema = dataclasses.make_dataclass(
    "RootSchema", [(f.name, typing.get_type_hints(RunSettings)[f.name], dataclasses.field(default=f.default))
                   for f in dataclasses.fields(RunSettings) if f.name in ROOT_KEYS]
    + [(group, Any, dataclasses.field(default=None)) for group in GROUPS])
RootSchema.__doc__ = "The root config's own keys and its groups (each group typed by its option's schema)."

# `/schema/<group>/<name>` -> the dataclass, as conf/'s options name them in their defaults lists.
SCHEMAS = {
    "teacher/teacher": TeacherSettings,
    "data/data": DataSettings,
    "data/hub": HubDataSettings,
    "retention/ratio": RetentionSettings,
    "retention/scored": ScoredRetentionSettings,
    "retention/explicit": ExplicitRetentionSettings,
    "retention/recall": RecallRetentionSettings,
    "init/init": InitSettings,
    "init/calibrated": CalibratedInitSettings,
    "init/gate": GateInitSettings,
    "init/full_plus": FullPlusSettings,
    "calibration/calibration": CalibrationSettings,
    "stage/none": StageSettings,
    "stage/align": AlignSettings,
    "stage/distill": DistillSettings,
    "stage/sequence": StageSequenceSettings,
    "eval/eval": EvalSettings,
    "eval/harness/none": HarnessSettings,
    "eval/harness/local": LocalHarnessSettings,
    "eval/harness/paper": PaperHarnessSettings,
    "eval/ruler/none": RulerSettings,
    "eval/ruler/default": NeedleRulerSettings,
    "trainer/trainer": TrainerSettings,
    "logger/logger": LoggerSettings,
    "paths/paths": PathsSettings,
    "root": RootSchema,
}
# Fields a group's own options fill: left unset in the schema so that an option's keys are not mixed with another's.
FILLED_BY_OPTIONS = {EvalSettings: ("harness", "ruler")}


def schema_node(cls) -> DictConfig:
    """The schema of `cls` as Hydra merges it: typed, closed to keys it does not declare."""
    node = OmegaConf.structured(cls)
    for name in FILLED_BY_OPTIONS.get(cls, ()):
        with _open(node):
            node[name] = None
    return node


@contextlib.contextmanager
def _open(node):
    OmegaConf.set_struct(node, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(node, True)


@functools.lru_cache(maxsize=None)
def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (`/schema/<group>/<name>`, the root's `/schema/root`), and the
    `join` resolver sweep files name their job folders with (`${join:${stage.sequence}}` -> align_distill)."""
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("join", lambda items, sep="_": sep.join(map(str, items)), replace=True)
    store = ConfigStore.instance()
    for name, cls in SCHEMAS.items():
        group, _, option = f"schema/{name}".rpartition("/")
        store.store(group=group, name=option, node=schema_node(cls))


# ------------------------------------------------------------------------------------------------ compose


@contextlib.contextmanager
def hydra_configs() -> Iterator[None]:
    """Hydra initialized on conf/ for the block (and cleared around it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()


def compose(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """The app's config for command-line `overrides`; a composition error is one ConfigError line."""
    with hydra_configs():
        return compose_here(list(overrides), return_hydra_config=return_hydra_config)


def compose_here(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """`compose` inside `hydra_configs()`."""
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    for arg in overrides:
        parse(arg)
    try:
        cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(composition_error(err, overrides)) from None
    check_true_or_false(cfg, overrides)
    return cfg


def settings_for(*overrides: str) -> RunSettings:
    """The run settings of `tcal <overrides>`."""
    return run_settings(compose(*overrides))


def parse(arg: str):
    """One command-line override, parsed by Hydra's grammar (ConfigError naming it when it cannot be read)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (override,) = OverridesParser.create().parse_overrides([arg])
    except HydraException as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"{arg}: cannot be read ({first}); expected key=value in Hydra's override syntax, e.g. "
                          f"retention.keep=[0,2]") from None
    return override


def composition_error(err: Exception, overrides: list[str]) -> str:
    """Hydra's or OmegaConf's error as one line naming the argument, from the error's fields."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        return (f"{group}={option!r}: no such option in config group {group!r}; expected one of "
                f"{', '.join(sorted(err.options))}")
    cause = next((e for e in _chain(err) if isinstance(e, OmegaConfBaseException) and e.full_key), None)
    if cause is not None:
        key = str(cause.full_key)
        base = key.split("[")[0]
        arg = next((a for a in overrides if _override_key(a) == base or _override_key(a).startswith(base + ".")), key)
        return f"{arg}: {str(cause.msg).splitlines()[0]}{did_you_mean(key, cause.object_type)} (key {key})"
    return f"{' '.join(overrides)}: {' '.join(str(err).split())}"


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and the errors it was raised from."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _override_key(arg: str) -> str:
    return arg.lstrip("+~").split("=", 1)[0]


def did_you_mean(key: str, owner) -> str:
    """` (did you mean <a.b>?)` for a key that is close to a field of its dataclass `owner`."""
    if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):
        return ""
    parent, _, leaf = key.rpartition(".")
    if leaf in [f.name for f in dataclasses.fields(owner)]:
        return ""
    close = difflib.get_close_matches(leaf, [f.name for f in dataclasses.fields(owner)], n=1)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def check_true_or_false(cfg, overrides: list[str]) -> None:
    """A true/false setting is given as true or false: OmegaConf would also take yes, on or 1 as true."""
    for arg in overrides:
        override = parse(arg)
        if override.is_delete() or override.is_sweep_override():
            continue
        value = OmegaConf.select(cfg, override.key_or_group, default=None, throw_on_resolution_failure=False)
        if isinstance(value, bool) and not isinstance(override.value(), bool):
            raise ConfigError(f"{arg}; expected true or false")


def group_options(group: str) -> list[str] | None:
    """The options of config group `group` (a folder of conf/), or None when `group` is not a group."""
    folder = CONF / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else None


# ------------------------------------------------------------------------------------------------ sweeps


def sweep_jobs(overrides: list[str], sweep_params: dict | None = None) -> list[list[str]]:
    """The override list of every job `tcal -m <overrides>` runs, in order, expanded by Hydra's basic sweeper; a
    sweep file's `hydra.sweeper.params` (`sweep_params`) apply where the command line does not set the key."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = [parse(arg) for arg in overrides]
    given = {o.get_key_element().lstrip("+~") for o in parsed}
    params = [f"{key}={value}" for key, value in (sweep_params or {}).items() if key not in given]
    return [list(job) for job in BasicSweeper.split_arguments(
        [*OverridesParser.create().parse_overrides(params), *parsed], None)[0]]


def sweep_params(overrides: list[str]) -> dict:
    """`hydra.sweeper.params` of the config the group choices of `overrides` compose (a `+sweep=` file's jobs;
    empty for none, or when they do not compose: composing the jobs names the fault)."""
    groups = [arg for arg in overrides if group_options(_override_key(arg)) is not None]
    try:
        cfg = compose_here(groups, return_hydra_config=True)
    except ConfigError:
        return {}
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    return dict(OmegaConf.to_container(params)) if params else {}


def planned_jobs(overrides: list[str]) -> list[list[str]]:
    """Every job of `tcal -m <overrides>` (inside `hydra_configs()`), with a sweep file's params; a glob over a config
    group's options (`init=glob(*,exclude=naive)`) is expanded to those options, as Hydra's sweeper will."""
    from hydra.errors import HydraException

    fixed = [arg for arg in overrides if not parse(arg).is_sweep_override()]
    try:
        return sweep_jobs([expanded_glob(arg) for arg in overrides], sweep_params(fixed))
    except HydraException as err:
        swept = " ".join(arg for arg in overrides if parse(arg).is_sweep_override())
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"{swept}: {first}; expected sweeps of lists of values (a,b,c), range(...) or a config "
                          f"group's glob(...)") from None


def expanded_glob(arg: str) -> str:
    """`group=glob(...)` as the choice sweep of the group's options it matches (Hydra's glob, filtered here); any
    other argument as it is. A glob that matches no option, or one of a key that is not a group, is one line."""
    from hydra.core.override_parser.types import Glob

    override = parse(arg)
    if not override.is_sweep_override() or not isinstance(override.value(), Glob):
        return arg
    key = override.get_key_element()
    options = group_options(_override_key(arg))
    if options is None:
        raise ConfigError(f"{arg}: glob(...) sweeps the options of a config group, and {key} is not one; expected "
                          f"{key}=a,b,c for values of a key")
    matched = override.value().filter(options)
    if not matched:
        raise ConfigError(f"{arg}: matches none of {key}'s options ({', '.join(options)})")
    return f"{arg.split('=', 1)[0]}={','.join(matched)}"


def one_job_per_group_choice(jobs: list[list[str]]) -> list[list[str]]:
    """The first job of each combination of config-group choices: a group decides which keys exist, so these
    compose if and only if every job's keys do."""
    chosen: dict[tuple, list[str]] = {}
    for job in jobs:
        groups = tuple(arg for arg in job if group_options(_override_key(arg)) is not None)
        chosen.setdefault(groups, job)
    return list(chosen.values())


# ------------------------------------------------------------------------------------------------ converter


def run_settings(cfg) -> RunSettings:
    """The typed settings of a composed config, of a results.json's `config`, or of a rank's spec (a mapping):
    the one converter. Raises SettingError (a ConfigError) naming the key of a bad or unknown setting."""
    declared = {}
    if OmegaConf.is_config(cfg):
        declared = {group: OmegaConf.get_type(cfg[group]) for group in GROUPS if group in cfg}
        try:
            tree = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except InterpolationResolutionError as err:
            first = str(err).strip().splitlines()[0]
            raise ConfigError(f"{err.full_key}: {first}; expected an interpolation that resolves (a key of the config "
                              f"such as ${{init.name}}, or ${{oc.env:NAME,default}})") from None
    else:
        tree = dict(cfg)
    tree.pop("hydra", None)
    _unknown_keys(tree, list(GROUPS) + list(ROOT_KEYS), "")
    groups = {group: _group(group, tree.get(group) or {}, declared.get(group)) for group in GROUPS if group in tree}
    root = {key: _value(tree[key]) for key in ROOT_KEYS if key in tree}
    try:
        return RunSettings(**groups, **root)
    except SettingError as err:
        raise (err if err.place is not None else err.placed("")) from None


OPTIONS = {"retention": RETENTION_OPTIONS, "init": INIT_OPTIONS}
FIXED = {"teacher": TeacherSettings, "calibration": CalibrationSettings, "eval": EvalSettings,
         "trainer": TrainerSettings, "logger": LoggerSettings, "paths": PathsSettings}


def group_class(group: str, node: dict, declared: type | None = None) -> type:
    """The dataclass of a group's mapping: by the option's name (`init.name`), source (`data`) or shape (`stage`);
    a name no option has keeps the class its schema declared (whose check then names the bad name)."""
    if group in FIXED:
        return FIXED[group]
    if group == "data":
        return HubDataSettings if node.get("source") == "datasets" else DataSettings
    if group == "stage":
        return stage_settings_class(node)
    fallback = declared if _is_dataclass(declared) else {"retention": RetentionSettings, "init": InitSettings}[group]
    return OPTIONS[group].get(node.get("name"), fallback)


def _is_dataclass(cls) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def _group(group: str, node: dict, declared: type | None) -> Any:
    cls = group_class(group, node, declared)
    if group in OPTIONS and _is_dataclass(declared) and declared is not cls:
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
        if cls is EvalSettings and field.name in ("harness", "ruler") and isinstance(value, dict):
            options = HARNESS_OPTIONS if field.name == "harness" else RULER_OPTIONS
            value = _build(options.get(value.get("name"), HarnessSettings if field.name == "harness" else
                                       RulerSettings), value, f"{place}{field.name}.")
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
