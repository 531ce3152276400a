"""The Python API: README's example runs as written on the tiny teacher (docs/python_api.md shows the same code),
and the typed settings' defaults are conf/'s."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import compose, isolated_cache_dir

from tcal.settings import (
    AlignSettings,
    DistillSettings,
    RunSettings,
    StageSequenceSettings,
    init_settings,
    tiny_teacher,
)
from tcal.registry import INIT_MODES

ROOT = Path(__file__).resolve().parents[1]
README, DOC = ROOT / "README.md", ROOT / "docs" / "python_api.md"


def python_block(path: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) == 1, f"expected one python block in {path}, found {len(blocks)}"
    return blocks[0]


def test_the_docs_show_readmes_example():
    assert python_block(DOC) == python_block(README)


def test_the_documented_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TCAL_CACHE_DIR", isolated_cache_dir(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_block(README), str(README), "exec"), namespace)
    assert namespace["keep"] == [0, 2]
    assert namespace["stages"]["distill"]["tokens_seen"] == 1024
    figures = namespace["results"]["metrics"]["shakespeare"]
    assert math.isfinite(figures["teacher_ppl"]) and math.isfinite(figures["student_ppl"])
    assert (tmp_path / "outputs" / "my_run" / "student" / "config.json").is_file()


def test_run_settings_defaults_are_the_default_config():
    assert compose() == RunSettings()


@pytest.mark.parametrize("mode", INIT_MODES.names())
def test_init_settings_are_conf_init_options(mode):
    assert compose(f"init={mode}").init == init_settings(mode)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_teacher_settings_are_conf_tiny_teachers(family):
    assert (compose(f"teacher=tiny_{family}")).teacher == tiny_teacher(family)


def test_stage_settings_are_conf_stage_options():
    assert (compose("stage=align")).stage == AlignSettings()
    assert (compose("stage=distill")).stage == DistillSettings()
    assert (compose("stage=align_distill")).stage == StageSequenceSettings()


def test_a_config_read_back_from_results_json_gets_its_classes():
    import json

    from tcal.settings.conversion import run_settings

    settings = compose("experiment=smoke", "init=full_plus", "stage=align_distill", "retention=ar")
    recorded = json.loads(json.dumps(settings.tree()))  # as a results.json holds it, untyped
    assert run_settings(recorded) == settings
