"""`make bench ARGS="gguf"`: the hybrid's decode speed on this CPU in llama.cpp. A Qwen3 teacher of SmolLM2-135M's shape
(30 layers, 9 query / 3 KV heads, head_dim 64, random weights: the shape sets the cost) and its student keeping
attention at 0, 4, ..., 28 (ratio 0.25), both GGUF in the same outtype, run by llama-cpp-python with the same threads
(benchmarks/gguf_engine.py, in .venv-gguf). The student is written by `--format gguf`'s writer (`qwen35`); the
teacher as llama.cpp's own `qwen3` architecture (`write_qwen3_gguf`). One JSON line per context: prefill and decode
tokens/s of both, the student/teacher decode ratio (above 1: the student is faster), and the memory each holds for
that context (KV cache, recurrent state). Wall time: on a shared machine, waits count; ggml's OpenMP threads wait
passively (`engine_environment`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from measurement import emit

GGUF_CONTEXTS = (4096, 16384, 32768)
GGUF_DECODE_TOKENS = 32
GGUF_THREADS = 2
GGUF_BATCH = 512
GGUF_OUTTYPE = "f16"
GGUF_PYTHON = Path(".venv-gguf") / "bin" / "python"
ENGINE_SCRIPT = Path(__file__).parent / "gguf_engine.py"
# SmolLM2-135M's shape as a Qwen3 (the reference pair's); positions to hold the longest context
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                     max_position_embeddings=40960, rms_norm_eps=1e-5)


def smollm2_shaped_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    import torch

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**SMOLLM2_SHAPE)).eval()


def write_qwen3_gguf(teacher, path: Path, outtype: str) -> dict:
    """The teacher as llama.cpp's `qwen3` architecture: its tensors as they are (Qwen3's norms are plain), named by
    the `gguf` package's map, typed as `--format gguf` types the student's (`tcal.export.gguf_export.write_tensors`)."""
    import gguf

    from tcal.export.gguf_export import outtypes, write_tensors

    config = teacher.config
    qtype, file_type = outtypes()[outtype]
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("random Qwen3 teacher")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    state = {name: tensor for name, tensor in teacher.state_dict().items() if name != "lm_head.weight"}
    types = write_tensors(writer, ((names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
                                   for name, tensor in state.items()), qtype)
    return {"architecture": "qwen3", "tensor_types": types}


def engine_environment(threads: int) -> dict[str, str]:
    """ggml's OpenMP threads, waiting passively: on a machine shared with other jobs, OpenMP's default spinning at
    each barrier lets a 2-thread llama.cpp wait on a descheduled thread (measured here: 11x slower prefill and 5x
    slower decode at 256 tokens than PASSIVE, 2026-12-05). The same for both models."""
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def engine_figures(model: Path, contexts, decode_tokens: int, threads: int) -> dict[int, dict]:
    request = json.dumps({"model": str(model), "contexts": list(contexts), "decode_tokens": decode_tokens,
                          "threads": threads, "batch": GGUF_BATCH})
    done = subprocess.run([str(GGUF_PYTHON), str(ENGINE_SCRIPT)], input=request, capture_output=True, text=True,
                          check=False, env={**os.environ, **engine_environment(threads)})
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp benchmark of {model} failed: {done.stderr.strip().splitlines()[-1:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"context"')]
    return {line["context"]: line for line in lines}


def bench_gguf(out: Path, contexts=GGUF_CONTEXTS, decode_tokens: int = GGUF_DECODE_TOKENS,
               threads: int = GGUF_THREADS, outtype: str = GGUF_OUTTYPE) -> list[dict]:
    """Both models written once into `out`, then each context measured in its own engine process, teacher then
    student, so a long run prints the short contexts first."""
    if not GGUF_PYTHON.is_file():
        raise FileNotFoundError(f"{GGUF_PYTHON} missing: `make gguf-check` builds llama-cpp-python's venv")
    from tcal.export.gguf_export import write_gguf
    from tcal.student.convert import build_student

    out.mkdir(parents=True, exist_ok=True)
    teacher = smollm2_shaped_qwen3()
    keep = list(range(0, teacher.config.num_hidden_layers, 4))
    files = {"teacher": out / f"teacher-{outtype}.gguf", "student": out / f"student-{outtype}.gguf"}
    write_qwen3_gguf(teacher, files["teacher"], outtype)
    write_gguf(build_student(teacher, keep), None, files["student"], outtype)
    lines = []
    for context in contexts:
        t, s = (engine_figures(files[role], [context], decode_tokens, threads)[context]
                for role in ("teacher", "student"))
        lines.append(emit(
            f"gguf_llama_cpp_T{context}", engine=f"llama-cpp-python {t['llama_cpp_python']}", outtype=outtype,
            threads=threads, keep=keep, decode_tokens=decode_tokens,
            teacher_prefill_s=t["prefill_s"], student_prefill_s=s["prefill_s"],
            teacher_decode_tok_s=1 / t["decode_s_per_token"], student_decode_tok_s=1 / s["decode_s_per_token"],
            decode_ratio=t["decode_s_per_token"] / s["decode_s_per_token"],
            teacher_kv_mib=t["kv_mib"], student_kv_mib=s["kv_mib"], student_recurrent_mib=s["recurrent_mib"],
            kv_ratio=s["kv_mib"] / t["kv_mib"] if t["kv_mib"] else None))
    return lines
