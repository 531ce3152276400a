"""One run's steps: each of `tcal`'s checks runs once in a run (its steps do not check again what the run's
preflight checked), the record's fields are written by `Record` alone, and training reaches the record only through
Lightning's own callback hooks."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import lightning as L
from conftest import compose, isolated_cache_dir

from tcal import preflight
from tcal.pipeline import RecordCallback, run

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tcal"
CHECKS = ("check_split_tokens", "check_keep_list", "check_fit", "check_ruler_room", "check_budgets", "check_trainer")


def count_calls(monkeypatch, names) -> Counter:
    """Calls of each of preflight's `names`, wherever tcal's modules hold them (also under an imported name)."""
    calls: Counter = Counter()
    for name in names:
        original = getattr(preflight, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        for module in [m for key, m in sys.modules.items() if key == "tcal" or key.startswith("tcal.")]:
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return calls


def test_each_check_runs_once_in_a_run(tmp_path, monkeypatch):
    """A run whose policy scores layers, whose init calibrates and which trains a stage reads the calibration and
    evaluation splits and the teacher's context in three steps: each check still runs once."""
    settings = compose("experiment=smoke", "retention=ar", "retention.num_windows=2", "retention.seq_len=32",
                       "init=phase2", "calibration.phase2.steps=1", "stage=distill", "stage.batch_size=2",
                       "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=128",
                       "eval.num_windows=2", "logger=none", "save_student=false",
                       f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    calls = count_calls(monkeypatch, CHECKS)
    record = run(settings, tmp_path / "run")
    assert record["status"] == "complete" and record["stages"]["distill"]["tokens_seen"] == 128
    assert calls == Counter({name: 1 for name in CHECKS})


def written_fields(path: Path) -> list[str]:
    """Where `path` changes a `fields` mapping: an item assigned or deleted, or a mutating method called on it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr == "fields":
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "update", "setdefault", "pop", "clear") and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr == "fields":
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_record_writes_its_fields():
    record_module = PACKAGE / "store" / "record.py"
    assert written_fields(record_module)  # the scan finds the Record's own writes
    elsewhere = [place for path in sorted(PACKAGE.rglob("*.py")) if path != record_module
                 for place in written_fields(path)]
    assert elsewhere == []


def test_training_reaches_the_record_through_lightning_hooks_alone():
    own = {name for name in vars(RecordCallback) if not name.startswith("__")}
    assert own and own <= {name for name in dir(L.Callback) if name.startswith("on_")}
