"""A new init mode and a new retention policy are each one module plus one YAML, in a package of their own that
`TCAL_PLUGINS` names: `tcal`, `tcal-plan` and the Python API run them with no other file changed; a new export format
and a new teacher family are one module each, in one such package; and no module outside the registry keeps a
name -> class table or a tuple of option names of its own."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir, make_teacher

from tcal.errors import ConfigError

TOY_INIT = '''
"""`toy_gate`: every GDN's output gate scaled by `gate_scale` (a toy mode, for the plugin test)."""
from dataclasses import dataclass

import torch

from tcal.registry import INIT_MODES
from tcal.settings.fields import INIT, declared, positive_number, setting
from tcal.settings.init import InitSettings


@declared
@dataclass
class ToyGateSettings(InitSettings):
    name: str = setting("toy_gate", affects=[INIT])
    gate_scale: float = setting(0.5, affects=[INIT], check=positive_number)


@INIT_MODES.option("toy_gate", ToyGateSettings)
@torch.no_grad()
def toy_gate(gdns, init: ToyGateSettings, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.mul_(init.gate_scale)
    return {"toy_gate_scale": init.gate_scale, "layers": sorted(gdns)}
'''

TOY_POLICY = '''
"""`last`: the round(ratio * L) last layers stay softmax (a toy policy, for the plugin test)."""
from dataclasses import dataclass

from tcal.registry import POLICIES
from tcal.retention import Selection
from tcal.settings.fields import KEEP, SCORES, declared, setting
from tcal.settings.retention import RetentionSettings


@declared
@dataclass
class LastLayersSettings(RetentionSettings):
    name: str = setting("last", affects=[SCORES, KEEP])

    def planned_keep(self, num_layers: int) -> list[int]:
        return list(range(num_layers - self.kept(num_layers), num_layers))


@POLICIES.option("last", LastLayersSettings)
def last(retention: LastLayersSettings, ctx) -> Selection:
    return Selection(retention.planned_keep(ctx.num_layers))
'''


def yaml(group: str, name: str) -> str:
    return (f"# `TCAL_PLUGINS=toy_options tcal {group}={name}`\n"
            f"defaults:\n  - /schema/{group}/{name}@_here_\n  - _self_\n")


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """A package of two options (two modules, two YAMLs; no __init__.py) and the environment that names it."""
    root = tmp_path_factory.mktemp("plugins")
    package = root / "toy_options"
    for path, text in ((package / "toy_gate.py", TOY_INIT), (package / "last.py", TOY_POLICY),
                       (package / "conf" / "init" / "toy_gate.yaml", yaml("init", "toy_gate")),
                       (package / "conf" / "retention" / "last.yaml", yaml("retention", "last"))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    assert sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()) == [
        "conf/init/toy_gate.yaml", "conf/retention/last.yaml", "last.py", "toy_gate.py"]
    return {**os.environ, "TCAL_PLUGINS": "toy_options", "PYTHONPATH": f"{root}{os.pathsep}{REPO / 'src'}",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TCAL_CACHE_DIR": isolated_cache_dir(root / "cache")}


def run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_tcal_runs_a_plugin_init_mode_and_policy(plugin_env, tmp_path):
    run([sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "init=toy_gate", "init.gate_scale=0.25",
         "retention=last", "retention.ratio=0.5", "save_student=false", "hydra.run.dir=run"], plugin_env, tmp_path)
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    assert record["status"] == "complete" and record["keep_layers"] == [2, 3]
    assert record["calibration"] == {"toy_gate_scale": 0.25, "layers": [0, 1]}
    assert record["config"]["init"] == {"name": "toy_gate", "gqa_expansion": "whole_head", "gate_scale": 0.25}


def test_a_plugin_option_refuses_a_bad_value_and_lists_among_the_options(plugin_env, tmp_path):
    bad = subprocess.run([sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "init=toy_gate",
                          "init.gate_scale=-1"], cwd=tmp_path, env=plugin_env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and re.search(r"init.gate_scale=-1(\.0)?; expected", bad.stderr), bad.stderr[-2000:]
    unknown = subprocess.run([sys.executable, "-m", "tcal.cli.app", "init=nope"], cwd=tmp_path, env=plugin_env,
                             capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "toy_gate" in unknown.stderr and "phase2" in unknown.stderr


def test_tcal_plan_plans_a_plugin_policy(plugin_env, tmp_path):
    done = run([sys.executable, "-m", "tcal.tools.plan", "teacher=tiny_llama", "init=toy_gate", "retention=last",
                "retention.ratio=0.25", "--json"], plugin_env, tmp_path)
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["retention"]["keep_layers"] == [3] and plan["retention"]["scored"] is False


def test_the_api_runs_a_plugin_init_mode_and_policy(plugin_env, tmp_path):
    script = textwrap.dedent('''
        import json
        from tcal import api
        from tcal.settings import init_settings, tiny_teacher
        from tcal.registry import POLICIES
        teacher = api.load_teacher(tiny_teacher("llama"))
        splits = api.load_data()
        selection = api.select_layers(teacher, splits, POLICIES["last"].make_settings(ratio=0.5))
        student = api.build_student(teacher, selection.keep_layers)
        record = api.initialize(student, teacher, splits, init_settings("toy_gate", gate_scale=2.0))
        print(json.dumps({"keep": selection.keep_layers, "record": record}))
    ''')
    done = run([sys.executable, "-c", script], plugin_env, tmp_path)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"keep": [2, 3],
                                                                "record": {"toy_gate_scale": 2.0, "layers": [0, 1]}}


MIDDLE_POLICY = '''
"""`middle`: the one middle layer stays softmax (a toy policy whose settings derive from `PolicySettings` itself)."""
from dataclasses import dataclass

from tcal.registry import POLICIES
from tcal.retention import Selection
from tcal.settings.fields import KEEP, SCORES, declared, setting
from tcal.settings.retention import PolicySettings


@declared
@dataclass
class MiddleLayerSettings(PolicySettings):
    name: str = setting("middle", affects=[SCORES, KEEP])

    def kept(self, num_layers: int) -> int:
        return 1

    def keep_setting(self) -> str:
        return "the middle layer"

    def planned_keep(self, num_layers: int) -> list[int]:
        return [num_layers // 2]


@POLICIES.option("middle", MiddleLayerSettings)
def middle(retention: MiddleLayerSettings, ctx) -> Selection:
    return Selection(retention.planned_keep(ctx.num_layers))
'''

FIRST_POLICY = '''
"""`first`: the round(ratio * L) first layers stay softmax (a toy policy that does not say its keep list)."""
from dataclasses import dataclass

from tcal.registry import POLICIES
from tcal.retention import Selection
from tcal.settings.fields import KEEP, SCORES, declared, setting
from tcal.settings.retention import RetentionSettings


@declared
@dataclass
class FirstLayersSettings(RetentionSettings):
    name: str = setting("first", affects=[SCORES, KEEP])


@POLICIES.option("first", FirstLayersSettings)
def first(retention: FirstLayersSettings, ctx) -> Selection:
    return Selection(list(range(retention.kept(ctx.num_layers))))
'''


@pytest.fixture(scope="module")
def policy_env(tmp_path_factory):
    """A package of the two toy policies above, and the environment that names it."""
    root = tmp_path_factory.mktemp("policy_plugins")
    package = root / "toy_policies"
    for path, text in ((package / "middle.py", MIDDLE_POLICY), (package / "first.py", FIRST_POLICY),
                       (package / "conf" / "retention" / "middle.yaml", yaml("retention", "middle")),
                       (package / "conf" / "retention" / "first.yaml", yaml("retention", "first"))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return {**os.environ, "TCAL_PLUGINS": "toy_policies", "PYTHONPATH": f"{root}{os.pathsep}{REPO / 'src'}",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TCAL_CACHE_DIR": isolated_cache_dir(root / "cache")}


def test_the_api_selects_by_a_policy_whose_settings_derive_from_policy_settings(policy_env, tmp_path):
    script = textwrap.dedent('''
        import json
        from tcal import api
        from tcal.registry import POLICIES
        from tcal.settings import tiny_teacher
        teacher = api.load_teacher(tiny_teacher("llama"))
        selection = api.select_layers(teacher, api.load_data(), POLICIES["middle"].make_settings())
        print(json.dumps(selection.keep_layers))
    ''')
    done = run([sys.executable, "-c", script], policy_env, tmp_path)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2]


def test_tcal_plan_says_it_cannot_plan_a_policy_without_its_own_planned_keep(policy_env, tmp_path):
    """`first` inherits uniform's `planned_keep`: the plan says, in one line, that it cannot plan its keep list,
    and plans the rest with its count of kept layers, not uniform's layers as if they were `first`'s."""
    done = run([sys.executable, "-m", "tcal.tools.plan", "teacher=tiny_llama", "retention=first",
                "retention.ratio=0.5", "--json"], policy_env, tmp_path)
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    said = "retention=first: FirstLayersSettings does not define planned_keep, so tcal-plan cannot plan its keep list"
    assert plan["retention"]["keep_layers"] is None and plan["retention"]["kept"] == 2
    assert plan["retention"]["note"].startswith(said) and plan["per_device_gb"]["calibration"] > 0
    assert [line for line in done.stderr.splitlines() if "planned_keep" in line] == [plan["retention"]["note"]]


def test_a_plugin_package_that_cannot_be_imported_is_named_on_every_ask(monkeypatch):
    from tcal.registry import PLUGINS_ENV, PluginError, Registry

    monkeypatch.setenv(PLUGINS_ENV, "tcal_no_such_plugin")
    registry = Registry("init mode", "init")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"TCAL_PLUGINS='tcal_no_such_plugin': cannot import "
                                              r"'tcal_no_such_plugin' \(no module named 'tcal_no_such_plugin'\)"):
            registry.names()


# Plugins that cannot be used: (TCAL_PLUGINS, {file under the plugin root: text}, what the one line says)
BROKEN_PLUGINS = {
    "raises": ("boom", {"boom/explode.py": "raise RuntimeError('boom at import')\n"},
               r"plugin 'boom' fails: importing boom.explode raised RuntimeError: boom at import; fix the plugin, "
               r"or remove it from TCAL_PLUGINS"),
    "missing": ("no_such_plugin_package", {},
                r"cannot import 'no_such_plugin_package' \(no module named 'no_such_plugin_package'\); expected "
                r"packages that import here"),
    "name_taken": ("dup", {"dup/again.py": "from tcal.registry import INIT_MODES\n"
                                           "from tcal.settings.init import InitSettings\n"
                                           "INIT_MODES.option('full', InitSettings)(None)\n"},
                   r"plugin 'dup' fails: importing dup.again raised ValueError: init mode 'full' is already registered "
                   r"\(by tcal.init.taylor\); expected a name of its own"),
    "plain_module": ("plain_options", {"plain_options.py": "X = 1\n"},
                     r"'plain_options' is a module \(.*plain_options.py\), not a package; expected a folder of "
                     r"option modules"),
}


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken_plugins")
    for _, files, _ in BROKEN_PLUGINS.values():
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
    return root


@pytest.mark.parametrize("case", sorted(BROKEN_PLUGINS))
def test_a_plugin_that_cannot_be_used_is_one_line_naming_it(case, broken_plugins, monkeypatch):
    """Every way a plugin fails is one ConfigError line naming it, as the entry points compose (`check_plugins`),
    also when this process composed before without it (TCAL_PLUGINS set in a notebook after a first run)."""
    from tcal.registry import PLUGINS_ENV
    from tcal.settings.compose import check_plugins

    plugins, _, message = BROKEN_PLUGINS[case]
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    check_plugins()
    monkeypatch.syspath_prepend(str(broken_plugins))
    monkeypatch.setenv(PLUGINS_ENV, plugins)
    with pytest.raises(ConfigError, match=rf"^TCAL_PLUGINS={plugins!r}: .*{message}") as refused:
        check_plugins()
    assert "\n" not in str(refused.value)


def test_a_failing_plugin_at_the_entry_points_is_one_line_and_exit_code_2(broken_plugins, tmp_path):
    """At `tcal`'s entry, `tcal-plan`'s and `tcal-export`'s: exit code 2, one line naming the plugin, no traceback,
    nothing written."""
    plugins, _, message = BROKEN_PLUGINS["raises"]
    env = {**os.environ, "TCAL_PLUGINS": plugins, "PYTHONPATH": f"{broken_plugins}{os.pathsep}{REPO / 'src'}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for command in (["tcal.cli.app", "experiment=smoke", "hydra.run.dir=run"], ["tcal.tools.plan", "teacher=tiny_llama"],
                    ["tcal.export.cli", "run", "exported", "--format", "tcal"]):
        done = subprocess.run([sys.executable, "-m", *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
        assert re.search(rf"^tcal(-export)?: configuration error: TCAL_PLUGINS={plugins!r}: .*{message}", lines[0]), \
            lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "exported").exists()


def test_a_failing_plugin_leaves_every_registry_as_it_was(broken_plugins, monkeypatch):
    """A plugin module that registers an option and then fails takes its options away again: asking once more names
    the same fault, not a name registered twice."""
    from tcal.registry import INIT_MODES, POLICIES, PLUGINS_ENV, PluginError, Registry

    (broken_plugins / "half").mkdir(exist_ok=True)
    (broken_plugins / "half" / "first.py").write_text(
        "from tcal.registry import POLICIES\nfrom tcal.settings.retention import RetentionSettings\n"
        "POLICIES.option('half_policy', RetentionSettings)(None)\nraise RuntimeError('half way')\n")
    monkeypatch.syspath_prepend(str(broken_plugins))
    monkeypatch.setenv(PLUGINS_ENV, "half")
    before = {registry.kind: dict(registry._options) for registry in (INIT_MODES, POLICIES)}
    registry = Registry("init mode", "init")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"importing half.first raised RuntimeError: half way"):
            registry.names()
        assert {r.kind: dict(r._options) for r in (INIT_MODES, POLICIES)} == before


TOY_FORMAT = '''
"""`toy`: tcal's checkpoint with a note in its config.json and a file of its own (a toy export format)."""
from tcal.export.formats import TcalFormat
from tcal.registry import EXPORT_FORMATS

NOTE = "written by the toy format"


class NotedFormat(TcalFormat):
    def edit_config(self, config: dict, folder) -> None:
        config["toy_note"] = NOTE
        (folder / "TOY_NOTE.txt").write_text(NOTE + "\\n")

    def after_parity(self, student, folder, prompts, serve_python) -> dict:
        return {"toy_note": (folder / "TOY_NOTE.txt").read_text().strip()}


EXPORT_FORMATS.declare("toy", NotedFormat())
'''

TOY_FAMILY = '''
"""`toy_llama`: a teacher family (`model_type: toy_llama`) laid out as Llama; it counts the teachers it checked."""
from dataclasses import dataclass

from tcal.registry import TEACHER_FAMILIES
from tcal.teachers.base import TeacherAdapter

CHECKED = []


@dataclass(frozen=True)
class CountingAdapter(TeacherAdapter):
    def check(self, model) -> None:
        CHECKED.append(model.config.model_type)
        super().check(model)


TEACHER_FAMILIES.declare("toy_llama", CountingAdapter(family="toy_llama", dropped=("q_proj.bias",)))
'''


@pytest.fixture
def toy_kinds(tmp_path, monkeypatch):
    """A package of a toy export format and a toy teacher family (two modules, no __init__.py) named by TCAL_PLUGINS
    in this process; every registry as it was afterwards."""
    from tcal.registry import ALL_REGISTRIES, PLUGINS_ENV

    package = tmp_path / "plugins" / "toy_kinds"
    package.mkdir(parents=True)
    (package / "toy_format.py").write_text(textwrap.dedent(TOY_FORMAT).lstrip())
    (package / "toy_family.py").write_text(textwrap.dedent(TOY_FAMILY).lstrip())
    before = [(registry, dict(registry._options), registry._loaded) for registry in ALL_REGISTRIES]
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv(PLUGINS_ENV, "toy_kinds")
    yield package
    for registry, options, loaded in before:
        registry._options, registry._loaded = options, loaded
    for name in [name for name in sys.modules if name == "toy_kinds" or name.startswith("toy_kinds.")]:
        del sys.modules[name]


def test_a_plugin_export_format_writes_through_tcal_export(toy_kinds, tmp_path, capsys):
    from tcal.export.cli import main as export_main
    from tcal.export.write import EXPORT_RECORD, export
    from tcal.student.convert import build_student
    from tcal.student.export import export_student

    folder = export_student(build_student(make_teacher("llama"), [0, 2]), None, tmp_path / "student")
    record = export(folder, tmp_path / "toy", "toy")
    note = sys.modules["toy_kinds.toy_format"].NOTE
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["toy_note"] == note
    assert record["format"] == "toy" and record["parity"]["passed"] and record["toy_note"] == note
    assert json.loads((tmp_path / "toy" / EXPORT_RECORD).read_text()) == record
    with pytest.raises(SystemExit) as refused:  # the CLI's choices are the registry's, the plugin's among them
        export_main([str(folder), str(tmp_path / "nope"), "--format", "nope"])
    assert refused.value.code == 2
    assert re.search(r"invalid choice: 'nope' \(choose from .*qwen3_5.*toy", capsys.readouterr().err)


def test_a_plugin_teacher_family_is_picked_for_its_model_type(toy_kinds):
    from tcal.preflight import check_family
    from tcal.teachers import adapter_for

    teacher = make_teacher("llama")
    assert adapter_for(teacher).family == "llama"
    teacher.config.model_type = "toy_llama"
    adapter = adapter_for(teacher)
    adapter.check(teacher)
    assert adapter.family == "toy_llama" and sys.modules["toy_kinds.toy_family"].CHECKED == ["toy_llama"]
    assert adapter.attention(teacher, 1) is teacher.model.layers[1].self_attn
    check_family(types.SimpleNamespace(architecture=None, config={"model_type": "toy_llama"}))  # before any work
    with pytest.raises(ValueError, match=r"unsupported teacher architecture 'mistral'; supported: llama, qwen2, "
                                         r"qwen3, toy_llama"):
        adapter_for(types.SimpleNamespace(model_type="mistral"))


def test_a_plugin_s_modules_are_those_at_its_top_and_none_needs_an_init_file(toy_kinds):
    """The registries import each module directly inside a plugin package (a namespace package: no __init__.py); a
    module in a subfolder is not imported (docs/usage.md, "In a package of your own")."""
    from tcal.registry import EXPORT_FORMATS

    (toy_kinds / "more").mkdir()
    (toy_kinds / "more" / "extra.py").write_text(
        "from tcal.export.formats import TcalFormat\nfrom tcal.registry import EXPORT_FORMATS\n"
        "EXPORT_FORMATS.declare('extra', TcalFormat())\n")
    assert not list(toy_kinds.rglob("__init__.py"))
    assert "toy" in EXPORT_FORMATS and "extra" not in EXPORT_FORMATS


def test_a_settings_class_that_keeps_its_base_s_name_runs_the_base_s_option(toy_kinds):
    """Why a plugin's settings class redeclares `name` (docs/usage.md): the run calls the option its settings name,
    and a class that does not redeclare it carries its base's name when built in Python."""
    from tcal.registry import INIT_MODES

    (toy_kinds / "unnamed.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from tcal.registry import INIT_MODES
        from tcal.settings.fields import INIT, declared, setting
        from tcal.settings.init import InitSettings


        @declared
        @dataclass
        class UnnamedSettings(InitSettings):
            scale: float = setting(0.5, affects=[INIT])


        @INIT_MODES.option("unnamed", UnnamedSettings)
        def unnamed(gdns, init, ctx) -> dict:
            return {"scale": init.scale}
    '''))
    built = INIT_MODES["unnamed"].settings(scale=0.25)
    assert INIT_MODES["unnamed"].make_settings(scale=0.25).name == "unnamed"
    assert built.name == "naive" and INIT_MODES[built.name].implementation is not INIT_MODES["unnamed"].implementation


BOUNDED = '''
from dataclasses import dataclass

from tcal.registry import INIT_MODES, POLICIES
from tcal.retention import Selection
from tcal.settings.fields import INIT, KEEP, SCORES, declared, one_of, positive_number, setting
from tcal.settings.init import InitSettings
from tcal.settings.retention import RetentionSettings


@declared
@dataclass
class ScaledSettings(InitSettings):
    name: str = setting("scaled", affects=[INIT])
    scale: float = setting(0.5, affects=[INIT], check=positive_number)
    side: str = setting("left", affects=[INIT], check=one_of(["left", "right"]))


@INIT_MODES.option("scaled", ScaledSettings)
def scaled(gdns, init, ctx) -> dict:
    return {}


@declared
@dataclass
class QuarterSettings(RetentionSettings):
    name: str = setting("quarter", affects=[SCORES, KEEP])
    ratio: float = setting(0.25, affects=[KEEP])  # another default, the base's bound


@POLICIES.option("quarter", QuarterSettings)
def quarter(retention, ctx) -> Selection:
    return Selection(retention.planned_keep(ctx.num_layers))
'''


@pytest.mark.parametrize("group, values, message", [
    ("init", {"name": "scaled", "scale": -1}, "init.scale=-1; expected a number > 0"),
    ("init", {"name": "scaled", "side": "up"}, "init.side='up'; expected one of left, right"),
    ("retention", {"name": "quarter", "ratio": 2}, "retention.ratio=2 must lie in (0, 1]"),
])
def test_a_plugin_field_s_declared_bound_is_enforced_naming_the_key(toy_kinds, group, values, message):
    """A plugin's settings declare their bounds beside their fields as tcal's do (`setting(..., check=...)`); a field
    declared again with another default keeps its base's bound. Built from a config the error names the key under
    its group, built in Python under the class."""
    from tcal.registry import INIT_MODES, POLICIES
    from tcal.settings.conversion import run_settings
    from tcal.settings.fields import SettingError

    (toy_kinds / "bounded.py").write_text(textwrap.dedent(BOUNDED))
    registry = {"init": INIT_MODES, "retention": POLICIES}[group]
    settings_class = registry[values["name"]].settings
    with pytest.raises(ConfigError) as refused:
        run_settings({group: values})
    assert str(refused.value) == message
    with pytest.raises(SettingError) as built:
        settings_class(**{key: value for key, value in values.items() if key != "name"})
    assert str(built.value) == message.replace(f"{group}.", f"{settings_class.__name__}.", 1)


def option_tables(text: str, option_names: list[set[str]]) -> list[int]:
    """The lines of `text` that write a table of options: a dict literal from a name to a class or function named in
    CamelCase (`{"align": AlignStage}`), to a registry entry's `.implementation`, or, from an option's name, to a module
    attribute (`{"full": taylor.calibrated}`); or a constant holding every name of one kind's options, as a tuple, list
    or set (`FORMATS = ("tcal", "hf", "qwen3_5", "vllm")`). `option_names` holds each kind's names. A sort order
    (`INIT_ORDER`: the paper's order, other names after it) is not a table."""
    def names_option(node) -> bool:
        return isinstance(node, ast.Constant) and any(node.value in names for names in option_names)

    def table_value(key, value) -> bool:
        if isinstance(value, ast.Name):
            return re.fullmatch(r"[A-Z][a-z0-9]+\w*", value.id) is not None
        if not isinstance(value, ast.Attribute) or value.attr.startswith("__"):
            return False
        return value.attr == "implementation" or (isinstance(value.value, ast.Name) and names_option(key))

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Dict):
            pairs = [(k, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)
                     and isinstance(k.value, str)]
            if any(table_value(key, value) for key, value in pairs):
                found.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.endswith("_ORDER") for t in targets):
                continue
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            if len(values) == len(node.value.elts) >= 2 and any(set(values) == names for names in option_names):
                found.append(node.lineno)
    return found


def every_kinds_names() -> list[set[str]]:
    from tcal.registry import ALL_REGISTRIES

    return [set(registry._options) for registry in ALL_REGISTRIES]


# Tables each kind had before it was a registry, and what is no table (a dtype map, RULER's tasks, a subset of a
# kind's names, a sort order, a record's entries, a loop over names)
OLD_TABLES = ('STAGES = {"align": AlignStage, "distill": DistillStage}',
              'FORMATS = ("tcal", "hf", "qwen3_5", "vllm", "gguf")',
              'VLLM_FAMILIES = ("llama", "qwen2", "qwen3")',
              'KINDS = ("align", "distill")',
              'layer_class = {"qwen2": Qwen2DecoderLayer, "qwen3": Qwen3DecoderLayer}.get(family)',
              'MODES = {"full": CalibratedInitSettings, "naive": InitSettings}',
              'CALLS = {"full": INIT_MODES["full"].implementation}',
              'POLICY_FUNCTIONS = {"uniform": uniform.uniform}')
NO_TABLES = ('DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}',
             'RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")',
             'EFFICIENCY_STAGES = ("distill", "align_distill", "none")',
             'ZERO_SHOT_STAGES = ("none",)',
             'PHASES = ("phase1", "phase2")',
             'POLICY_ORDER = ("uniform", "ar", "ga_s2", "recall", "explicit")',
             'engine = {"vllm": vllm.__version__, "architecture": config.model_config.architecture}',
             'for kind in ("align", "distill"): pass')


@pytest.mark.parametrize("line", OLD_TABLES)
def test_the_table_guard_catches_every_kinds_old_table(line):
    assert option_tables(line, every_kinds_names()) == [1]


@pytest.mark.parametrize("line", NO_TABLES)
def test_the_table_guard_leaves_what_is_no_table(line):
    assert option_tables(line, every_kinds_names()) == []


def test_no_name_to_class_table_outside_the_registry():
    """A table of options (`option_tables`: a name -> class or implementation dict, a tuple of option names) is the
    registry's job (`tcal.registry`), derived from it everywhere else."""
    names = every_kinds_names()
    exempt = {REPO / "src" / "tcal" / "registry.py", REPO / "src" / "tcal" / "export" / "remote"}  # remote: shipped
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "src" / "tcal").rglob("*.py"))
             if not exempt & {path, *path.parents} for line in option_tables(path.read_text(), names)]
    assert found == []


def test_no_module_imports_by_name_outside_the_registry():
    """Only the registry imports a module by its name (an option's dotted path, a plugin's modules)."""
    found = [path.relative_to(REPO).as_posix() for path in sorted((REPO / "src" / "tcal").rglob("*.py"))
             if "import_module" in path.read_text() and path.relative_to(REPO).as_posix() != "src/tcal/registry.py"]
    assert found == []


BROKEN_PATHS = {  # a plugin declaring options at dotted paths that do not resolve (each module itself imports)
    "bad_gate.py": "from tcal.registry import INIT_MODES\n"
                   "INIT_MODES.declare('bad_gate', 'toy_paths.no_such_module:gate',\n"
                   "                   'tcal.settings.init:InitSettings')\n",
    "bad_policy.py": "from tcal.registry import POLICIES\n"
                     "POLICIES.declare('bad_settings', 'tcal.retention.uniform:uniform',\n"
                     "                 'tcal.settings.retention:NoSuchSettings')\n",
    "conf/init/bad_gate.yaml": yaml("init", "bad_gate"),
    "conf/retention/bad_settings.yaml": yaml("retention", "bad_settings"),
}
BAD_GATE = (r"TCAL_PLUGINS='toy_paths': plugin 'toy_paths' declares init mode 'bad_gate' with implementation "
            r"'toy_paths.no_such_module:gate', which does not resolve \(ModuleNotFoundError: .*\); expected an "
            r"importable 'module:attribute'")
BAD_SETTINGS = (r"TCAL_PLUGINS='toy_paths': plugin 'toy_paths' declares retention policy 'bad_settings' with "
                r"settings 'tcal.settings.retention:NoSuchSettings', which does not resolve \(AttributeError: .*\)")


@pytest.fixture
def broken_paths(tmp_path, monkeypatch):
    """TCAL_PLUGINS names `toy_paths` in this process; every registry as it was afterwards."""
    from tcal.registry import ALL_REGISTRIES, PLUGINS_ENV

    root = tmp_path / "plugins"
    for name, text in BROKEN_PATHS.items():
        (root / "toy_paths" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "toy_paths" / name).write_text(text)
    before = [(registry, dict(registry._options), registry._loaded) for registry in ALL_REGISTRIES]
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv(PLUGINS_ENV, "toy_paths")
    yield root
    for registry, options, loaded in before:
        registry._options, registry._loaded = options, loaded
    for name in [name for name in sys.modules if name == "toy_paths" or name.startswith("toy_paths.")]:
        del sys.modules[name]


def test_a_plugin_path_that_does_not_resolve_is_named_before_the_teacher_loads(broken_paths, compose_cfg, tmp_path,
                                                                                monkeypatch):
    from test_errors import assert_nothing_written

    from tcal import api
    from tcal.pipeline import run

    def no_teacher_load(*args, **kwargs):
        raise AssertionError("the teacher was loaded before the plugin's path was checked")

    monkeypatch.setattr(api, "load_teacher", no_teacher_load)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"^{BAD_GATE}") as refused:
        run(compose_cfg("experiment=smoke", "init=bad_gate", f"paths.cache_dir={tmp_path / 'cache'}"), run_dir)
    assert "\n" not in str(refused.value)
    assert_nothing_written(run_dir)
    with pytest.raises(ConfigError, match=BAD_SETTINGS):
        compose_cfg("experiment=smoke", "retention=bad_settings")


def test_runs_that_do_not_use_a_plugin_s_broken_path_are_not_broken_by_it(broken_paths, compose_cfg):
    from tcal.preflight import check_chosen_options
    from tcal.registry import INIT_MODES, POLICIES

    settings = compose_cfg("experiment=smoke", "eval/harness=local", "eval/ruler=default")
    check_chosen_options(settings)
    assert "bad_gate" in INIT_MODES.names() and "bad_settings" in POLICIES.names()


def test_a_plugin_path_that_does_not_resolve_at_the_entry_points(broken_paths, tmp_path):
    """`tcal` and `tcal-plan` with the broken option: exit 2, one line naming the plugin and the path; without it
    `tcal-plan` plans as before."""
    env = {**os.environ, "TCAL_PLUGINS": "toy_paths", "PYTHONPATH": f"{broken_paths}{os.pathsep}{REPO / 'src'}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TCAL_CACHE_DIR": isolated_cache_dir(tmp_path / "cache")}
    for command, message in ((["tcal.cli.app", "experiment=smoke", "retention=bad_settings", "hydra.run.dir=run"],
                              BAD_SETTINGS),
                             (["tcal.cli.app", "experiment=smoke", "init=bad_gate", "hydra.run.dir=run"], BAD_GATE),
                             (["tcal.tools.plan", "teacher=tiny_llama", "retention=bad_settings"], BAD_SETTINGS)):
        done = subprocess.run([sys.executable, "-m", *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and re.search(message, lines[0]), done.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    run([sys.executable, "-m", "tcal.tools.plan", "teacher=tiny_llama", "--json"], env, tmp_path)
