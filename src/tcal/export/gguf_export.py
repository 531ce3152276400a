"""`--format gguf`: a Qwen3-family student as one GGUF file of llama.cpp's `qwen35` architecture (`model.gguf`).

The weights and layout are those of the `qwen3_5` export (`tcal.export.qwen3_5`: the student as stock
`Qwen3_5ForCausalLM`), taken to llama.cpp's conventions the way its own converter takes a Qwen3.5 checkpoint:
zero-centred RMSNorm weights get their 1 back (the GDN's gated norm is plain in both), `A_log` is stored as
A = -exp(A_log), `dt_bias` as `ssm_dt.bias`, the short conv as [channels, kernel]; tensor names come from the `gguf`
package's own name map. Which layer is which comes from the keep list, as `qwen35.attention.recurrent_layers` (true
for a converted GDN layer), so a non-periodic layout loads as selected: llama.cpp's loader reads that key first and
falls back to a fixed `full_attention_interval` without it. No interval is written, so a loader too old to read the
key fails on the first layer whose tensors it looks for under the other kind's names instead of loading mis-typed.

RoPE: `qwen35` always applies interleaved multi-section RoPE. Text positions are the same in its first three
sections, so it is plain RoPE over the whole head (the student's) once the sections cover head_dim/2 rotary pairs
with the interleave's count for each (`rope_sections`); the converter's default [11, 11, 10, 0] covers 32, which
aborts ggml for heads below 64 dims.

`--outtype` picks the type of every 2-D weight (`OUTTYPES`); norms, the conv, A and dt stay float32 (as llama.cpp's
converter keeps them), and a weight whose rows do not split into the type's blocks is written f16 (counted in the
record). The parity check reads the file back with the `gguf` package, undoes the conventions and runs the result as
`Qwen3_5ForCausalLM` in transformers: for f32 against the student itself (tcal's float32 rule), for a rounded type
against the `qwen3_5` export with each weight rounded to that type in memory (the map must be exact), the rounding's
own cost on the student's logits reported beside it. With an interpreter that has llama-cpp-python
(`--serve-python`), llama.cpp itself loads the file (`tcal.export.llama_cpp_run`) and its prefill and token-by-token
decode logits are compared with transformers on the `qwen3_5` export (`llama_cpp_check`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from tcal.export.formats import ExportFormat
from tcal.export.parity import GREEDY_TOKENS, Parity, compare
from tcal.export.qwen3_5 import (
    QWEN3,
    check_qwen3_student,
    qwen3_5_config,
    qwen3_5_from_state,
    qwen3_5_model,
    qwen3_5_state_dict,
    torch_reference_kernels,
)
from tcal.export.refusal import ExportRefused, ParityFailed

log = logging.getLogger(__name__)

ARCH = "qwen35"
GGUF_FILE = "model.gguf"
RECURRENT_LAYERS_KEY = f"{ARCH}.attention.recurrent_layers"  # llama.cpp's key; gguf 0.19.0 has no constant for it
DEFAULT_OUTTYPE = "f16"  # llama.cpp's converter's default
LLAMA_CPP_TOLERANCE = 5e-3  # largest f32 |logit difference| between llama.cpp and transformers (prefill and decode)
LLAMA_CPP_RUNNER = Path(__file__).with_name("llama_cpp_run.py")  # run by the llama-cpp-python interpreter
LINEAR = "linear_attention"


def outtypes() -> dict:
    """--outtype name -> (the 2-D weights' `GGMLQuantizationType`, the file's `LlamaFileType`): the types the `gguf`
    package writes in numpy alone (Q4_0 is its only 4-bit type that quantizes without native code)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import LlamaFileType as F

    return {"f32": (Q.F32, F.ALL_F32), "f16": (Q.F16, F.MOSTLY_F16), "bf16": (Q.BF16, F.MOSTLY_BF16),
            "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0), "q4_0": (Q.Q4_0, F.MOSTLY_Q4_0)}


def check_gguf_student(config) -> None:
    """Refuse, in one line naming why and what serves it, a student `qwen35` cannot hold."""
    family = config.teacher_config.model_type
    if family != QWEN3:
        raise ExportRefused(f"--format gguf holds Qwen3-family students only; this student's teacher is {family!r}: "
                            f"llama.cpp's hybrid architecture (qwen35) always applies QK-norm, which {family!r} "
                            f"attention has not; serve it with vLLM (--format vllm) or transformers (--format hf)")
    check_qwen3_student(config)


def rope_sections(rotary_dims: int) -> list[int]:
    """[t, h, w, e] sections of `qwen35`'s interleaved RoPE covering `rotary_dims` / 2 rotary pairs: pair i takes
    section i mod 3, so each of the first three holds the count of its residue (none left to `e`, the position-0
    section)."""
    pairs = rotary_dims // 2
    return [len(range(r, pairs, 3)) for r in range(3)] + [0]


def gguf_name_map(layers: int):
    """The `gguf` package's map from Hugging Face tensor names to `qwen35`'s."""
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, layers)


def gguf_name(name_map, hf_name: str) -> str:
    """`qwen35`'s name of the Qwen3.5 tensor `hf_name` (`dt_bias` is read as the bias of `dt_proj`)."""
    if hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    found = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise RuntimeError(f"the gguf package maps no qwen35 tensor to {hf_name!r}")
    return found


def is_centred_norm(hf_name: str) -> bool:
    """Qwen3.5's zero-centred RMSNorms (llama.cpp stores them with their 1 added); the GDN's gated norm is plain."""
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def to_llama_cpp(hf_name: str, tensor: torch.Tensor) -> np.ndarray:
    """One Qwen3.5 tensor in llama.cpp's convention (module doc), float32."""
    data = tensor.detach().float()
    if hf_name.endswith(".A_log"):
        data = -torch.exp(data)
    elif hf_name.endswith(".conv1d.weight"):
        data = data[:, 0, :]
    elif is_centred_norm(hf_name):
        data = data + 1.0
    return data.contiguous().numpy()


def from_llama_cpp(hf_name: str, data: np.ndarray) -> torch.Tensor:
    """`to_llama_cpp` undone."""
    tensor = torch.from_numpy(np.array(data, dtype=np.float32))
    if hf_name.endswith(".A_log"):
        return torch.log(-tensor)
    if hf_name.endswith(".conv1d.weight"):
        return tensor[:, None, :]
    if is_centred_norm(hf_name):
        return tensor - 1.0
    return tensor


def stays_f32(gguf_tensor_name: str, data: np.ndarray) -> bool:
    """Kept float32 whatever the outtype: 1-D tensors, norms, the short conv, and what is not a `.weight` (A, dt)."""
    return (data.ndim <= 1 or gguf_tensor_name.endswith("_norm.weight") or ".ssm_conv1d." in gguf_tensor_name
            or not gguf_tensor_name.endswith(".weight"))


def tensor_type(gguf_tensor_name: str, data: np.ndarray, qtype):
    """The type one tensor is written in: float32 (`stays_f32`), the outtype, or f16 where rows do not split into
    the outtype's blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if stays_f32(gguf_tensor_name, data):
        return GGMLQuantizationType.F32
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if data.shape[-1] % block == 0 else GGMLQuantizationType.F16


def rounded(data: np.ndarray, qtype) -> np.ndarray:
    """`data` after a trip through `qtype` (what llama.cpp reads back), float32."""
    from gguf import quants

    return quants.dequantize(quants.quantize(data, qtype), qtype).reshape(data.shape).astype(np.float32)


def write_tensors(writer, tensors, qtype) -> dict[str, int]:
    """Write each (llama.cpp name, float32 array) of `tensors` in its `tensor_type`, then the whole file; returns how
    many tensors each type holds."""
    import gguf

    types: dict[str, int] = {}
    for name, data in tensors:
        kind = tensor_type(name, data, qtype)
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        types[kind.name] = types.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def write_tokenizer(writer, tokenizer, vocab_size: int) -> dict:
    """The tokenizer keys; what was written, for the record. A student saved without a tokenizer gets llama.cpp's
    "none" vocabulary of `vocab_size` placeholder tokens (callers pass token ids). A Qwen tokenizer (the Qwen3
    family's own, byte-level BPE) is written whole as llama.cpp's "gpt2" model with its "qwen2" pre-tokenizer."""
    import gguf

    if tokenizer is None:
        writer.add_tokenizer_model("none")
        writer.add_vocab_size(vocab_size)
        return {"model": "none", "why": "the student was saved without a tokenizer", "vocab_size": vocab_size}
    kind = type(tokenizer).__name__
    if not kind.startswith("Qwen2Tokenizer"):
        raise ExportRefused(f"--format gguf writes the Qwen3 family's tokenizer (Qwen2Tokenizer); this student's is "
                            f"{kind}, whose llama.cpp pre-tokenizer tcal cannot name")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(Path(folder), load_merges=True, n_vocab=vocab_size)
        special.add_to_gguf(writer)
    return {"model": "gpt2", "pre": "qwen2", "tokens": len(tokens), "merges": len(special.merges)}


def write_gguf(student, tokenizer, path: Path, outtype: str) -> dict:
    """Write the student as `qwen35` GGUF at `path`; returns what was written (types, layers, tokenizer)."""
    import gguf

    config = student.config
    exported = qwen3_5_config(config)
    qtype, file_type = outtypes()[outtype]
    layers = exported.num_hidden_layers
    head_dim = exported.head_dim
    recurrent = [kind == LINEAR for kind in exported.layer_types]
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_name(getattr(config, "name_or_path", "") or "tcal student")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(layers)
    writer.add_context_length(exported.max_position_embeddings)
    writer.add_embedding_length(exported.hidden_size)
    writer.add_feed_forward_length(exported.intermediate_size)
    writer.add_head_count(exported.num_attention_heads)
    writer.add_head_count_kv(exported.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(exported.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_dimension_sections(rope_sections(head_dim))
    writer.add_layer_norm_rms_eps(float(exported.rms_norm_eps))
    writer.add_ssm_conv_kernel(exported.linear_conv_kernel_dim)
    writer.add_ssm_state_size(exported.linear_key_head_dim)
    writer.add_ssm_group_count(exported.linear_num_key_heads)
    writer.add_ssm_time_step_rank(exported.linear_num_value_heads)
    writer.add_ssm_inner_size(exported.linear_value_head_dim * exported.linear_num_value_heads)
    writer.add_array(RECURRENT_LAYERS_KEY, recurrent)
    tokenizer_record = write_tokenizer(writer, tokenizer, exported.vocab_size)
    name_map = gguf_name_map(layers)
    types = write_tensors(writer, ((gguf_name(name_map, hf_name), to_llama_cpp(hf_name, tensor))
                                   for hf_name, tensor in qwen3_5_state_dict(student).items()), qtype)
    return {"file": path.name, "architecture": ARCH, "outtype": outtype, "tensor_types": types,
            "recurrent_layers": [i for i, flag in enumerate(recurrent) if flag],
            "attention_layers": [i for i, flag in enumerate(recurrent) if not flag],
            "rope_sections": rope_sections(head_dim), "tokenizer": tokenizer_record}


def read_gguf(path: Path, config) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the file's `qwen35` keys, its tensors as Qwen3.5's state dict in float32) read back with the `gguf` package:
    what transformers can run of what was written."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    exported = qwen3_5_config(config)
    name_map = gguf_name_map(exported.num_hidden_layers)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    state: dict[str, torch.Tensor] = {}
    for hf_name, like in qwen3_5_state_dict_shapes(config).items():
        name = gguf_name(name_map, hf_name)
        if name not in tensors:
            raise ParityFailed(f"--format gguf: {path.name} lacks {name}, the tensor of {hf_name}")
        tensor = tensors.pop(name)
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        state[hf_name] = from_llama_cpp(hf_name, np.asarray(data).reshape(llama_cpp_shape(hf_name, like)))
    if tensors:
        raise RuntimeError(f"{path.name} holds tensors the Qwen3.5 map does not: {sorted(tensors)[:5]}")
    return keys, state


def llama_cpp_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[2]) if hf_name.endswith(".conv1d.weight") else shape


def qwen3_5_state_dict_shapes(config) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's tensor names and shapes for `config` (a `HybridConfig`), from a model built on the meta device."""
    from transformers import Qwen3_5ForCausalLM

    exported = qwen3_5_config(config)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(exported)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if exported.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def rounded_reference(student, outtype: str):
    """The `qwen3_5` export with every weight rounded as `outtype` writes it (what the file should hold)."""
    from gguf import GGMLQuantizationType

    qtype = outtypes()[outtype][0]
    name_map = gguf_name_map(student.config.num_hidden_layers)
    state = {}
    for hf_name, tensor in qwen3_5_state_dict(student).items():
        data = to_llama_cpp(hf_name, tensor)
        kind = tensor_type(gguf_name(name_map, hf_name), data, qtype)
        state[hf_name] = from_llama_cpp(hf_name, data if kind == GGMLQuantizationType.F32 else rounded(data, kind))
    return qwen3_5_from_state(qwen3_5_config(student.config), state)


class GgufFormat(ExportFormat):
    """`--format gguf [--outtype f32|f16|bf16|q8_0|q4_0]`: a Qwen3-family student as llama.cpp's `qwen35` (module
    doc); the record's `gguf` entry says what was written and what the parity check compared."""

    options = ("outtype",)

    def __init__(self, outtype: str = DEFAULT_OUTTYPE):
        self.outtype = outtype

    def configured(self, outtype: str = DEFAULT_OUTTYPE):
        """A format of its own for each export (`write` keeps what it wrote for `check_written`)."""
        if outtype not in outtypes():
            raise ExportRefused(f"--outtype {outtype!r}; expected one of {', '.join(outtypes())}")
        return GgufFormat(outtype)

    def check(self, config) -> None:
        check_gguf_student(config)

    def write(self, student, tokenizer, folder: Path) -> None:
        self.written = write_gguf(student, tokenizer, folder / GGUF_FILE, self.outtype)

    def check_written(self, student, folder: Path, prompts: list[list[int]], tolerance: float) -> tuple[Parity, dict]:
        keys, state = read_gguf(folder / GGUF_FILE, student.config)
        recurrent = [i for i, flag in enumerate(keys[RECURRENT_LAYERS_KEY]) if flag]
        converted = [i for i, kind in enumerate(student.config.layer_types) if kind == LINEAR]
        if keys["general.architecture"] != ARCH or recurrent != converted:
            raise ParityFailed(f"--format gguf wrote architecture {keys['general.architecture']!r} with recurrent "
                               f"layers {recurrent}; expected {ARCH!r} with the converted layers {converted}")
        from_file = qwen3_5_from_state(qwen3_5_config(student.config), state)
        entry = dict(self.written)
        with torch_reference_kernels():
            if self.outtype == "f32":
                parity = compare(student, from_file, prompts, tolerance)
                entry["compared"] = ("the file read back (gguf package) and run as Qwen3_5ForCausalLM in transformers, "
                                     "against the student")
            else:
                parity = compare(rounded_reference(student, self.outtype), from_file, prompts, tolerance)
                cost = compare(student, from_file, prompts, float("inf"))
                entry["compared"] = (f"the file read back (gguf package) and run as Qwen3_5ForCausalLM in "
                                     f"transformers, against the qwen3_5 export with its weights rounded to "
                                     f"{self.outtype} in memory; outtype_cost: the same file against the student")
                entry["outtype_cost"] = {"max_abs_logit_diff": cost.max_abs_logit_diff,
                                         "greedy_identical": cost.greedy_identical, "prompts": cost.prompts,
                                         "greedy_tokens": cost.greedy_tokens}
        return parity, {"gguf": entry}

    def carry(self, source: Path, folder: Path) -> dict:
        """Nothing: llama.cpp reads the one file, whose `tokenizer.*` keys hold the tokenizer and chat template."""
        return {"carried": [], "dropped": [], "why": f"llama.cpp reads {GGUF_FILE} alone (tokenizer.* keys)"}

    def loads(self, folder: Path, source: Path, tokenizer) -> dict:
        """llama.cpp loads the file itself (`after_parity`, with an interpreter that has it): no transformers loader
        reads DEST."""
        return {"checked": [], "why": f"{GGUF_FILE} is loaded by llama.cpp, not by transformers' loaders"}

    def after_parity(self, student, folder: Path, prompts: list[list[int]], serve_python: Path | None) -> dict:
        """`llama_cpp_check`: llama.cpp's own prefill and decode logits against transformers (module doc), when an
        interpreter with llama-cpp-python is given; for f32 they must agree within `LLAMA_CPP_TOLERANCE` with equal
        greedy tokens."""
        if serve_python is None:
            log.info("llama.cpp check skipped: no interpreter with llama-cpp-python given (--serve-python)")
            return {"llama_cpp_check": {"checked": False,
                                        "why": "no interpreter with llama-cpp-python given (--serve-python)"}}
        check = llama_cpp_check(folder / GGUF_FILE, student, prompts, Path(serve_python))
        log.info("llama.cpp check (%s): %s", self.outtype, check["summary"])
        if self.outtype == "f32" and not check["passed"]:
            raise ParityFailed(f"--format gguf: llama.cpp does not reproduce transformers ({check['summary']})")
        return {"llama_cpp_check": {"checked": True, "gated": self.outtype == "f32", **check}}


def run_llama_cpp(path: Path, prompts: list[list[int]], tokens: int, python: Path, threads: int = 1) -> dict:
    """llama.cpp (llama-cpp-python under `python`) on `prompts`: per prompt its prefill logits, then `tokens` greedy
    tokens decoded one at a time with the logits after each; and which layers hold KV cache / recurrent state."""
    with tempfile.TemporaryDirectory() as scratch:
        request = {"model": str(path), "prompts": prompts, "tokens": tokens, "threads": threads,
                   "out": str(Path(scratch) / "logits.npz")}
        done = subprocess.run([str(python), str(LLAMA_CPP_RUNNER)], input=json.dumps(request), capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
            raise ParityFailed(f"llama.cpp ({python}) could not run {path.name}: {tail[0]}")
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        with np.load(request["out"]) as arrays:
            answer["prefill"] = [arrays[f"prefill_{p}"] for p in range(len(prompts))]
            answer["decode"] = [arrays[f"decode_{p}"] for p in range(len(prompts))]
    return answer


@torch.no_grad()
def transformers_logits(model, prompt: list[int], continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([len(prompt), vocab] prefill logits, [len(continuation), vocab] logits after each continuation token fed one
    at a time through the model's cache), float32."""
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, steps = out.past_key_values, []
    for token in continuation:
        step = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = step.past_key_values
        steps.append(step.logits[0, -1].float())
    return out.logits[0].float(), torch.stack(steps)


def llama_cpp_check(path: Path, student, prompts: list[list[int]], python: Path) -> dict:
    """llama.cpp's logits on `prompts` (prefill, then its own greedy tokens decoded one at a time) against transformers
    running the `qwen3_5` export of the student on the same tokens; greedy agreement counted per step."""
    answer = run_llama_cpp(path, prompts, GREEDY_TOKENS, python)
    reference = qwen3_5_model(student)
    worst_prefill = worst_decode = 0.0
    agreed = steps = identical = 0
    with torch_reference_kernels():
        for prompt, prefill, decode, tokens in zip(prompts, answer["prefill"], answer["decode"], answer["tokens"]):
            want_prefill, want_decode = transformers_logits(reference, prompt, tokens)
            worst_prefill = max(worst_prefill, (want_prefill - torch.from_numpy(prefill)).abs().max().item())
            worst_decode = max(worst_decode, (want_decode - torch.from_numpy(decode)).abs().max().item())
            expected = [want_prefill[-1].argmax().item(), *want_decode[:-1].argmax(dim=-1).tolist()]
            same = [a == b for a, b in zip(expected, tokens)]
            agreed += sum(same)
            steps += len(same)
            identical += all(same)
    worst = max(worst_prefill, worst_decode)
    passed = worst <= LLAMA_CPP_TOLERANCE and identical == len(prompts)
    summary = (f"max |logit diff| prefill {worst_prefill:.3g}, decode {worst_decode:.3g} (f32 tolerance "
               f"{LLAMA_CPP_TOLERANCE:g}), greedy {agreed}/{steps} steps agree, {identical}/{len(prompts)} prompts "
               f"identical over {GREEDY_TOKENS} tokens")
    return {"compared": "llama.cpp (llama-cpp-python) prefill and token-by-token decode logits against transformers' "
                        "Qwen3_5ForCausalLM (the qwen3_5 export, float32) on llama.cpp's greedy tokens",
            "max_abs_logit_diff_prefill": worst_prefill, "max_abs_logit_diff_decode": worst_decode,
            "greedy_steps_agreeing": agreed, "greedy_steps": steps, "greedy_identical": identical,
            "prompts": len(prompts), "tolerance": LLAMA_CPP_TOLERANCE, "passed": passed,
            "kv_layers": answer["kv_layers"], "recurrent_layers": answer["recurrent_layers"],
            "extra_buffer_types": answer["extra_buffer_types"],
            "llama_cpp_python": answer["version"], "summary": summary}


GGUF = GgufFormat()
