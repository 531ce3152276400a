"""The vLLM side of `make bench ARGS="serve"` (benchmarks/serve.py runs it with .venv-serve's Python, one process per
model): prefill and decode speed of one model at each context length, one JSON line each.

    .venv-serve/bin/python benchmarks/serve_engine.py < request.json   # {"model", "contexts", "decode_tokens"}

One request per figure: `context` seeded random tokens (new to the engine: prefix caching off), generating
1 + `decode_tokens` tokens. The engine's own per-request timestamps split it: prefill = first token - scheduled,
decode = (last token - first token) / decode_tokens. Each figure is the fastest of `REPEATS` requests after a warm-up
(on a shared machine the least disturbed one).
"""

from __future__ import annotations

import json
import sys

REPEATS = 3


def timed(llm, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one request, from the engine's request timestamps."""
    from vllm import SamplingParams

    tokens = 1 + decode_tokens
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    stats = output.metrics
    if stats is None or not stats.first_token_ts:
        raise RuntimeError("vLLM returned no request timestamps (engine started with disable_log_stats?)")
    return stats.first_token_ts - stats.scheduled_ts, (stats.last_token_ts - stats.first_token_ts) / decode_tokens


def main() -> int:
    request = json.loads(sys.stdin.read())
    from tcal.serving.generate import engine

    contexts, decode = request["contexts"], request["decode_tokens"]
    llm = engine(request["model"], "bfloat16", max_model_len=max(contexts) + decode + 1,
                 enable_prefix_caching=False, disable_log_stats=False)
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompt(length: int) -> list[int]:
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    timed(llm, prompt(min(contexts)), 2)  # warm-up
    for context in contexts:
        runs = [timed(llm, prompt(context), decode) for _ in range(REPEATS)]
        print(json.dumps({"context": context, "prefill_s": min(r[0] for r in runs),
                          "decode_s_per_token": min(r[1] for r in runs)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
