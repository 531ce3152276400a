"""One model's llama.cpp figures, run by the interpreter that has llama-cpp-python (benchmarks/gguf_decode.py starts
it): for each context, a fresh context of that many cells evaluates seeded random prompt tokens in batches
(prefill), then decodes `decode_tokens` seeded random tokens one at a time; the decode figure is the median seconds per
token. Memory: the sizes llama.cpp's own load log gives its KV cache and its recurrent state for that context.

Request on stdin: {"model", "contexts", "decode_tokens", "threads", "batch"}; one JSON line per context on stdout.
llama.cpp's extra buffer types are off for both models, as in tcal's own check (tcal/export/llama_cpp_run.py says
why), whose log hook this script shares.
"""

import ctypes
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src" / "tcal" / "export"))
from llama_cpp_run import LOG, keep_log, without_extra_buffer_types  # noqa: E402  (a script beside tcal, not tcal)


def mib(pattern: str, log: str) -> float:
    found = re.findall(pattern, log)
    return float(found[-1]) if found else 0.0


def main() -> None:
    request = json.loads(sys.stdin.read())
    llama_cpp.llama_log_set(keep_log, ctypes.c_void_p(0))
    without_extra_buffer_types()
    generator = np.random.default_rng(0)
    for context in request["contexts"]:
        LOG.clear()
        llm = Llama(model_path=request["model"], n_ctx=context + request["decode_tokens"] + 8,
                    n_batch=request["batch"], n_ubatch=request["batch"], n_threads=request["threads"],
                    n_threads_batch=request["threads"], logits_all=False, seed=0, verbose=False)
        vocab = llm.n_vocab()
        prompt = generator.integers(0, vocab, context).tolist()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start
        steps = []
        for token in generator.integers(0, vocab, request["decode_tokens"]).tolist():
            start = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - start)
        log = "".join(LOG)
        print(json.dumps({"context": context, "prefill_s": prefill_s, "decode_s_per_token": statistics.median(steps),
                          "kv_mib": mib(r"llama_kv_cache: size = +([\d.]+) MiB", log),
                          "recurrent_mib": mib(r"llama_memory_recurrent: size = +([\d.]+) MiB", log),
                          "llama_cpp_python": llama_cpp.__version__}), flush=True)
        llm.close()


if __name__ == "__main__":
    main()
