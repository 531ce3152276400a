"""Greedy generation with vLLM on this machine, for checks: `python -m tcal.serving.generate < request.json`.

The request (one JSON object on stdin): {"model": folder, "prompts": [[token ids], ...], "tokens": n, "top_k": k,
"dtype": "bfloat16"}. The answer (one JSON line on stdout): each prompt's n greedy tokens (end-of-text ignored, so
every prompt runs as long), the k most likely token ids at each step, and which engine ran: the vLLM version, the
architecture vLLM resolved, the dtype and the GDN state's dtype. Run with vLLM's Python (`.venv-serve/bin/python`);
vLLM runs in this process (no engine subprocess, eager mode, one thread), the settings under which an engine starts
in seconds on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",  # else the first generate compiles for many seconds
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def engine(model: str, dtype: str = "bfloat16", max_model_len: int | None = None, **options):
    """An in-process vLLM engine for `model` (the environment above, set where the caller left it unset);
    `max_model_len` None: the model's own context; `options` go to `vllm.LLM`."""
    for key, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    has_tokenizer = (Path(model) / "tokenizer_config.json").is_file()  # prompts are token ids: none is needed
    return LLM(model=model, dtype=dtype, enforce_eager=True, distributed_executor_backend="uni",
               max_model_len=max_model_len, seed=0, skip_tokenizer_init=not has_tokenizer, **options)


def generate(llm, prompts: list[list[int]], tokens: int, top_k: int) -> tuple[list[list[int]], list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, logprobs=top_k)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    generated, ranked = [], []
    for output in outputs:
        completion = output.outputs[0]
        generated.append(list(completion.token_ids))
        ranked.append([[token for token, _ in sorted(step.items(), key=lambda item: -item[1].logprob)][:top_k]
                       for step in completion.logprobs])
    return generated, ranked


def main() -> int:
    request = json.loads(sys.stdin.read())
    dtype = request.get("dtype", "bfloat16")
    llm = engine(request["model"], dtype)
    tokens, top_k = generate(llm, request["prompts"], request["tokens"], request["top_k"])
    import vllm

    config = llm.llm_engine.vllm_config
    print(json.dumps({"tokens": tokens, "top_k": top_k,
                      "engine": {"vllm": vllm.__version__, "architecture": config.model_config.architecture,
                                 "dtype": dtype, "gdn_state_dtype": config.cache_config.mamba_ssm_cache_dtype}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
