"""llama.cpp on a GGUF file, run as a script by an interpreter that has llama-cpp-python (and numpy) but not tcal.

    python llama_cpp_run.py < request.json

Request: {"model": path, "prompts": [[ids]], "tokens": n, "threads": k, "out": path.npz}. For each prompt, a fresh
context evaluates the prompt in one batch (every position's logits: `prefill_<p>`), then decodes `tokens` greedy tokens
one at a time, each step's logits after feeding the token (`decode_<p>`). Printed, one JSON line: the greedy tokens,
llama-cpp-python's version, and the layers llama.cpp gave KV cache and recurrent state (from its own load log).

llama.cpp's extra buffer types (weight repacking: AMX, the CPU's repacked quant layouts) are off
(`without_extra_buffer_types`): this repository's CPU machines advertise AMX, and ggml's AMX buffer type dies there
of SIGILL on q8_0 and q4_0 weights; off, every type runs ggml's plain CPU kernels. benchmarks/gguf_engine.py runs
both its models the same way.
"""

import ctypes
import json
import re
import sys

import numpy as np

import llama_cpp
from llama_cpp import Llama

LOG: list[str] = []


@llama_cpp.llama_log_callback
def keep_log(level, text, user_data):
    LOG.append(text.decode("utf-8", errors="replace"))


def without_extra_buffer_types() -> None:
    """Every model loaded after this call has llama.cpp's `use_extra_bufts` off (module doc). `Llama` takes its model
    parameters from `llama_model_default_params` and has no argument for this one."""
    import llama_cpp.llama_cpp as api

    default = api.llama_model_default_params

    def params():
        chosen = default()
        chosen.use_extra_bufts = False
        return chosen

    api.llama_model_default_params = params


def memory_layers(log: str) -> tuple[list[int], list[int]]:
    """(layers with KV cache, layers with recurrent state) from llama.cpp's per-layer debug lines."""
    kv = [int(n) for n in re.findall(r"llama_kv_cache: layer +(\d+): dev = ", log)]
    recurrent = [int(n) for n in re.findall(r"llama_memory_recurrent, layer +(\d+): dev = ", log)]
    return sorted(set(kv)), sorted(set(recurrent))


def main() -> None:
    request = json.loads(sys.stdin.read())
    llama_cpp.llama_log_set(keep_log, ctypes.c_void_p(0))
    without_extra_buffer_types()
    prompts, steps = request["prompts"], request["tokens"]
    n_ctx = max(len(prompt) for prompt in prompts) + steps + 8
    llm = Llama(model_path=request["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=request["threads"], n_threads_batch=request["threads"], seed=0, verbose=False)
    arrays, tokens = {}, []
    for p, prompt in enumerate(prompts):
        llm.reset()
        llm.eval(prompt)
        arrays[f"prefill_{p}"] = np.array(llm.scores[: len(prompt)], dtype=np.float32)
        generated, decoded = [], []
        for _ in range(steps):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(token)
            llm.eval([token])
            decoded.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        arrays[f"decode_{p}"] = np.stack(decoded)
        tokens.append(generated)
    np.savez(request["out"], **arrays)
    kv, recurrent = memory_layers("".join(LOG))
    print(json.dumps({"tokens": tokens, "version": llama_cpp.__version__, "kv_layers": kv,
                      "recurrent_layers": recurrent, "extra_buffer_types": False}))


if __name__ == "__main__":
    main()
