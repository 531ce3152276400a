"""The `gguf` group: llama.cpp itself loads tcal's GGUF exports (`make gguf-check`, which builds .venv-gguf with
llama-cpp-python from the index's source package and sets TCAL_GGUF_VENV). llama.cpp runs in that venv through
`tcal/export/llama_cpp_run.py`; transformers runs the `qwen3_5` export of the same student in this one.

- A tiny random Qwen3 student (head_dim 32), exported f32: llama.cpp's prefill logits and its token-by-token decode
  logits match transformers within 5e-3 and every greedy token agrees.
- The same student in q8_0: the logit difference and greedy agreement are reported (printed and in the record).
- A non-periodic keep list (attention at 1 and 4 of 6) loads with KV cache on layers 1 and 4 only, recurrent state
  on the others, and passes the f32 check.
- A convention the read-back check cannot see (written and read back the same wrong way) fails llama.cpp's check,
  and nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import make_teacher

from tcal.export import gguf_export
from tcal.export.gguf_export import LLAMA_CPP_TOLERANCE
from tcal.export.refusal import ParityFailed
from tcal.export.write import export
from tcal.student.convert import build_student
from tcal.student.export import export_student

pytestmark = pytest.mark.gguf

GGUF_VENV = os.environ.get("TCAL_GGUF_VENV")
if not GGUF_VENV or not (Path(GGUF_VENV) / "bin" / "python").is_file():
    pytest.skip("gguf group: needs llama-cpp-python's venv; run `make gguf-check` (builds .venv-gguf and runs it)",
                allow_module_level=True)
GGUF_PYTHON = (Path(GGUF_VENV) / "bin" / "python").absolute()
EPS = 1e-5  # the GDN's norm eps, equal to the teacher's so that the Qwen3.5 map is exact (tcal.export.qwen3_5)


def saved_student(tmp_path_factory, keep: list[int], layers: int) -> Path:
    teacher = make_teacher("qwen3", rms_norm_eps=EPS, head_dim=32, num_hidden_layers=layers)
    return export_student(build_student(teacher, keep), None, tmp_path_factory.mktemp("student") / "student")


@pytest.fixture(scope="module")
def periodic(tmp_path_factory) -> Path:
    return saved_student(tmp_path_factory, [1, 3], 4)


def test_llama_cpp_decodes_the_f32_export_as_transformers_does(periodic, tmp_path):
    record = export(periodic, tmp_path / "f32", "gguf", serve_python=GGUF_PYTHON, options={"outtype": "f32"})
    check = record["llama_cpp_check"]
    assert check["checked"] and check["gated"] and check["passed"], check["summary"]
    assert check["max_abs_logit_diff_prefill"] <= LLAMA_CPP_TOLERANCE
    assert check["max_abs_logit_diff_decode"] <= LLAMA_CPP_TOLERANCE
    assert check["greedy_identical"] == check["prompts"] == 3
    assert check["kv_layers"] == [1, 3] and check["recurrent_layers"] == [0, 2]


def test_q8_0_is_reported_against_transformers(periodic, tmp_path, capsys):
    record = export(periodic, tmp_path / "q8", "gguf", serve_python=GGUF_PYTHON, options={"outtype": "q8_0"})
    check = record["llama_cpp_check"]
    with capsys.disabled():
        print(f"\nq8_0 through llama.cpp: {check['summary']}")
    assert check["checked"] and not check["gated"] and check["greedy_steps"] == 3 * 16
    assert check["max_abs_logit_diff_decode"] > 0  # rounded weights: a difference is expected, and reported


def test_a_non_periodic_keep_list_holds_kv_cache_on_the_kept_layers_only(tmp_path_factory, tmp_path):
    folder = saved_student(tmp_path_factory, [1, 4], 6)
    record = export(folder, tmp_path / "f32", "gguf", serve_python=GGUF_PYTHON, options={"outtype": "f32"})
    check = record["llama_cpp_check"]
    assert check["kv_layers"] == [1, 4] and check["recurrent_layers"] == [0, 2, 3, 5]
    assert check["passed"], check["summary"]


def test_norms_left_zero_centred_fail_llama_cpp_s_check(periodic, tmp_path, monkeypatch):
    """Qwen3.5's zero-centred norms kept as they are, in the file and in reading it back: the read-back passes (it is
    the writer's own convention), llama.cpp (whose norms are plain) does not."""
    monkeypatch.setattr(gguf_export, "is_centred_norm", lambda name: False)
    with pytest.raises(ParityFailed, match="llama.cpp does not reproduce transformers"):
        export(periodic, tmp_path / "broken", "gguf", serve_python=GGUF_PYTHON, options={"outtype": "f32"})
    assert not (tmp_path / "broken").exists()
