"""Every pluggable kind of tcal is a `Registry` of `Option`s here: init modes, retention policies, the lm-eval
harnesses and RULER (`eval/harness`, `eval/ruler`), training stage kinds, export formats, the vLLM families the
serving plugin builds and the teacher families the conversion reads. Every name -> class or name -> function table
is read from here; nothing else names an option.

An option is one module (plus one YAML where it is a config group's option), and one line naming them: tcal's own
are the `declare` lines at the end of this file, each a dotted path "module:attribute" imported on first use (a
settings class, from the light `tcal.settings`, when a name is checked; the implementation only when it runs:
settings build and compose without option code or torch). A config group's YAML (`conf/init/rescale.yaml`) opens
with the schema the registry builds from the settings class (`- /schema/init/rescale@_here_`). A plugin is a package
named in `TCAL_PLUGINS` (comma-separated, importable): the registries import its modules when first asked, each
registering its option with one decorator (`@INIT_MODES.option("rescale", RescaleSettings)` above the function) or
one `declare` line (`EXPORT_FORMATS.declare("onnx", OnnxFormat())`), and the `conf/` folder beside them holds their
YAMLs, searched after tcal's own (`plugin_conf_dirs`).

A plugin that cannot be used (not importable, a plain module rather than a package, a module that raises, a name
that is taken) is a `PluginError`: one line naming the plugin and what to do; the registries are left as they were
before it, and every later ask names it again. An option a plugin declares at a dotted path that does not resolve
is a `PluginError` naming the plugin and the path when that option is used (its settings when a run composes with
it, its implementation in the run's checks before the teacher loads: `check_resolves`); runs that do not use it are
not touched by it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from pathlib import Path
from typing import Any, Callable

from tcal.errors import ConfigError

PLUGINS_ENV = "TCAL_PLUGINS"


class PluginError(ConfigError):
    """A plugin package `TCAL_PLUGINS` names cannot be used; the message names it and what to do, on one line."""


_declaring: list[str] = []  # the plugin package whose modules `Registry.load` is importing now (its declarations')


def resolve(target: Any) -> Any:
    """`target` itself, or the object its dotted path "module:attribute" names (the module imported now, once)."""
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice of a kind: `implementation` is what it does (a function, a class, an object), `settings` its closed
    settings class where the choice is a config group's (None for kinds chosen outside the config: an export format, a
    teacher family), each given as the object or as its dotted path, imported on first use; `defaults` the field
    values that tell it apart from the other options of the same class (`phases` of phase1)."""

    name: str
    settings_at: type | str | None
    implementation_at: Any
    defaults: dict
    kind: str = "option"
    plugin: str | None = None  # the TCAL_PLUGINS package that declared it (None: tcal's own)

    @property
    def settings(self) -> type:
        return self._resolve("settings", self.settings_at)

    @property
    def implementation(self) -> Any:
        return self._resolve("implementation", self.implementation_at)

    def check_resolves(self) -> None:
        """A plugin's option: its settings and implementation paths resolve (importing them), else the one-line
        PluginError naming the plugin and the path, before a run that uses it does any work."""
        if self.plugin is not None:
            self.settings, self.implementation  # noqa: B018 - resolved for their errors

    def _resolve(self, what: str, target: Any) -> Any:
        if self.plugin is None:
            return resolve(target)
        try:
            return resolve(target)
        except Exception as err:  # noqa: BLE001 - whatever the path raises, the plugin and the path are named
            cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            raise PluginError(f"{PLUGINS_ENV}={os.environ.get(PLUGINS_ENV)!r}: plugin {self.plugin!r} declares "
                              f"{self.kind} {self.name!r} with {what} {target!r}, which does not resolve ({cause}); "
                              f"expected an importable 'module:attribute', fix the plugin, or remove it from "
                              f"{PLUGINS_ENV}") from None

    def make_settings(self, **changes: Any):
        """The option's default settings (as its YAML gives them when it changes nothing), with `changes`."""
        return self.settings(**{"name": self.name, **self.defaults, **changes})


class Registry:
    """The options of one kind, by name. `kind` names it in messages ("init mode"); `group` is the config group whose
    schemas it builds (`/schema/<group>/<name>`), None for a kind the config does not choose by `name`."""

    def __init__(self, kind: str, group: str | None = None):
        self.kind, self.group = kind, group
        self._options: dict[str, Option] = {}
        self._loaded: tuple[str, ...] | None = None  # the plugin packages loaded with it (TCAL_PLUGINS may change)

    def declare(self, name: str, implementation: Any, settings: type | str | None = None, **defaults: Any):
        """Option `name`: `implementation` with settings of class `settings`, each an object or a dotted path."""
        if name in self._options:
            at = self._options[name].implementation_at
            owner = at.partition(":")[0] if isinstance(at, str) else getattr(at, "__module__", None) or "another module"
            raise ValueError(f"{self.kind} {name!r} is already registered (by {owner}); expected a name of its own")
        self._options[name] = Option(name, settings, implementation, dict(defaults), self.kind,
                                     _declaring[-1] if _declaring else None)
        return implementation

    def option(self, name: str, settings: type | None = None, **defaults: Any) -> Callable[[Any], Any]:
        """Decorator: register the function (or class) below as option `name`, its settings of class `settings`."""
        return lambda implementation: self.declare(name, implementation, settings, **defaults)

    def load(self) -> None:
        """Import the plugin modules that register options (once all did, and again when `TCAL_PLUGINS` names other
        packages: a failed import fails every later ask too, and a plugin that fails leaves every registry as it
        was before it)."""
        plugins = tuple(plugin_packages())
        if self._loaded == plugins:
            return
        for plugin in plugins:
            before = [(registry, dict(registry._options)) for registry in (*ALL_REGISTRIES, self)]
            _declaring.append(plugin)
            try:
                for module in pkgutil.iter_modules(plugin_package(plugin).__path__):
                    import_plugin_module(plugin, f"{plugin}.{module.name}")
            except PluginError:
                for registry, options in before:
                    registry._options = options
                raise
            finally:
                _declaring.pop()
        self._loaded = plugins

    def names(self) -> list[str]:
        self.load()
        return sorted(self._options)

    def options(self) -> list[Option]:
        return [self[name] for name in self.names()]

    def settings_classes(self) -> dict[str, type]:
        """Each option's settings class, by name, leaving out a plugin's option whose settings path does not resolve
        (a run that chooses it is refused by name when it composes)."""
        classes = {}
        for option in self.options():
            try:
                classes[option.name] = option.settings
            except PluginError:
                continue
        return classes

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


def plugin_package(name: str):
    """The plugin package `name`, imported; PluginError naming it when it is not an importable package."""
    package = import_plugin_module(name, name)
    if not hasattr(package, "__path__"):
        raise PluginError(f"{PLUGINS_ENV}={os.environ.get(PLUGINS_ENV)!r}: {name!r} is a module "
                          f"({getattr(package, '__file__', None)}), not a package; expected a folder of option "
                          f"modules (with their YAMLs in its conf/)")
    return package


def import_plugin_module(plugin: str, module: str):
    """`module` of plugin package `plugin`, imported; PluginError naming both on any failure."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or not (plugin == err.name or plugin.startswith(f"{err.name}.")):
            raise plugin_error(plugin, module, err) from None
        raise PluginError(f"{PLUGINS_ENV}={os.environ.get(PLUGINS_ENV)!r}: cannot import {plugin!r} (no module named "
                          f"{err.name!r}); expected packages that import here (on PYTHONPATH), comma-separated, or "
                          f"remove it from {PLUGINS_ENV}") from None
    except Exception as err:  # noqa: BLE001 - whatever a plugin raises, it is named, on one line
        raise plugin_error(plugin, module, err) from None


def plugin_error(plugin: str, module: str, err: Exception) -> PluginError:
    cause = " ".join(str(err).split())[:300]
    return PluginError(f"{PLUGINS_ENV}={os.environ.get(PLUGINS_ENV)!r}: plugin {plugin!r} fails: importing {module} "
                       f"raised {type(err).__name__}: {cause}; fix the plugin, or remove it from {PLUGINS_ENV}")


def plugin_conf_dirs() -> list[Path]:
    """The `conf/` folder beside each plugin package's modules (its options' YAMLs), where there is one."""
    folders = []
    for name in plugin_packages():
        for path in plugin_package(name).__path__:
            if (Path(path) / "conf").is_dir():
                folders.append(Path(path) / "conf")
    return folders


INIT_MODES = Registry("init mode", "init")
INIT_MODES.declare("naive", "tcal.init.naive:naive", "tcal.settings.init:InitSettings")
INIT_MODES.declare("zero_gate", "tcal.init.gates:zero_gate", "tcal.settings.init:InitSettings")
INIT_MODES.declare("small_gate", "tcal.init.gates:small_gate", "tcal.settings.init:GateInitSettings")
INIT_MODES.declare("phase1", "tcal.init.taylor:calibrated", "tcal.settings.init:CalibratedInitSettings",
                   phases=["phase1"])
INIT_MODES.declare("phase2", "tcal.init.taylor:calibrated", "tcal.settings.init:CalibratedInitSettings",
                   phases=["phase2"])
INIT_MODES.declare("full", "tcal.init.taylor:calibrated", "tcal.settings.init:CalibratedInitSettings")
INIT_MODES.declare("full_plus", "tcal.init.full_plus:full_plus", "tcal.settings.init:FullPlusSettings")

POLICIES = Registry("retention policy", "retention")
POLICIES.declare("uniform", "tcal.retention.uniform:uniform", "tcal.settings.retention:RetentionSettings")
POLICIES.declare("explicit", "tcal.retention.explicit:explicit", "tcal.settings.retention:ExplicitRetentionSettings")
POLICIES.declare("ar", "tcal.retention.ar:ar", "tcal.settings.retention:ScoredRetentionSettings")
POLICIES.declare("ga_s2", "tcal.retention.ga_s2:ga_s2", "tcal.settings.retention:GaS2RetentionSettings")
POLICIES.declare("recall", "tcal.retention.recall:recall", "tcal.settings.retention:RecallRetentionSettings")

# `eval/harness` and `eval/ruler`: the implementation takes (ctx, student) and returns the results.json entry (None:
# the option measures nothing)
HARNESSES = Registry("lm-eval harness", "eval/harness")
HARNESSES.declare("none", None, "tcal.settings.evaluation:HarnessSettings")
HARNESSES.declare("local", "tcal.evaluate.suite:local_harness", "tcal.settings.evaluation:LocalHarnessSettings")
HARNESSES.declare("paper", "tcal.evaluate.suite:paper_harness", "tcal.settings.evaluation:PaperHarnessSettings")

RULERS = Registry("RULER", "eval/ruler")
RULERS.declare("none", None, "tcal.settings.evaluation:RulerSettings")
RULERS.declare("default", "tcal.evaluate.suite:needle_ruler", "tcal.settings.evaluation:NeedleRulerSettings")

# `stage.kind`: the stage's LightningModule and settings class (a sequence of stages names them in `stage.sequence`)
STAGE_KINDS = Registry("stage kind")
STAGE_KINDS.declare("align", "tcal.training.stages:AlignStage", "tcal.settings.stage:AlignSettings")
STAGE_KINDS.declare("distill", "tcal.training.stages:DistillStage", "tcal.settings.stage:DistillSettings")

# `tcal-export --format`: an `ExportFormat` (tcal.export.formats) that checks, writes and reloads the student
EXPORT_FORMATS = Registry("export format")
EXPORT_FORMATS.declare("tcal", "tcal.export.formats:TCAL")
EXPORT_FORMATS.declare("hf", "tcal.export.formats:HF")
EXPORT_FORMATS.declare("qwen3_5", "tcal.export.qwen3_5:QWEN3_5")
EXPORT_FORMATS.declare("vllm", "tcal.export.formats:VLLM")
EXPORT_FORMATS.declare("gguf", "tcal.export.gguf_export:GGUF")

# A student's teacher `model_type` -> the function building its kept layers in vLLM (tcal.serving.vllm_model)
VLLM_FAMILIES = Registry("vLLM family")
VLLM_FAMILIES.declare("llama", "tcal.serving.vllm_model:llama_layer")
VLLM_FAMILIES.declare("qwen2", "tcal.serving.vllm_model:qwen2_layer")
VLLM_FAMILIES.declare("qwen3", "tcal.serving.vllm_model:qwen3_layer")

# A teacher config's `model_type` -> its `TeacherAdapter` (tcal.teachers.base): where its layers and attention are
TEACHER_FAMILIES = Registry("teacher family")
TEACHER_FAMILIES.declare("llama", "tcal.teachers.llama:LLAMA")
TEACHER_FAMILIES.declare("qwen2", "tcal.teachers.qwen2:QWEN2")
TEACHER_FAMILIES.declare("qwen3", "tcal.teachers.qwen3:QWEN3")

CONFIG_GROUP_REGISTRIES = (INIT_MODES, POLICIES, HARNESSES, RULERS)  # each builds its group's schemas
ALL_REGISTRIES = (*CONFIG_GROUP_REGISTRIES, STAGE_KINDS, EXPORT_FORMATS, VLLM_FAMILIES, TEACHER_FAMILIES)
