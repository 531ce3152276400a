"""The typed settings boundary: every field declares what it changes, and cache keys, resume safety and report
variants follow from that one declaration; the schemas are closed; only the converter and the entry points read a
DictConfig."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from conftest import compose

import tcal.settings as settings_package
from tcal.settings.fields import PRODUCTS, Settings, relevance, setting
from tcal.settings.init import InitSettings
from tcal.settings.relevance import KEYED_BY, cache_settings, differences, leaves, levels, with_values
from tcal.store.fingerprint import digest

SRC = Path(__file__).resolve().parents[1] / "src" / "tcal"

# Compositions that between them hold every option class of every group.
COMPOSITIONS = [
    (),
    ("init=full_plus", "stage=align_distill", "retention=recall", "eval/ruler=default", "logger=wandb",
     "data=wikitext", "eval/harness=paper"),
    ("init=small_gate", "stage=distill", "retention=ar", "eval/harness=none", "teacher=qwen3_8b"),
    ("init=phase2", "stage=align", "retention=explicit", "retention.keep=[0,1]", "teacher=tiny_llama"),
]


def settings_classes() -> list[type]:
    modules = [m for name, m in inspect.getmembers(settings_package, inspect.ismodule)]
    found = {cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
             if dataclasses.is_dataclass(cls) and issubclass(cls, Settings)}
    return sorted(found, key=lambda cls: cls.__name__)


def test_every_settings_field_declares_what_it_changes():
    classes = settings_classes()
    assert len(classes) >= 25
    for cls in classes:
        for field in dataclasses.fields(cls):
            assert set(field.metadata["affects"]) <= set(PRODUCTS), (cls.__name__, field.name)


def test_a_field_added_without_the_declaration_is_refused():
    from tcal.settings.fields import declared

    with pytest.raises(TypeError, match=r"Knobs.new_knob: a settings field must declare what it affects"):
        @declared
        @dataclasses.dataclass
        class Knobs(Settings):
            declared_knob: int = setting(1, affects=["init"])
            new_knob: int = 2


def other_value(value):
    """A value of the same kind that differs from `value` (settings are only read here, never checked)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, 1]
    if isinstance(value, dict):
        return {**value, "extra_key": 1}
    return "x"


def perturbed(settings, key: str):
    """A deep copy of `settings` with the field at dotted `key` given another value (no checks run)."""
    changed = _copy(settings)
    *path, leaf = key.split(".")
    node = changed
    for part in path:
        node = getattr(node, part)
    object.__setattr__(node, leaf, other_value(getattr(node, leaf)))
    return changed


def _copy(node):
    if not dataclasses.is_dataclass(node):
        return node
    copy = object.__new__(type(node))
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        object.__setattr__(copy, field.name, _copy(value) if dataclasses.is_dataclass(value)
                           else (list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict)
                                 else value))
    return copy


@pytest.mark.parametrize("overrides", COMPOSITIONS, ids=lambda o: " ".join(o) or "defaults")
@pytest.mark.parametrize("kind", sorted(KEYED_BY))
def test_a_cache_key_changes_with_exactly_the_settings_that_change_its_product(kind, overrides):
    settings = compose(*overrides)
    base = digest(cache_settings(kind, settings))
    for key, (_, changes) in leaves(settings).items():
        moved = digest(cache_settings(kind, perturbed(settings, key))) != base
        assert moved == bool(changes & set(KEYED_BY[kind])), (kind, key, sorted(changes))


def test_resume_safety_and_report_variants_follow_the_declarations():
    settings = compose("init=full_plus", "stage=distill")
    kinds = levels(settings)
    assert kinds["paths.cache_dir"] == kinds["logger.name"] == kinds["init.pool.layers_per_pass"] == "none"
    assert kinds["stage.lr_mixer"] == kinds["retention.ratio"] == kinds["init.pool.tokens"] == "result"
    assert kinds["eval.seq_len"] == kinds["data.eval_files"] == kinds["eval.harness.limit"] == "eval"
    safe = perturbed(settings, "paths.cache_dir")
    assert differences(settings, safe) == []
    unchanging = {key for key, level in levels(settings).items() if level == "none"}
    assert with_values(settings, safe, unchanging).paths.cache_dir == safe.paths.cache_dir
    unsafe = perturbed(settings, "stage.lr_mixer")
    assert [key for key, _, _ in differences(settings, unsafe)] == ["stage.lr_mixer"]
    assert with_values(settings, unsafe, unchanging).stage.lr_mixer == settings.stage.lr_mixer  # a result field is kept

    from tcal.tools.figures import reported_keys

    recorded = reported_keys(settings.tree())
    assert "stage.lr_mixer" in recorded and "eval.seq_len" in recorded and "paths.cache_dir" not in recorded


def test_relevance_levels():
    assert relevance(["keep"]) == relevance(["init", "ppl"]) == "result"
    assert relevance(["ppl", "ruler"]) == "eval"
    assert relevance([]) == "none"


def test_a_recorded_settings_tree_reads_back_as_the_same_settings():
    import json

    from tcal.settings.conversion import run_settings

    for overrides in COMPOSITIONS:
        settings = compose(*overrides)
        assert run_settings(json.loads(json.dumps(settings.tree()))) == settings


def test_only_the_converter_and_the_entry_points_read_a_dictconfig():
    allowed = {"settings/compose.py", "settings/schemas.py", "settings/conversion.py", "cli/app.py", "cli/sweep.py",
               "cli/rank.py"}
    readers = sorted(path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py")
                     if re.search(r"^\s*(from|import) (omegaconf|hydra)\b", path.read_text(), re.M))
    assert set(readers) <= allowed, set(readers) - allowed


def test_every_declared_path_of_every_kind_resolves():
    """Each registry entry names a module and attribute that exist; a vLLM family's module needs vLLM, so its
    functions are found in the module's source instead of by importing it."""
    import ast
    import importlib.util

    from tcal.registry import ALL_REGISTRIES, TEACHER_FAMILIES, VLLM_FAMILIES

    for registry in ALL_REGISTRIES:
        for option in registry.options():
            if registry is VLLM_FAMILIES:
                module, _, name = option.implementation_at.partition(":")
                tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
                assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, option
                continue
            assert option.implementation is not None or option.name == "none", option
            assert option.settings is None or issubclass(option.settings, Settings), option
    assert VLLM_FAMILIES.names() == TEACHER_FAMILIES.names()  # the plugin serves every family tcal converts


def test_the_implementations_serve_exactly_the_names_the_settings_allow():
    from tcal.data.documents import SOURCES
    from tcal.init.calibration.phase1 import PHASE1_RULES
    from tcal.registry import INIT_MODES, POLICIES
    from tcal.settings.compose import group_options
    from tcal.settings.data import SOURCES as DATA_SOURCES
    from tcal.settings.init import PHASE1_RULES as RULES
    from tcal.registry import STAGE_KINDS
    from tcal.settings.teacher import DTYPES as DTYPE_NAMES
    from tcal.teachers.load import DTYPES

    assert INIT_MODES.names() == group_options("init") and len(INIT_MODES.names()) == 7
    assert POLICIES.names() == group_options("retention") and len(POLICIES.names()) == 5
    assert all(issubclass(o.settings, InitSettings) for o in INIT_MODES.options())
    assert all(callable(o.implementation) for o in (*INIT_MODES.options(), *POLICIES.options()))  # paths resolve
    assert tuple(PHASE1_RULES) == RULES
    assert sorted(SOURCES) == sorted(DATA_SOURCES)
    assert STAGE_KINDS.names() == ["align", "distill"]
    for option in STAGE_KINDS.options():  # the module and the settings of each kind are that kind's
        assert option.implementation.kind == option.name and option.settings().kind == option.name
    assert sorted(DTYPES) == sorted(DTYPE_NAMES)


def test_a_settings_object_built_in_python_names_its_class_and_field():
    from tcal.errors import ConfigError
    from tcal.settings import FullPlusSettings, PoolSettings, RunSettings

    with pytest.raises(ConfigError, match=r"^PoolSettings.tokens=-1; expected a positive integer$"):
        PoolSettings(tokens=-1)
    with pytest.raises(ConfigError, match=r"^init.pool.tokens=1000; expected a multiple of calibration.seq_len=256"):
        RunSettings(init=FullPlusSettings(pool=PoolSettings(tokens=1000)))


def _names_its_own_field(call) -> bool:
    """`f("steps", self.steps, ...)` or `f(key, getattr(self, key))`: a check that repeats the name of the field it
    checks (`bad(...)`, the message of a check relating fields, may name the field it blames)."""
    import ast

    if len(call.args) < 2 or getattr(call.func, "id", None) == "bad":
        return False
    key, value = call.args[0], call.args[1]
    if isinstance(key, ast.Constant) and isinstance(value, ast.Attribute):
        return isinstance(value.value, ast.Name) and value.value.id == "self" and value.attr == key.value
    return (isinstance(key, ast.Name) and isinstance(value, ast.Call) and getattr(value.func, "id", None) == "getattr"
            and len(value.args) == 2 and isinstance(value.args[1], ast.Name) and value.args[1].id == key.id)


def test_a_field_s_own_bound_is_declared_beside_it_not_repeated_in_check():
    """One place for a field's bound, `setting(..., check=...)`, run under the field's name (`check_fields`): no
    settings module checks a field by writing its name again."""
    import ast

    found = [f"{path.name}:{node.lineno}" for path in sorted((SRC / "settings").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
             and _names_its_own_field(node)]
    assert found == []
    from tcal.settings import DataSettings, HubDataSettings

    def bound_of(cls, name):
        return next(field.metadata.get("check") for field in dataclasses.fields(cls) if field.name == name)

    # a field declared again with another default keeps its base's bound
    assert bound_of(HubDataSettings, "calibration_docs") is bound_of(DataSettings, "calibration_docs") is not None


def test_a_declared_bound_runs_before_the_checks_that_relate_fields_and_must_be_a_function():
    from tcal.settings.fields import SettingError, declared, positive_int

    seen = []

    @declared
    @dataclasses.dataclass
    class Window(Settings):
        start: int = setting(0, affects=["ppl"])
        length: int = setting(8, affects=["ppl"], check=positive_int)

        def check(self) -> None:
            seen.append(self.length)

    with pytest.raises(SettingError, match=r"^Window.length=0; expected a positive integer$"):
        Window(length=0)
    assert seen == []
    Window(length=3)
    assert seen == [3]
    with pytest.raises(TypeError, match=r"check='positive': expected a function of \(key, value\)"):
        setting(1, affects=["ppl"], check="positive")
