"""`make bench ARGS="[group ...] [-o hydra.override ...]"`: speed and memory figures, one JSON line each.

    make bench ARGS="longctx --contexts 1024,4096"   # or: .venv/bin/python benchmarks/bench.py longctx ...

Groups: `gdn` (GDN CPU path against fla's naive recurrent reference), `kl_memory` (the fused KL's extra peak
memory on a 151,936-token head, in chunks of logits), `student` (student against teacher
at 50% retention: forward, forward+backward, cache bytes, decode time), `stats` (peak memory of the
streaming statistics at T=4096 against a plain forward), `phase2` (Phase 2 step against one GDN
forward+backward), `init` (wall time and peak memory of the `phase2`, `full` and `full_plus` inits, uncached: Phase 2
one layer after another (`calibration.fit=sequential`: stacks of one) and batched, the ratio of the two, and each mode's
ratios to `full`), `stage1` / `stage2` (a training step against its parts measured apart, and the
process's peak RSS), `stage2_plain` (the same step with full-batch logits and an unchunked KL, for the memory
comparison), `host_memory` (peak host RSS of building the Qwen2.5-1.5B-architecture student in bfloat16, and of
hashing it, against its bfloat16 weight bytes; `host_memory_replaced`: the same for the construction it replaced),
`plan` (`tcal-plan`'s Stage 2 peak against the peak RSS of the same short Stage 2, each measured in a fresh process;
`-o stage.checkpoint_mixers=false` etc. choose the checkpointing), `plan_activations` (the plan's Stage 2 activation
model against a measured forward and backward of a 4-layer slice at Qwen2.5-1.5B's width, per checkpointing setting,
in float32 and under bf16 autocast), and, only when named, `longctx` (the naive uniform students at `--ratios`
against the teacher at `--contexts` tokens: prefill, decode per token at `--batches`, cache bytes and peak RSS;
minutes to hours on a CPU), `serve` (only when named: vLLM prefill and decode tokens/s of the SmolLM2 student
against its teacher on CPU, benchmarks/serve.py; needs `make serve-check`'s .venv-serve), and `ruler` (only when
named: a `recall_table` cell of RULER, `--ruler-lengths` x `--ruler-tasks` with `--ruler-n` examples each, on the
SmolLM2 student at 50% (naive init) over the run's evaluation documents, generated one by one and in batches of
`--ruler-batch-size` in the same process, benchmarks/ruler_cost.py; the full cell at n = 50 takes an hour or more
on one CPU thread), and `gguf` (only when named: llama.cpp decode tokens/s after `--gguf-contexts` prompt tokens and
the memory held, a random Qwen3 of SmolLM2-135M's shape against its student at 0.25, both GGUF,
benchmarks/gguf_decode.py; needs `make gguf-check`'s .venv-gguf; 32k-token prefills take many minutes).
Ratios, not timed tests. Peak RSS is per process: run `stage2` and `stage2_plain` each in its own
invocation (`longctx` starts a process per model and context itself).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from functools import partial

import torch
import torch.nn.functional as F
from gguf_decode import GGUF_CONTEXTS, GGUF_OUTTYPE, GGUF_THREADS, bench_gguf
from host_memory import bench_host_memory
from init_cost import bench_init_modes, bench_phase2_step, bench_stats
from longctx import (
    LONG_CONTEXT_BATCHES,
    LONG_CONTEXT_DECODE_TOKENS,
    LONG_CONTEXT_RATIOS,
    LONG_CONTEXTS,
    bench_longctx,
    bench_student,
)
from measurement import best_time, emit
from plan_activations import bench_plan_activations
from ruler_cost import RULER_LENGTHS, RULER_N, RULER_TASKS, bench_ruler
from training_steps import bench_kl_memory, bench_plan, bench_stage1, bench_stage2

from tcal.arguments import number, numbers, one_of
from tcal.settings.evaluation import RULER_TASKS as KNOWN_RULER_TASKS
from tcal.student.gdn_torch import chunk_gated_delta_rule_torch


def rule_inputs(T: int, heads: int = 9, dim: int = 64, batch: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, T, heads, dim, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(batch, T, heads, dim, generator=gen).requires_grad_()
    g = (-torch.rand(batch, T, heads, generator=gen) * 0.1).requires_grad_()
    beta = torch.rand(batch, T, heads, generator=gen).requires_grad_()
    return q, k, v, g, beta


def fwd_bwd(rule, inputs):
    def step():
        o, _ = rule(*inputs)
        o.sum().backward()
    return step


def bench_gdn(lengths=(512, 2048)) -> list[dict]:
    """fwd+bwd of the CPU delta-rule path against fla's naive recurrent (and naive chunk) references."""
    from fla.ops.gated_delta_rule.naive import (
        naive_chunk_gated_delta_rule,
        naive_recurrent_gated_delta_rule,
    )

    lines = []
    for T in lengths:
        q, k, v, g, beta = rule_inputs(T)
        ours = best_time(fwd_bwd(chunk_gated_delta_rule_torch, (q, k, v, g, beta)))
        recurrent = best_time(fwd_bwd(naive_recurrent_gated_delta_rule, (q, k, v, beta, g)), repeats=1, warmup=False)
        fla_chunk = best_time(fwd_bwd(naive_chunk_gated_delta_rule, (q, k, v, g, beta)))
        lines.append(emit(f"gdn_fwd_bwd_T{T}", shape=f"B=1,H=9,d=64,T={T}", torch_chunk_s=ours,
                          fla_naive_recurrent_s=recurrent, fla_naive_chunk_s=fla_chunk,
                          speedup_vs_recurrent=recurrent / ours, speedup_vs_fla_naive_chunk=fla_chunk / ours,
                          target="speedup_vs_recurrent >= 5 at T=2048"))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = ["gdn", "kl_memory", "host_memory", "host_memory_replaced", "student", "stats", "phase2", "init",
              "stage1", "stage2", "stage2_plain", "plan", "plan_activations"]
    parser.add_argument("groups", nargs="*", default=groups, choices=[*groups, "longctx", "serve", "ruler", "gguf"])
    parser.add_argument("--override", "-o", action="append", default=[], help="Hydra override, e.g. teacher=tiny_llama")

    count = number(int, above=0)  # lengths, batches, steps, examples

    long = parser.add_argument_group("longctx")
    long.add_argument("--contexts", type=numbers(count), default=LONG_CONTEXTS, help="comma list of context lengths")
    long.add_argument("--batches", type=numbers(count), default=LONG_CONTEXT_BATCHES, help="comma list of decode batches")
    long.add_argument("--ratios", type=numbers(number(above=0, at_most=1)), default=LONG_CONTEXT_RATIOS,
                      help="comma list of retention ratios")
    long.add_argument("--decode-tokens", type=count, default=LONG_CONTEXT_DECODE_TOKENS,
                      help="decoding steps timed per model and batch (the figure is their median)")
    long.add_argument("--no-peak-rss", dest="peak_rss", action="store_false",
                      help="skip the peak-RSS processes (each repeats its model's prefill)")

    init = parser.add_argument_group("init")
    init.add_argument("--phase2-steps", type=count, default=None,
                      help="Phase 2 steps of every mode (calibration.phase2.steps, and init.phase2.steps of full_plus); "
                           "default: each mode's own (300)")
    ruler = parser.add_argument_group("ruler")
    ruler.add_argument("--ruler-lengths", type=numbers(count), default=RULER_LENGTHS, help="comma list of lengths")
    ruler.add_argument("--ruler-tasks", type=numbers(one_of(KNOWN_RULER_TASKS)), default=RULER_TASKS,
                       help="comma list of RULER tasks")
    ruler.add_argument("--ruler-n", type=count, default=RULER_N, help="examples per length and task")
    ruler.add_argument("--ruler-batch-size", type=count, default=None,
                       help="examples generated together (default: eval.ruler.batch_size's default)")
    gguf = parser.add_argument_group("gguf")
    gguf.add_argument("--gguf-contexts", type=numbers(count), default=GGUF_CONTEXTS, help="comma list of prompt lengths")
    gguf.add_argument("--gguf-threads", type=count, default=GGUF_THREADS, help="llama.cpp threads of both models")
    gguf.add_argument("--gguf-outtype", default=GGUF_OUTTYPE, help="both files' --outtype")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    if "gdn" in args.groups:
        bench_gdn()
    if "kl_memory" in args.groups:
        bench_kl_memory()
    for group, construction in (("host_memory", "meta"), ("host_memory_replaced", "replaced")):
        if group in args.groups:
            bench_host_memory(args.override, construction)
    if "plan_activations" in args.groups:
        bench_plan_activations(args.override)
    if "plan" in args.groups:
        bench_plan(args.override)
    if "gguf" in args.groups:
        from tcal.settings.compose import settings_for

        cache_dir = settings_for(*[o for o in args.override if not o.startswith("stage.")]).paths.cache_dir
        bench_gguf(Path(cache_dir) / "bench_gguf", args.gguf_contexts, threads=args.gguf_threads,
                   outtype=args.gguf_outtype)
    if set(args.groups) - {"gdn", "kl_memory", "host_memory", "host_memory_replaced", "plan", "plan_activations",
                           "gguf"}:
        from tcal.retention.uniform import uniform_layers
        from tcal.settings.compose import settings_for
        from tcal.teachers.load import load_teacher

        run_overrides = [o for o in args.override if not o.startswith("stage.")]

        def compose_cfg(*extra):
            return settings_for("calibration.cache=false", *extra, *run_overrides)

        cfg = compose_cfg()
        teacher, tokenizer = load_teacher(cfg.teacher, cfg.paths.cache_dir)
        if "serve" in args.groups:
            from serve import bench_serve

            bench_serve(teacher, tokenizer, Path(cfg.paths.cache_dir) / "bench_serve")
        if "student" in args.groups:
            bench_student(teacher, uniform_layers(teacher.config.num_hidden_layers, 0.5))
        if "longctx" in args.groups:
            bench_longctx(teacher, cfg.teacher, cfg.paths.cache_dir, args.ratios, args.contexts, args.batches,
                          args.decode_tokens, args.peak_rss)
        if "ruler" in args.groups:
            from tcal.data.documents import load_splits
            from tcal.settings.evaluation import NeedleRulerSettings
            from tcal.student.convert import build_student

            batch_size = args.ruler_batch_size or NeedleRulerSettings().batch_size
            student = build_student(teacher, uniform_layers(teacher.config.num_hidden_layers, 0.5))
            documents = [doc.text for doc in load_splits(cfg.data).evaluation]
            bench_ruler(student, tokenizer, documents, args.ruler_lengths, args.ruler_tasks, args.ruler_n, batch_size)
        if "stats" in args.groups:
            bench_stats(teacher)
        if "phase2" in args.groups:
            bench_phase2_step(teacher, cfg.calibration)
        if "init" in args.groups:
            bench_init_modes(compose_cfg, phase2_steps=args.phase2_steps)
        keep = uniform_layers(teacher.config.num_hidden_layers, 0.5)
        for group, bench in (("stage2", bench_stage2), ("stage2_plain", partial(bench_stage2, plain=True)),
                             ("stage1", bench_stage1)):
            if group in args.groups:
                bench(teacher, keep, overrides=args.override)


if __name__ == "__main__":
    main()
