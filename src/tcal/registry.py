"""The options of the pluggable groups (init modes, retention policies): each an `Option` that owns its
settings class and its implementation. Every name -> class or name -> function table is read from here.

An option is one module plus one YAML: the module registers it (`@INIT_MODES.option("rescale", RescaleSettings)`
above the function), the YAML (`conf/init/rescale.yaml`) opens with the schema the registry builds from the
settings class (`- /schema/init/rescale@_here_`). A registry imports every module of its package when first asked,
and those of the packages named in `TCAL_PLUGINS` (comma-separated, importable): a plugin package holds its option
modules and, beside them, a `conf/` folder of their YAMLs, which composition searches after tcal's own
(`plugin_conf_dirs`). Nothing else names an option.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from pathlib import Path
from typing import Any, Callable

PLUGINS_ENV = "TCAL_PLUGINS"


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice of a config group: `settings` is its closed settings class, `implementation` what it does,
    `defaults` the field values that tell it apart from the other options of the same class (`phases` of phase1)."""

    name: str
    settings: type
    implementation: Callable | None
    defaults: dict

    def make_settings(self, **changes: Any):
        """The option's default settings (as its YAML gives them when it changes nothing), with `changes`."""
        return self.settings(**{"name": self.name, **self.defaults, **changes})


class Registry:
    def __init__(self, kind: str, group: str, packages: tuple[str, ...]):
        self.kind, self.group, self.packages = kind, group, packages
        self._options: dict[str, Option] = {}
        self._loaded = False

    def option(self, name: str, settings: type, **defaults: Any) -> Callable[[Callable | None], Callable | None]:
        """Decorator: register the function below as option `name`, its settings of class `settings`."""
        def add(implementation: Callable | None) -> Callable | None:
            if name in self._options:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._options[name] = Option(name, settings, implementation, dict(defaults))
            return implementation

        return add

    def load(self) -> None:
        """Import the modules that register options (once all did: a failed import fails every later ask too)."""
        if self._loaded:
            return
        for package_name in (*self.packages, *plugin_packages()):
            try:
                package = importlib.import_module(package_name)
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(f"{PLUGINS_ENV}: cannot import {package_name!r} ({err}); expected "
                                          f"importable packages, comma-separated") from None
            for module in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{package_name}.{module.name}")
        self._loaded = True

    def names(self) -> list[str]:
        self.load()
        return sorted(self._options)

    def options(self) -> list[Option]:
        return [self[name] for name in self.names()]

    def __getitem__(self, name: str) -> Option:
        self.load()
        if name not in self._options:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return self._options[name]

    def __contains__(self, name: str) -> bool:
        self.load()
        return name in self._options


def plugin_packages() -> list[str]:
    """The packages `TCAL_PLUGINS` names, whose modules register more options."""
    return [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]


def plugin_conf_dirs() -> list[Path]:
    """The `conf/` folder beside each plugin package's modules (its options' YAMLs), where there is one."""
    folders = []
    for name in plugin_packages():
        for path in importlib.import_module(name).__path__:
            if (Path(path) / "conf").is_dir():
                folders.append(Path(path) / "conf")
    return folders


INIT_MODES = Registry("init mode", "init", ("tcal.init",))
POLICIES = Registry("retention policy", "retention", ("tcal.retention",))
REGISTRIES = (INIT_MODES, POLICIES)
