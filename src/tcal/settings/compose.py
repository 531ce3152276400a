"""Hydra's front door: the one compose helper (the `tcal` entry, `tcal-plan`, benchmarks and tests compose here),
its errors as one line, and the jobs of a sweep.

- A composition error is one `ConfigError` line naming the argument and the key, built from the error's own
  fields (`full_key`, `options`), never from its text.
- A sweep's jobs are expanded here from Hydra's parsed overrides (`sweep_string_iterator`), as its basic sweeper
  expands them: the product of the swept values, in the order the keys were first given.
- Options of the plugin packages `TCAL_PLUGINS` names are found in their `conf/` folders (`tcal.registry`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import itertools
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf

from tcal.errors import ConfigError
from tcal.registry import PluginError, plugin_conf_dirs
from tcal.settings.conversion import run_settings
from tcal.settings.run import RunSettings
from tcal.settings.schemas import register_schemas, schema_class

CONF = Path(__file__).resolve().parents[1] / "conf"  # package data (pyproject.toml), so any install finds it


# ------------------------------------------------------------------------------------------------ compose


def check_plugins() -> None:
    """Every option registered, tcal's and those of the plugin packages `TCAL_PLUGINS` names, with its schema, and
    the plugins' conf/ folders found; a plugin that cannot be used is one ConfigError line naming it."""
    try:
        register_schemas()
        plugin_conf_dirs()
    except PluginError as err:
        raise ConfigError(str(err)) from None


@contextlib.contextmanager
def hydra_configs() -> Iterator[None]:
    """Hydra initialized on conf/ for the block (and cleared around it)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_plugins()
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
        check_group_choice(arg)
    try:
        cfg = hydra_compose(config_name="config", overrides=overrides + plugin_search_path(),
                            return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(composition_error(err, overrides)) from None
    check_true_or_false(cfg, overrides)
    return cfg


def check_group_choice(arg: str) -> None:
    """`group=option` names an option of the group: Hydra refuses another name only where the group must be chosen,
    and an `optional` group (`experiment`) would drop it without a word and run the default job."""
    override = parse(arg)
    key = _override_key(arg)
    if override.is_delete() or override.is_sweep_override() or key.startswith("hydra"):
        return  # Hydra's own groups (launchers, sweepers) are its plugins', not conf/'s
    options = group_options(key)
    value = override.value()
    if options is not None and isinstance(value, str) and value not in options:
        raise ConfigError(f"{key}={value!r}: no such option in config group {key!r}; expected one of "
                          f"{', '.join(options)}")


def plugin_search_path() -> list[str]:
    """`hydra.searchpath=[...]` of the plugin packages' conf/ folders (none when `TCAL_PLUGINS` names none)."""
    folders = plugin_conf_dirs()
    return [f"hydra.searchpath=[{','.join(repr(f'file://{folder}') for folder in folders)}]"] if folders else []


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
    folders = [conf / group for conf in (CONF, *plugin_conf_dirs()) if (conf / group).is_dir()]
    return sorted({p.stem for folder in folders for p in folder.glob("*.yaml")}) if folders else None


def option_class(group: str, option: str) -> type | None:
    """The settings class option `option` of config group `group` opens with (its `- /schema/<path>@_here_`)."""
    for conf in (CONF, *plugin_conf_dirs()):
        path = conf / group / f"{option}.yaml"
        if path.is_file():
            defaults = OmegaConf.load(path).get("defaults") or []
            for entry in defaults:
                if isinstance(entry, str) and entry.startswith("/schema/"):
                    return schema_class(entry.removeprefix("/schema/").split("@")[0])
    return None


def options_holding(settings: RunSettings, reference: RunSettings) -> list[str]:
    """`group=option` for each config group whose settings in `settings` are of another class than in `reference`
    (`stage=distill` where `reference` has `stage=none`): the option of that class, the one named like the settings
    when there is one. Composing with these choices, every key of `settings` exists."""
    groups = sorted({p.relative_to(conf).as_posix() for conf in (CONF, *plugin_conf_dirs())
                     for p in conf.rglob("*") if p.is_dir()})
    choices = []
    for group in groups:
        node, base = settings, reference
        for part in group.split("/"):
            node, base = getattr(node, part, None), getattr(base, part, None)
        if not dataclasses.is_dataclass(node) or type(node) is type(base):
            continue
        fitting = [option for option in group_options(group) if option_class(group, option) is type(node)]
        if fitting:
            name = getattr(node, "name", None)
            choices.append(f"{group}={name if name in fitting else fitting[0]}")
    return choices


# ------------------------------------------------------------------------------------------------ sweeps


def sweep_jobs(overrides: list[str], sweep_params: dict | None = None) -> list[list[str]]:
    """The override list of every job `tcal -m <overrides>` runs, in order; a sweep file's `hydra.sweeper.params`
    (`sweep_params`) apply where the command line does not set the key. A later value of a key replaces an earlier
    one in its place."""
    from hydra.errors import HydraException

    parsed = [parse(arg) for arg in overrides]
    given = {o.get_key_element().lstrip("+~") for o in parsed}
    params = [parse(f"{key}={value}") for key, value in (sweep_params or {}).items() if key not in given]
    choices: dict[str, list[str]] = {}
    for override in [*params, *parsed]:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException("an interval sweep has no list of values to run one job each")
    return [list(job) for job in itertools.product(*choices.values())]


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
