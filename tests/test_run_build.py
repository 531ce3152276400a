"""`Run.build`, the one road of `tcal` and of the Python API to a run: a student converted from another teacher than
the run's is refused in one line by both, before its step does any work."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, isolated_cache_dir, repo_cache_dir

from tcal import api
from tcal.errors import ConfigError
from tcal.run import Run
from tcal.settings import DistillSettings, EvalSettings, init_settings, tiny_teacher

OTHER_TEACHER = (r"^student: converted from a teacher with model_type='llama', but the teacher given has "
                 r"model_type='qwen3'; expected the teacher the student was converted from \(its "
                 r"config.teacher_config\)$")


@pytest.fixture(scope="module")
def llama_student():
    """A student of the tiny llama teacher, which has the tiny qwen3 teacher's sizes."""
    return api.build_student(api.load_teacher(tiny_teacher("llama"), repo_cache_dir()), [0, 2])


def weights(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_the_api_refuses_a_student_of_another_teacher(llama_student, tmp_path):
    qwen3 = api.load_teacher(tiny_teacher("qwen3"), repo_cache_dir())
    splits = api.load_data()
    assert {key: getattr(qwen3.model.config, key) for key in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        key: getattr(llama_student.config.teacher_config, key) for key in ("hidden_size", "num_hidden_layers",
                                                                         "vocab_size")}
    before = weights(llama_student)
    for step in (lambda: api.initialize(llama_student, qwen3, splits, init_settings("full_plus")),
                 lambda: api.distill(llama_student, qwen3, splits, DistillSettings(batch_size=2, seq_len=32),
                                     tokens=64, run_dir=tmp_path),
                 lambda: api.evaluate(llama_student, qwen3, splits, EvalSettings(seq_len=32, num_windows=1))):
        with pytest.raises(ConfigError, match=OTHER_TEACHER):
            step()
    assert all(torch.equal(before[name], tensor) for name, tensor in llama_student.state_dict().items())


def test_tcal_s_run_refuses_a_student_of_another_teacher(llama_student, tmp_path):
    settings = compose("experiment=smoke", "teacher=tiny_qwen3", "init=full_plus", "save_student=false",
                       f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    this_run = Run.build(settings, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=OTHER_TEACHER):
        this_run.initialize(llama_student)
    assert this_run.build_student([0]).config.teacher_config.model_type == "qwen3"  # its own student is its teacher's
