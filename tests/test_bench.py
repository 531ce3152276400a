"""The benchmark entry runs end to end on tiny inputs (figures, not timings, are checked)."""

import pytest
from conftest import make_teacher

from tcal.bench import bench_student, emit


def test_bench_student_prints_every_figure(capsys):
    teacher = make_teacher("llama")
    lines = bench_student(teacher, [0, 2], batch=1, seq_len=16, context=32)
    assert [line["figure"] for line in lines] == ["student_forward", "student_forward_backward", "cache_bytes",
                                                  "decode_per_token"]
    cache = lines[2]
    # after the 32-token prefill: keys + values of 2 KV heads x 16 dims per softmax layer (float32);
    # the student keeps 2 such layers and 2 GDN states of 4 heads x 16 x 16
    kv_per_layer = 2 * 2 * 32 * 16 * 4
    assert cache["teacher_bytes"] == 4 * kv_per_layer
    assert cache["student_bytes"] == 2 * kv_per_layer + 2 * 4 * 16 * 16 * 4
    assert len(capsys.readouterr().out.strip().splitlines()) == 4


def test_emit_rounds_floats(capsys):
    assert emit("x", ratio=1.234567891, n=3) == {"figure": "x", "ratio": 1.23457, "n": 3}
    assert capsys.readouterr().out.strip() == '{"figure": "x", "ratio": 1.23457, "n": 3}'


def test_bench_stages_print_their_figures(capsys):
    from tcal.bench import bench_stage1, bench_stage2

    teacher = make_teacher("llama")
    lines = [bench_stage2(teacher, [0, 2], batch=1, seq_len=16), bench_stage2(teacher, [0, 2], batch=1, seq_len=16,
                                                                               plain=True),
             bench_stage1(teacher, [0, 2], batch=1, seq_len=16)]
    assert [line["figure"] for line in lines] == ["stage2_step", "stage2_plain_step", "stage1_step"]
    for line in lines:
        parts = line["teacher_forward_s"] + line.get("student_forward_backward_s", line.get("gdn_forward_backward_s", 0))
        assert line["ratio"] == pytest.approx(line["step_s"] / parts, rel=0.05)  # emit rounds to 1e-5 s
        assert line["peak_rss_gb"] > 0


def test_fresh_process_runs_with_the_environment_it_is_given():
    import os

    from tcal.bench import in_fresh_process

    assert in_fresh_process(os.getenv, "TCAL_BENCH_PROBE", env={"TCAL_BENCH_PROBE": "eager"}) == "eager"
    assert "TCAL_BENCH_PROBE" not in os.environ
