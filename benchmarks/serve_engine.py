"""The vLLM side of `make bench ARGS="serve"` (benchmarks/serve.py runs it with .venv-serve's Python, one process per
model): prefill and decode speed of one model at each context length, one JSON line each.

    .venv-serve/bin/python benchmarks/serve_engine.py < request.json   # {"model", "contexts", "decode_tokens"}

Prefill: one request of `context` seeded random tokens generating one token (wall and process CPU seconds).
Decode: the same prompt generating 1 + `decode_tokens` tokens; the extra time over the prefill run, per extra token.
Each prompt is new to the engine (prefix caching off), each figure the faster of two runs after a warm-up.
"""

from __future__ import annotations

import json
import sys
import time

REPEATS = 2


def timed(llm, prompt: list[int], tokens: int) -> tuple[float, float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def best(llm, prompt, tokens) -> tuple[float, float]:
    runs = [timed(llm, prompt, tokens) for _ in range(REPEATS)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> int:
    request = json.loads(sys.stdin.read())
    from tcal.serving.generate import engine

    contexts, decode = request["contexts"], request["decode_tokens"]
    llm = engine(request["model"], "bfloat16", max_model_len=max(contexts) + decode + 1,
                 enable_prefix_caching=False)
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    timed(llm, torch.randint(0, vocab, (min(contexts),), generator=generator).tolist(), 2)  # warm-up
    for context in contexts:
        prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
        prefill_wall, prefill_cpu = best(llm, prompt, 1)
        full_wall, full_cpu = best(llm, prompt, 1 + decode)
        print(json.dumps({"context": context, "prefill_wall_s": prefill_wall, "prefill_cpu_s": prefill_cpu,
                          "decode_wall_s_per_token": (full_wall - prefill_wall) / decode,
                          "decode_cpu_s_per_token": (full_cpu - prefill_cpu) / decode}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
