"""The installed package stands without the benchmarks, no module reaches into another's private names, and the
imports between the folders of src/tcal run down one layer order; settings are built and composed without the
options' code."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_MODULES = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}


def imports(folder: str):
    """(file, imported module, imported names) for every `import` / `from ... import` under `folder`."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                yield path, node.module, [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, alias.name, []


def test_the_package_imports_nothing_from_the_benchmarks():
    found = [(path.name, module) for path, module, _ in imports("src")
             if module.split(".")[0] in BENCHMARK_MODULES | {"benchmarks"}]
    assert {"bench", "measurement"} <= BENCHMARK_MODULES and found == []


def test_no_module_imports_a_private_name_of_another():
    own = BENCHMARK_MODULES | {"tcal", "conftest"}
    found = [(path.relative_to(ROOT).as_posix(), module, name) for folder in ("src", "benchmarks", "tests")
             for path, module, names in imports(folder) if module.split(".")[0] in own
             for name in names if name.startswith("_")]
    assert found == []


# The folders (and top-level modules) of src/tcal from the bottom layer up. A module imports tcal only from layers
# below its own, never from its own layer or one above.
LAYERS = (
    ("errors",),
    ("arguments", "hub", "registry"),
    ("runtime", "serving", "settings"),
    ("store",),
    ("data", "teachers", "tracking"),
    ("context", "evaluate", "student"),
    ("export", "init", "preflight", "training"),
    ("retention",),
    ("run", "tools"),
    ("api", "pipeline"),
    ("cli",),
)
PACKAGE = ROOT / "src" / "tcal"


def _part(path: Path) -> str:
    """The folder or top-level module of src/tcal that `path` belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _tcal_imports():
    """(file, line, imported tcal module) for every import of tcal under src/tcal, those inside functions too."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: a relative import; write it as `from tcal...`"
                modules = [f"tcal.{alias.name}" for alias in node.names] if node.module == "tcal" else [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.split(".")[0] == "tcal" and "." in module:
                    yield path, node.lineno, module


def test_imports_run_down_the_layers():
    """Lower layers never import higher ones. The bottom layers (errors, settings, store) are what every run stands
    on: with imports one way, each layer can be read, tested and reused without those above it, no import cycle can
    form (a same-layer import is refused too), and a change high up (a report, the CLI) cannot break a low module.
    An import inside a function counts as much as one at the top: it is the same dependency, deferred. `LAYERS`
    holds the order once: a new folder or module takes its place there, and an import that must go against it
    means the code belongs in another layer, not that the order should bend. (Modules a registry loads by name,
    `importlib.import_module`, are not imports here.)"""
    layer = {name: index for index, names in enumerate(LAYERS) for name in names}
    parts = {_part(path) for path in PACKAGE.rglob("*.py")} - {"__init__", "__pycache__"}
    assert sorted(parts - set(layer)) == [], "folders or modules of src/tcal missing from LAYERS: place each there"
    assert sorted(set(layer) - parts) == [], "LAYERS names a folder or module src/tcal no longer has"
    wrong = []
    for path, line, module in _tcal_imports():
        mine, theirs = _part(path), module.split(".")[1]
        if mine != theirs and theirs in layer and layer[theirs] >= layer[mine]:
            wrong.append(f"{path.relative_to(ROOT).as_posix()}:{line} imports {module}: {mine} (layer "
                         f"{layer[mine] + 1}) may import only from layers below it, and {theirs} is layer "
                         f"{layer[theirs] + 1}")
    assert wrong == [], "imports against the layer order (tests/test_imports.py, LAYERS):\n" + "\n".join(wrong)


SETTINGS_ONLY = textwrap.dedent("""
    import json, sys, time
    started = time.perf_counter()
    from tcal.settings import RunSettings
    RunSettings()
    seconds = time.perf_counter() - started
    def heavy():
        from tcal.registry import ALL_REGISTRIES
        named = {o.implementation_at.partition(":")[0] for r in ALL_REGISTRIES for o in r._options.values()
                 if isinstance(o.implementation_at, str)}
        option_code = ("tcal.init", "tcal.retention", "tcal.evaluate", "tcal.export", "tcal.serving", "tcal.teachers",
                       "tcal.training")
        return sorted(m for m in sys.modules if m == "torch" or m in named or m.startswith(option_code))
    built = heavy()
    from tcal.settings.compose import settings_for
    composed = settings_for("init=full_plus", "retention=recall", "init.pool.tokens=4096")
    print(json.dumps({"built": built, "composed": heavy(), "seconds": seconds, "init": type(composed.init).__name__}))
""")


def test_settings_are_built_and_composed_without_importing_any_option_or_torch():
    """A registry names each option's implementation by dotted path and imports it when the option runs: building
    `RunSettings()` and composing `settings_for(...)` (every name checked, every schema built) import no option module
    and not torch. The time is a loose bound only (a shared machine); the import set is the test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("TCAL_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", SETTINGS_ONLY], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["built"] == [] and found["composed"] == [] and found["init"] == "FullPlusSettings", found
    assert found["seconds"] < 5.0, found
