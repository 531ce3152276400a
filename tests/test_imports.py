"""The installed package stands without the benchmarks, and no module reaches into another's private names."""

import ast
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
