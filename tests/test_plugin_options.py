"""A new init mode and a new retention policy are each one module plus one YAML, in a package of their own that
`TCAL_PLUGINS` names: `tcal`, `tcal-plan` and the Python API run them with no other file changed; and no module
outside the registry keeps a name -> class table of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, isolated_cache_dir

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
    gate_scale: float = setting(0.5, affects=[INIT])

    def check(self) -> None:
        super().check()
        positive_number("gate_scale", self.gate_scale)


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
    return {**os.environ, "TCAL_PLUGINS": "toy_options", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TCAL_CACHE_DIR": isolated_cache_dir(root / "cache")}


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
    """At `tcal`'s entry and `tcal-plan`'s: exit code 2, one line naming the plugin, no traceback, nothing written."""
    plugins, _, message = BROKEN_PLUGINS["raises"]
    env = {**os.environ, "TCAL_PLUGINS": plugins, "PYTHONPATH": f"{broken_plugins}{os.pathsep}{REPO / 'src'}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for command in (["tcal.cli.app", "experiment=smoke", "hydra.run.dir=run"], ["tcal.tools.plan", "teacher=tiny_llama"]):
        done = subprocess.run([sys.executable, "-m", *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
        assert re.search(rf"^tcal: configuration error: TCAL_PLUGINS={plugins!r}: .*{message}", lines[0]), lines[0]
    assert not (tmp_path / "run").exists()


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


def test_no_name_to_class_table_outside_the_registry():
    """A dict literal mapping an option's name to a settings class or to an implementation is the registry's
    job (`tcal.registry`), derived from it everywhere else."""
    table = re.compile(r"""["'][a-z_0-9]+["']\s*:\s*(?:[A-Z]\w*Settings\b|[a-z_]+\.implementation\b)""")
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "src" / "tcal").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if table.search(line)]
    assert found == []
