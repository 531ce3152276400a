"""`tcal-export --format gguf` without llama.cpp: the file's `qwen35` keys and tensor names for a tiny student, its
`recurrent_layers` equal to the converted layers (a non-periodic keep list too), the rotary sections, the outtypes,
and the one-line refusals. llama.cpp itself loads the file in test_gguf_llama_cpp.py (`make gguf-check`)."""

from __future__ import annotations

import json

import pytest
from conftest import make_teacher

from tcal.export import gguf_export
from tcal.export.cli import main as export_main
from tcal.export.gguf_export import GGUF_FILE, RECURRENT_LAYERS_KEY, rope_sections
from tcal.export.refusal import ExportRefused, ParityFailed
from tcal.export.write import EXPORT_RECORD, export
from tcal.student.convert import build_student
from tcal.student.export import export_student

EPS = 1e-5  # the GDN's norm eps, equal to the teacher's so that the Qwen3.5 map is exact (tcal.export.qwen3_5)
HEAD_DIM = 32
# llama.cpp's qwen35 loader (src/models/qwen35.cpp): the tensors of each kind of layer
EVERY_LAYER = ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
             "attn_k_norm.weight")
RECURRENT = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_beta.weight",
             "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")


def reader(folder):
    import gguf

    return gguf.GGUFReader(str(folder / GGUF_FILE))


def student_folder(tmp_path_factory, keep, layers):
    student = build_student(make_teacher("qwen3", rms_norm_eps=EPS, head_dim=HEAD_DIM, num_hidden_layers=layers), keep)
    return student, export_student(student, None, tmp_path_factory.mktemp("student") / "student")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 student keeping attention at 1 and 3 of 4, saved, and its f32 GGUF export."""
    student, folder = student_folder(tmp_path_factory, [1, 3], 4)
    dest = tmp_path_factory.mktemp("gguf") / "f32"
    record = export(folder, dest, "gguf", options={"outtype": "f32"})
    return student, folder, dest, record


def test_the_file_holds_qwen35_keys_and_llama_cpp_s_tensor_names(qwen3):
    student, _, dest, record = qwen3
    teacher = student.config.teacher_config
    file = reader(dest)
    field = lambda key: file.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "qwen35"
    assert field("qwen35.block_count") == 4 and field("qwen35.embedding_length") == teacher.hidden_size
    assert field("qwen35.attention.head_count") == teacher.num_attention_heads
    assert field("qwen35.attention.head_count_kv") == teacher.num_key_value_heads
    assert field("qwen35.attention.key_length") == field("qwen35.attention.value_length") == HEAD_DIM
    assert field("qwen35.rope.dimension_count") == HEAD_DIM  # RoPE over the whole head, as the student's
    assert field("qwen35.ssm.conv_kernel") == 4 and field("qwen35.ssm.state_size") == HEAD_DIM
    assert field("qwen35.ssm.group_count") == field("qwen35.ssm.time_step_rank") == teacher.num_attention_heads
    assert field("qwen35.ssm.inner_size") == HEAD_DIM * teacher.num_attention_heads
    assert field("tokenizer.ggml.model") == "none" and field("qwen35.vocab_size") == teacher.vocab_size
    assert "qwen35.full_attention_interval" not in file.fields  # a loader without recurrent_layers must not guess
    kinds = ["attention" if i in (1, 3) else "recurrent" for i in range(4)]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i, kind in enumerate(kinds):
        expected |= {f"blk.{i}.{name}" for name in EVERY_LAYER + (ATTENTION if kind == "attention" else RECURRENT)}
    assert {tensor.name for tensor in file.tensors} == expected
    shapes = {tensor.name: list(tensor.shape) for tensor in file.tensors}  # ggml order: [columns, rows]
    assert shapes["blk.1.attn_q.weight"] == [teacher.hidden_size, 2 * teacher.num_attention_heads * HEAD_DIM]
    assert shapes["blk.0.ssm_conv1d.weight"] == [4, 3 * teacher.num_attention_heads * HEAD_DIM]
    assert record["parity"]["passed"] and record["parity"]["max_abs_logit_diff"] <= 1e-4
    assert "against the student" in record["gguf"]["compared"]
    assert record["llama_cpp_check"] == {"checked": False,
                                         "why": "no interpreter with llama-cpp-python given (--serve-python)"}
    assert json.loads((dest / EXPORT_RECORD).read_text()) == record


def test_recurrent_layers_are_the_converted_layers_of_a_non_periodic_keep_list(tmp_path_factory):
    """Attention kept at 1 and 4 of 6: no interval describes it; the file says each layer's kind."""
    student, folder = student_folder(tmp_path_factory, [1, 4], 6)
    dest = tmp_path_factory.mktemp("gguf") / "q8"
    record = export(folder, dest, "gguf", options={"outtype": "q8_0"})
    converted = [i for i, kind in enumerate(student.config.layer_types) if kind == "linear_attention"]
    assert converted == [0, 2, 3, 5]
    assert reader(dest).fields[RECURRENT_LAYERS_KEY].contents() == [i in converted for i in range(6)]
    assert record["gguf"]["recurrent_layers"] == converted and record["gguf"]["attention_layers"] == [1, 4]
    assert {f"blk.{i}.attn_q.weight" for i in (1, 4)} <= {tensor.name for tensor in reader(dest).tensors}
    # q8_0: the map is exact against the same rounding in memory; the rounding's cost is reported, not hidden
    assert record["parity"]["passed"] and record["parity"]["max_abs_logit_diff"] <= 1e-4
    assert 0 < record["gguf"]["outtype_cost"]["max_abs_logit_diff"]
    types = {tensor.name: tensor.tensor_type.name for tensor in reader(dest).tensors}
    assert types["blk.1.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.attn_q_norm.weight"] == types["blk.0.ssm_a"] == types["blk.0.ssm_conv1d.weight"] == "F32"


def test_a_wrong_norm_convention_fails_the_read_back_parity(qwen3, tmp_path, monkeypatch):
    """The check can fail: a writer that leaves Qwen3.5's zero-centred norms without their 1 (llama.cpp's norms are
    plain) is caught by reading the file back under llama.cpp's convention, before the move."""
    _, folder, _, _ = qwen3
    right = gguf_export.to_llama_cpp

    def zero_centred(hf_name, tensor):
        data = right(hf_name, tensor)
        return data - 1.0 if gguf_export.is_centred_norm(hf_name) else data

    monkeypatch.setattr(gguf_export, "to_llama_cpp", zero_centred)
    with pytest.raises(ParityFailed, match="does not reproduce the student"):
        export(folder, tmp_path / "broken", "gguf", options={"outtype": "f32"})
    assert not (tmp_path / "broken").exists()


def imrope_section(pair: int, sections: list[int]) -> str:
    """Which position ggml's interleaved multi-section RoPE gives rotary pair `pair` (ggml-cpu's mrope cache)."""
    sector = pair % sum(sections)
    for residue, name in ((1, "h"), (2, "w"), (0, "t")):
        if sector % 3 == residue and sector < 3 * sections[residue]:
            return name
    return "e"


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128, 256])
def test_rope_sections_give_every_pair_the_text_position(head_dim):
    """Text tokens carry their position in t, h and w and 0 in e: every pair must fall in t, h or w, and the sections
    must not exceed the pairs (ggml aborts otherwise: the converter's [11, 11, 10, 0] needs 64-dim heads)."""
    sections = rope_sections(head_dim)
    assert sum(sections) == head_dim // 2 and sections[3] == 0
    assert {imrope_section(pair, sections) for pair in range(head_dim // 2)} <= {"t", "h", "w"}


def test_other_families_are_refused_in_one_line_before_any_work(tmp_path, capsys):
    student = build_student(make_teacher("llama"), [0, 2])
    folder = export_student(student, None, tmp_path / "student")
    capsys.readouterr()  # the save's progress bars
    with pytest.raises(ExportRefused) as refused:
        export(folder, tmp_path / "g", "gguf")
    message = str(refused.value)
    assert "\n" not in message and "'llama'" in message and "QK-norm" in message
    assert "vLLM" in message and "transformers" in message
    with pytest.raises(SystemExit) as exited:
        export_main([str(folder), str(tmp_path / "g"), "--format", "gguf"])
    assert exited.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "g").exists()


def test_a_bad_outtype_or_an_outtype_for_another_format_is_one_line(qwen3, tmp_path, capsys):
    _, folder, _, _ = qwen3
    for argv, named in ((["--format", "gguf", "--outtype", "q3_k"], "--outtype 'q3_k'; expected one of f32, f16"),
                        (["--format", "tcal", "--outtype", "f16"], "--outtype is not an option of --format tcal")):
        with pytest.raises(SystemExit) as exited:
            export_main([str(folder), str(tmp_path / "out"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and named in err[0], err
    assert not (tmp_path / "out").exists()


def qwen_tokenizer():
    """A tiny byte-level BPE as the Qwen3 family's tokenizer class: 256 byte tokens, 3 merges, one special token."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for first, second in merges:
        vocab[first + second] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|endoftext|>", unk_token=None, bos_token=None,
                          pad_token="<|endoftext|>")


def test_a_qwen_tokenizer_is_written_whole_as_llama_cpp_s_gpt2_model(tmp_path):
    tokenizer = qwen_tokenizer()
    vocab_size = 272  # the model's rows beyond the tokenizer's 260 ids are padding
    student = build_student(make_teacher("qwen3", rms_norm_eps=EPS, head_dim=HEAD_DIM, vocab_size=vocab_size), [1, 3])
    folder = export_student(student, tokenizer, tmp_path / "student")
    record = export(folder, tmp_path / "g", "gguf", options={"outtype": "f32"})
    fields = reader(tmp_path / "g").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert len(tokens) == vocab_size and tokens[:eos + 1] == tokenizer.convert_ids_to_tokens(list(range(eos + 1)))
    assert types[eos] == 3 and types[0] == 1 and tokens[eos + 1] == f"[PAD{eos + 1}]" and types[eos + 1] == 5
    assert fields["tokenizer.ggml.merges"].contents() == ["Ġ t", "h e", "Ġt he"]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == eos
    assert record["gguf"]["tokenizer"] == {"model": "gpt2", "pre": "qwen2", "tokens": vocab_size, "merges": 3}
