"""`tcal-bench [group ...] [-o hydra.override ...]`: speed and memory figures, one JSON line each.

Groups: `gdn` (GDN CPU path against fla's naive recurrent reference), `kl_memory` (the fused KL's extra peak
memory on a 151,936-token head, in chunks of logits), `student` (student against teacher
at 50% retention: forward, forward+backward, cache bytes, decode time), `stats` (peak memory of the
streaming statistics at T=4096 against a plain forward), `phase2` (Phase 2 step against one GDN
forward+backward), `init` (wall time and peak memory of the `phase2`, `full` and `full_plus` inits, uncached,
and their ratios to `full`), `stage1` / `stage2` (a training step against its parts measured apart, and the
process's peak RSS), `stage2_plain` (the same step with full-batch logits and an unchunked KL, for the memory
comparison), `plan` (`tcal-plan`'s Stage 2 peak against the peak RSS of the same short Stage 2, each measured in a
fresh process; `-o stage.checkpoint_mixers=false` etc. choose the checkpointing), and, only when named, `longctx` (the naive uniform students at `--ratios` against the teacher at
`--contexts` tokens: prefill, decode per token at `--batches`, cache bytes and peak RSS; minutes to hours on a CPU).
Ratios, not timed tests. Peak RSS is per process: run `stage2` and `stage2_plain` each in its own
invocation (`longctx` starts a process per model and context itself).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from tcal.fingerprint import weights_digest
from tcal.gdn import chunk_gated_delta_rule_torch
from tcal.training.stages import AlignStage, DistillStage


def emit(figure: str, **values) -> dict:
    line = {"figure": figure, **{k: round(v, 5) if isinstance(v, float) else v for k, v in values.items()}}
    print(json.dumps(line), flush=True)
    return line


def best_time(fn, repeats: int = 3, warmup: bool = True) -> float:
    """Minimum wall time over `repeats` runs after one warm-up (the least noisy estimate on a shared CPU)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _rule_inputs(T: int, heads: int = 9, dim: int = 64, batch: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, T, heads, dim, generator=gen), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(batch, T, heads, dim, generator=gen).requires_grad_()
    g = (-torch.rand(batch, T, heads, generator=gen) * 0.1).requires_grad_()
    beta = torch.rand(batch, T, heads, generator=gen).requires_grad_()
    return q, k, v, g, beta


def _fwd_bwd(rule, inputs):
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
        q, k, v, g, beta = _rule_inputs(T)
        ours = best_time(_fwd_bwd(chunk_gated_delta_rule_torch, (q, k, v, g, beta)))
        recurrent = best_time(_fwd_bwd(naive_recurrent_gated_delta_rule, (q, k, v, beta, g)), repeats=1, warmup=False)
        fla_chunk = best_time(_fwd_bwd(naive_chunk_gated_delta_rule, (q, k, v, g, beta)))
        lines.append(emit(f"gdn_fwd_bwd_T{T}", shape=f"B=1,H=9,d=64,T={T}", torch_chunk_s=ours,
                          fla_naive_recurrent_s=recurrent, fla_naive_chunk_s=fla_chunk,
                          speedup_vs_recurrent=recurrent / ours, speedup_vs_fla_naive_chunk=fla_chunk / ours,
                          target="speedup_vs_recurrent >= 5 at T=2048"))
    return lines


def _cached_tensors(cache):
    """(holder, key, tensor) for every tensor a transformers cache holds: the softmax layers' keys and values
    (attributes of the layer) and the linear-attention layers' recurrent states (entries of a dict)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                yield layer, name, tensor
        states = getattr(layer, "recurrent_states", None) or {}
        for index, state in states.items():
            if isinstance(state, torch.Tensor):
                yield states, index, state


def cache_bytes(cache) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, _, tensor in _cached_tensors(cache))


def repeat_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """`tensor`'s rows (dim 0) repeated cyclically up to `batch` rows."""
    return tensor.index_select(0, torch.arange(batch, device=tensor.device) % tensor.shape[0])


def expand_cache_batch(cache, batch: int) -> None:
    """Repeat the rows of every cached tensor up to `batch` rows, in place and one tensor at a time (the peak
    holds one tensor twice, not the whole cache). Decoding costs the same whatever the cache holds, so a
    batch-1 prefill stands in for a batch-`batch` one."""
    for holder, key, tensor in _cached_tensors(cache):
        if isinstance(holder, dict):
            holder[key] = repeat_rows(tensor, batch)
        else:
            setattr(holder, key, repeat_rows(tensor, batch))


def expanded_copy(cache, batch: int):
    """A copy of `cache` with every cached tensor's rows repeated up to `batch` rows; `cache` is left as it was
    (and never copied at its own batch)."""
    return copy.deepcopy(cache, {id(tensor): repeat_rows(tensor, batch) for _, _, tensor in _cached_tensors(cache)})


class Clock:
    """Wall and process CPU seconds of a block. On a machine shared with other jobs the CPU time of a
    one-thread process is what an idle core would take; the wall time also counts the waits for a core."""

    def __enter__(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self._wall, time.process_time() - self._cpu


@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """(Clock, cache, greedy next token [B, 1]) of one cached forward over `ids`; logits of the last position
    only (a 32k-token prefill would otherwise hold 32k x vocab float32 logits). Teacher and student alike get
    the cache the hybrid student makes for itself (softmax layers appending in place), so both decode with the
    same KV cache code."""
    from transformers import DynamicCache

    from tcal.hybrid import use_growing_kv

    cache = use_growing_kv(DynamicCache(config=model.config))
    with Clock() as clock:
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return clock, out.cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode_steps(model, cache, next_ids: torch.Tensor, tokens: int) -> tuple[list[Clock], torch.Tensor]:
    """(a Clock per greedy decoding step, the next token after `tokens` steps), growing `cache`."""
    clocks = []
    for _ in range(tokens):
        with Clock() as clock:
            out = model(input_ids=next_ids, cache=cache, use_cache=True)
            next_ids = out.logits[:, -1:].argmax(-1)
        clocks.append(clock)
    return clocks, next_ids


def _decode_time(model, context: torch.Tensor, steps: int = 8) -> tuple[float, int]:
    """(wall seconds per generated token at `context` length, cache bytes after the prefill)."""
    _, cache, nxt = prefill(model, context)
    size = cache_bytes(cache)
    clocks, _ = decode_steps(model, cache, nxt, steps)
    return sum(c.wall for c in clocks) / steps, size


def bench_student(teacher, keep_layers, batch=4, seq_len=512, context=4096) -> list[dict]:
    from tcal.convert import build_student

    student = build_student(teacher, keep_layers)
    ids = torch.randint(0, teacher.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    lines = []
    with torch.no_grad():
        fwd = {name: best_time(lambda m=m: m(input_ids=ids, use_cache=False)) for name, m in
               (("teacher", teacher), ("student", student))}
    lines.append(emit("student_forward", shape=f"{batch}x{seq_len}", teacher_s=fwd["teacher"], student_s=fwd["student"],
                      ratio=fwd["student"] / fwd["teacher"], target="ratio <= 1.2"))

    def train_step(model):
        model.requires_grad_(True)
        loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    fb = {name: best_time(lambda m=m: train_step(m), repeats=2) for name, m in (("teacher", teacher), ("student", student))}
    teacher.requires_grad_(False)
    lines.append(emit("student_forward_backward", shape=f"{batch}x{seq_len}", teacher_s=fb["teacher"],
                      student_s=fb["student"], ratio=fb["student"] / fb["teacher"], target="ratio <= 1.2"))
    long = torch.randint(0, teacher.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
    t_dec, t_bytes = _decode_time(teacher, long)
    s_dec, s_bytes = _decode_time(student, long)
    lines.append(emit("cache_bytes", context=context, teacher_bytes=t_bytes, student_bytes=s_bytes,
                      ratio=s_bytes / t_bytes, target="ratio <= 0.55"))
    lines.append(emit("decode_per_token", context=context, teacher_s=t_dec, student_s=s_dec,
                      ratio=s_dec / t_dec, target="ratio < 1"))
    return lines


LONG_CONTEXTS = (1024, 4096, 16384, 32768)
LONG_CONTEXT_RATIOS = (0.5, 0.25)
LONG_CONTEXT_BATCHES = (1, 8)
LONG_CONTEXT_DECODE_TOKENS = 32
TEACHER_RETENTION = 1.0  # the teacher is the model that keeps every softmax layer
SHORT_PREFILL = 4096  # prefills up to this length are timed 3 times (the fastest kept); longer ones once
# Bounds on student / teacher at retention 0.5: (figure, context or None for every context) -> bound.
LONG_CONTEXT_TARGETS = {("decode_per_token", 16384): 0.7, ("decode_per_token", 32768): 0.6,
                        ("cache_bytes", None): 0.52, ("prefill", 16384): 0.8}


def _context_ids(vocab: int, context: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(1))


def time_long_context(models: dict, context: int, batches, decode_tokens: int, rounds: int = 4) -> dict:
    """{retention: {"prefill": Clock, "decode": {batch: (median CPU s, median wall s) per token},
    "cache_bytes": {batch: bytes}, "kv_layer": name}} for each of `models` ({retention ratio: model}) at
    `context` tokens, all in this process. Prefill is at batch 1, the models in turn (3 times up to
    SHORT_PREFILL tokens, the fastest kept). Every batch decodes from a copy of that cache with its rows
    repeated, the models in turn in `rounds` blocks of tokens (one batch-8 copy at a time: all of them would not
    fit at 32k), so a drift in the machine's load reaches teacher and students alike."""
    ids = _context_ids(next(iter(models.values())).config.vocab_size, context)
    figures = {retention: {"decode": {}, "cache_bytes": {}} for retention in models}
    prefilled = {}
    for _ in range(3 if context <= SHORT_PREFILL else 1):
        for retention, model in models.items():
            clock, cache, next_ids = prefill(model, ids)
            prefilled[retention] = (cache, next_ids)
            if "prefill" not in figures[retention] or clock.cpu < figures[retention]["prefill"].cpu:
                figures[retention]["prefill"] = clock
    for retention, (cache, _) in prefilled.items():
        figures[retention]["kv_layer"] = next(type(h).__name__ for h, _, _ in _cached_tensors(cache)
                                              if not isinstance(h, dict))
    per_round = -(-decode_tokens // rounds)
    for batch in batches:
        clocks = {retention: [] for retention in models}
        for _ in range(rounds):
            for retention, model in models.items():
                cache, next_ids = expanded_copy(prefilled[retention][0], batch), prefilled[retention][1]
                figures[retention]["cache_bytes"][batch] = cache_bytes(cache)
                block, _ = decode_steps(model, cache, repeat_rows(next_ids, batch), per_round)
                clocks[retention] += block
                del cache
        for retention in models:
            figures[retention]["decode"][batch] = (statistics.median(c.cpu for c in clocks[retention]),
                                                   statistics.median(c.wall for c in clocks[retention]))
    return figures


def long_context_peak_rss(teacher_cfg, cache_dir, keep_layers, context: int, batches, decode_tokens: int = 2) -> dict:
    """{batch: peak resident bytes} of this process running one model, the teacher (`keep_layers` None) or its
    naive student: prefill of `context` tokens at batch 1, then `decode_tokens` steps at each batch in turn (the
    cache's rows repeated in place), each peak taken over everything up to that batch. Counted from the loaded
    model (the teacher a student is built from is freed first). Meant for `in_fresh_process`."""
    import gc

    from tcal.calibration.stats import _rss_kib
    from tcal.convert import build_student
    from tcal.teachers.load import load_teacher

    model, _ = load_teacher(teacher_cfg, cache_dir)
    if keep_layers is not None:
        model = build_student(model, keep_layers)
    gc.collect()
    _reset_peak_rss()
    _, cache, next_ids = prefill(model, _context_ids(model.config.vocab_size, context))
    peaks = {}
    for batch in sorted(batches):
        expand_cache_batch(cache, batch)
        _, next_ids = decode_steps(model, cache, repeat_rows(next_ids, batch), decode_tokens)
        peaks[batch] = _rss_kib("VmHWM") * 1024
    return peaks


def _long_context_lines(context: int, retention: float, teacher: dict, student: dict, peaks: dict, **extra):
    """The JSON lines of one student against the teacher at one context (targets at retention 0.5 only). Times
    are process CPU seconds (the ratio's), with the wall seconds beside them."""
    def line(figure: str, batch: int, unit: str, teacher_value, student_value, **more) -> dict:
        bound = LONG_CONTEXT_TARGETS.get((figure, context), LONG_CONTEXT_TARGETS.get((figure, None)))
        target = {"target": f"ratio <= {bound}"} if bound is not None and retention == 0.5 else {}
        return emit(figure, context=context, batch=batch, retention_ratio=retention,
                    **{f"teacher_{unit}": teacher_value, f"student_{unit}": student_value},
                    ratio=student_value / teacher_value, **more, **target, **extra)

    def timed(figure: str, batch: int, teacher_cpu_wall, student_cpu_wall) -> dict:
        return line(figure, batch, "s", teacher_cpu_wall[0], student_cpu_wall[0], teacher_wall_s=teacher_cpu_wall[1],
                    student_wall_s=student_cpu_wall[1])

    lines = [timed("prefill", 1, *((m["prefill"].cpu, m["prefill"].wall) for m in (teacher, student)))]
    for batch in teacher["decode"]:
        lines.append(timed("decode_per_token", batch, teacher["decode"][batch], student["decode"][batch]))
        lines.append(line("cache_bytes", batch, "bytes", teacher["cache_bytes"][batch], student["cache_bytes"][batch]))
        if peaks:
            lines.append(line("peak_rss", batch, "bytes", peaks[TEACHER_RETENTION][batch], peaks[retention][batch]))
    return lines


def bench_longctx(teacher, teacher_cfg, cache_dir, ratios=LONG_CONTEXT_RATIOS, contexts=LONG_CONTEXTS,
                  batches=LONG_CONTEXT_BATCHES, decode_tokens: int = LONG_CONTEXT_DECODE_TOKENS,
                  peak_rss: bool = True) -> list[dict]:
    """Prefill, decode per token, cache bytes and peak RSS of the naive uniform students at `ratios` against the
    teacher, per context length. Times are measured in this process, teacher and students side by side; the peak
    RSS of each model and context in a fresh process of its own (`long_context_peak_rss`)."""
    from tcal.convert import build_student
    from tcal.retention.uniform import uniform_layers

    keep = {ratio: uniform_layers(teacher.config.num_hidden_layers, ratio) for ratio in ratios}
    models = {TEACHER_RETENTION: teacher, **{ratio: build_student(teacher, keep[ratio]) for ratio in ratios}}
    for model in models.values():  # warm-up: first-call allocations and lazy initialization
        _, cache, next_ids = prefill(model, _context_ids(teacher.config.vocab_size, 64))
        decode_steps(model, cache, next_ids, 2)
    lines = []
    for context in contexts:
        timed = time_long_context(models, context, batches, decode_tokens)
        peaks = {retention: in_fresh_process(long_context_peak_rss, teacher_cfg, str(cache_dir), keep.get(retention),
                                             context, tuple(batches))
                 for retention in models} if peak_rss else {}
        for ratio in ratios:
            lines += _long_context_lines(context, ratio, timed[TEACHER_RETENTION], timed[ratio], peaks,
                                         model=teacher_cfg.name, threads=torch.get_num_threads(),
                                         kv_layer=timed[TEACHER_RETENTION]["kv_layer"])
    return lines


def bench_stats(teacher, seq_len=4096) -> dict:
    from tcal.calibration.stats import peak_memory_report

    report = peak_memory_report(teacher, seq_len)
    return emit("stats_peak_memory", **report, target="stats_over_plain_peak <= 1.3")


def bench_phase2_step(teacher, cfg, layer: int = 1, steps: int = 20) -> dict:
    """Phase 2 seconds per step on one layer, against one forward+backward of that GDN on the same batch."""
    from tcal.calibration.align import align_layer, alignment_loss
    from tcal.calibration.stats import collect_teacher_stats
    from tcal.convert import naive_gdn

    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, teacher.config.vocab_size, (int(cfg.batch_size), int(cfg.seq_len)), generator=gen)
    stats = collect_teacher_stats(teacher, batch, layers=[layer])[layer]
    gdn = naive_gdn(teacher, layer)

    def fwd_bwd():
        alignment_loss(gdn, stats.inputs, stats.attn_output).backward()
        gdn.zero_grad(set_to_none=True)

    plain = best_time(fwd_bwd)
    phase2 = OmegaConf.merge(cfg.phase2, {"steps": steps})
    start = time.perf_counter()
    align_layer(naive_gdn(teacher, layer), stats.inputs, stats.attn_output, phase2)
    per_step = (time.perf_counter() - start) / steps
    return emit("phase2_step", batch=f"{cfg.batch_size}x{cfg.seq_len}", layer=layer, fwd_bwd_s=plain,
                phase2_step_s=per_step, ratio=per_step / plain, target="ratio <= 1.2")


INIT_MODES_BENCHED = ("phase2", "full", "full_plus")


def _reset_peak_rss() -> int:
    """Reset the process's resident-memory high-water mark (Linux); returns the current RSS in bytes."""
    from tcal.calibration.stats import _rss_kib

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_kib("VmRSS") * 1024


def measure_init(cfg) -> dict:
    """Wall time and peak resident memory of one init mode (conversion + calibration, no cache, no evaluation)."""
    from tcal.calibration.stats import _rss_kib
    from tcal.convert import build_student
    from tcal.init import init_student
    from tcal.pipeline import prepare
    from tcal.retention import select_layers

    timings: dict = {}
    ctx = prepare(cfg, cfg.paths.output_dir, timings)
    keep_layers = select_layers(cfg.retention, ctx).keep_layers
    before = _reset_peak_rss()
    start = time.perf_counter()
    student = build_student(ctx.teacher, keep_layers, cfg.init.gqa_expansion, int(cfg.seed))
    init_student(student, cfg.init, ctx)
    wall = time.perf_counter() - start
    peak = _rss_kib("VmHWM") * 1024
    return {"init": cfg.init.name, "init_weights_digest": weights_digest(student), "teacher": cfg.teacher.name,
            "ratio": cfg.retention.get("ratio"), "seconds": wall,
            "peak_rss_bytes": peak, "peak_increase_bytes": peak - before, "threads": torch.get_num_threads()}


def _fresh_process_child(fn, args, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    queue.put(fn(*args))


def in_fresh_process(fn, *args, env: dict | None = None):
    """`fn(*args)` in a fresh (spawned) process with this one's thread count and `env` added to its environment, so
    its peak resident memory is its own: one measurement's freed memory cannot hide the next one's peak. `fn` must
    be a module-level function and its result picklable; a child that dies is an error, not a hang."""
    import multiprocessing as mp
    import os
    import queue as queues
    from unittest import mock

    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    proc = spawn.Process(target=_fresh_process_child, args=(fn, args, torch.get_num_threads(), results))
    with mock.patch.dict(os.environ, env or {}):
        proc.start()
    while True:
        try:
            value = results.get(timeout=5)
            break
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{fn.__name__} died in its process (exit code {proc.exitcode})") from None
    proc.join()
    return value


def bench_init(cfg) -> dict:
    """`measure_init` in a fresh process, so one mode's freed memory does not hide the next one's peak."""
    return emit("init_wall", **in_fresh_process(measure_init, cfg))


def bench_init_modes(compose_cfg, modes=INIT_MODES_BENCHED) -> dict:
    """`bench_init` for each mode, then each mode's time and peak-memory increase over `full`'s
    (the budget full_plus is held to: at most 1.5x the time and 2x the memory of full)."""
    figures = {mode: bench_init(compose_cfg(f"init={mode}")) for mode in modes}
    base = figures["full"]
    ratios = {mode: {"time_over_full": f["seconds"] / base["seconds"],
                     "peak_increase_over_full": f["peak_increase_bytes"] / max(base["peak_increase_bytes"], 1)}
              for mode, f in figures.items()}
    return emit("init_ratios", modes=ratios, target="full_plus: time <= 1.5x, memory <= 2x full")


class StepTimer(Callback):
    """Wall time of each training step (batch start to batch end, optimizer included)."""

    def __init__(self):
        self.times, self._start = [], 0.0

    def on_train_batch_start(self, *args):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self._start)


def _fit_step_time(module, batches: torch.Tensor, batch_size: int) -> float:
    """Fastest step after the first, through Lightning's Trainer (clip 1.0, no logger or checkpoints)."""
    import lightning as L
    from torch.utils.data import DataLoader

    timer = StepTimer()
    steps = len(batches) // batch_size
    L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, gradient_clip_val=1.0, callbacks=[timer]).fit(
        module, DataLoader(batches, batch_size=batch_size))
    return min(timer.times[1:])


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def stage_config(kind: str, overrides=()):
    """conf/stage/<kind>.yaml with the `stage.*` entries of `overrides` applied."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tcal.app import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"stage={kind}", *(o for o in overrides if o.startswith("stage."))])
    GlobalHydra.instance().clear()
    return cfg.stage


def _stage_setup(teacher, kind: str, keep_layers, batch: int, seq_len: int, steps: int, overrides=()):
    from tcal.convert import build_student

    cfg = stage_config(kind, overrides)
    student = build_student(teacher, keep_layers)
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, teacher.config.vocab_size, (steps * batch, seq_len), generator=gen)
    return cfg, student, batches


def bench_stage2(teacher, keep_layers, batch=4, seq_len=512, steps=3, plain=False, overrides=()) -> dict:
    """A Stage 2 step against (teacher forward + student forward+backward) on the same batch, and peak RSS."""
    cfg, student, batches = _stage_setup(teacher, "distill", keep_layers, batch, seq_len, steps, overrides)
    module = (PlainDistill if plain else DistillStage)(student, teacher, cfg, steps)
    step = _fit_step_time(module, batches, batch)
    rss = peak_rss_gb()
    ids = batches[:batch]
    with torch.no_grad():
        teacher_fwd = best_time(lambda: teacher(input_ids=ids, use_cache=False).logits, repeats=2)

    def student_fwd_bwd():
        logits = student(input_ids=ids, use_cache=False).logits.float()
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        student.zero_grad(set_to_none=True)

    fwd_bwd = best_time(student_fwd_bwd, repeats=2)
    tokens = batch * seq_len
    return emit("stage2_plain_step" if plain else "stage2_step", shape=f"{batch}x{seq_len}", step_s=step,
                teacher_forward_s=teacher_fwd, student_forward_backward_s=fwd_bwd,
                ratio=step / (teacher_fwd + fwd_bwd), tokens_per_s=tokens / step, peak_rss_gb=rss,
                threads=torch.get_num_threads(), checkpoint_mixers=cfg.checkpoint_mixers,
                activation_checkpointing=cfg.activation_checkpointing, kl_chunk_size=cfg.kl_chunk_size,
                target="ratio <= 1.15, peak_rss_gb <= 4")


PLAN_BATCH = (2, 512)  # small: a SmolLM2 step in about 30 s on one thread; activations 30-40% of the peak


def plan_overrides(overrides=(), batch: int = PLAN_BATCH[0], seq_len: int = PLAN_BATCH[1], steps: int = 2) -> list:
    """A short Stage 2 on the CPU: `steps` steps of batch x seq_len (`overrides` may change the teacher, retention
    and `stage.*` settings such as the checkpointing)."""
    tokens = batch * seq_len
    return ["stage=distill", "trainer=cpu", f"stage.batch_size={batch}", f"stage.seq_len={seq_len}",
            f"stage.max_tokens={steps * tokens}", f"stage.eval_every_tokens={tokens}", *overrides]


def measure_stage2_peak(cfg, keep_layers) -> dict:
    """Peak resident memory of a short Stage 2 (`cfg.stage`, float32 teacher on the CPU) over the process before
    the teacher loaded: what the plan's per-device peak counts."""
    from tcal.calibration.stats import _rss_kib
    from tcal.convert import build_student
    from tcal.teachers.load import load_teacher

    base = _rss_kib("VmRSS") * 1024
    teacher, _ = load_teacher(cfg.teacher, cfg.paths.cache_dir)
    student = build_student(teacher, keep_layers)
    steps = int(cfg.stage.max_tokens) // (int(cfg.stage.batch_size) * int(cfg.stage.seq_len))
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, teacher.config.vocab_size, (steps * int(cfg.stage.batch_size), int(cfg.stage.seq_len)),
                            generator=gen)
    module = DistillStage(student, teacher, cfg.stage, steps)
    _reset_peak_rss()
    step_s = _fit_step_time(module, batches, int(cfg.stage.batch_size))
    return {"measured_increase_bytes": _rss_kib("VmHWM") * 1024 - base, "step_s": step_s}


# glibc's malloc maps blocks of 128 KiB and more on their own and unmaps them when freed (by default it raises that
# threshold as blocks are freed and keeps freed memory in its heap): resident memory then follows live tensors.
EAGER_RELEASE = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def bench_plan(overrides=(), batch: int = PLAN_BATCH[0], seq_len: int = PLAN_BATCH[1], steps: int = 2) -> dict:
    """`tcal-plan`'s Stage 2 peak for the CPU against the peak RSS increase of the same short Stage 2, measured in a
    fresh process twice: with glibc releasing freed blocks at once (`EAGER_RELEASE`: the memory allocated, which is
    what the plan counts and what the target is about) and with glibc's defaults (what a CPU run shows; the
    difference is free memory glibc keeps). SmolLM2 by default: the real teacher, float32."""
    from tcal.plan import GB, compose_config, make_plan

    cfg = compose_config(plan_overrides(overrides, batch, seq_len, steps))
    plan = make_plan(cfg)
    stage = plan["stages"]["distill"]
    keep = plan["retention"]["keep_layers"]
    if keep is None:
        raise ValueError(f"tcal-bench plan: retention={plan['retention']['policy']} scores layers; "
                         f"use retention=uniform or explicit")
    allocated = in_fresh_process(measure_stage2_peak, cfg, keep, env=EAGER_RELEASE)
    default = in_fresh_process(measure_stage2_peak, cfg, keep)
    allocated_gb, default_gb = (m["measured_increase_bytes"] / GB for m in (allocated, default))
    return emit("plan_stage2_peak", teacher=plan["teacher"], shape=f"{batch}x{seq_len}", steps=steps,
                checkpointing=stage["checkpointing"], planned_gb=stage["peak_gb"], measured_gb=allocated_gb,
                ratio=stage["peak_gb"] / allocated_gb, measured_default_malloc_gb=default_gb,
                ratio_default_malloc=stage["peak_gb"] / default_gb,
                planned_parts_gb={k: stage[k] for k in ("weights_gb", "optimizer_gb", "teacher_gb", "activations_gb",
                                                        "kl_gb", "gradients_gb")},
                step_s=allocated["step_s"], step_s_default_malloc=default["step_s"], threads=torch.get_num_threads(),
                target="ratio within 0.85 .. 1.15 (peak RSS increase over the process before the teacher loaded, "
                       "glibc releasing freed blocks)")


class PlainDistill(DistillStage):
    """Stage 2 with the plain loss: full-batch float32 logits of both models and an unchunked KL."""

    def loss(self, batch):
        with torch.no_grad():
            t_logp = F.log_softmax(self.teacher(input_ids=batch, use_cache=False).logits.float(), -1)
        s_logp = F.log_softmax(self.student(input_ids=batch, use_cache=False).logits.float(), -1)
        return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean(), {}


def bench_stage1(teacher, keep_layers, batch=4, seq_len=512, steps=3, overrides=()) -> dict:
    """A Stage 1 step against (teacher forward + every GDN layer's forward+backward) on the same batch."""
    from tcal.calibration.align import alignment_loss, capture_teacher_io

    cfg, student, batches = _stage_setup(teacher, "align", keep_layers, batch, seq_len, steps, overrides)
    module = AlignStage(student, teacher, cfg, steps)
    step = _fit_step_time(module, batches, batch)
    ids, layers = batches[:batch], student.config.gdn_layers
    with torch.no_grad(), capture_teacher_io(teacher, layers) as io:
        teacher_fwd = best_time(lambda: teacher.get_decoder()(input_ids=ids, use_cache=False), repeats=2)

    def gdn_fwd_bwd():
        for i in layers:
            alignment_loss(student.gdn(i), *io[i]).backward()
        student.zero_grad(set_to_none=True)

    fwd_bwd = best_time(gdn_fwd_bwd, repeats=2)
    return emit("stage1_step", shape=f"{batch}x{seq_len}", step_s=step, teacher_forward_s=teacher_fwd,
                gdn_forward_backward_s=fwd_bwd, ratio=step / (teacher_fwd + fwd_bwd), peak_rss_gb=peak_rss_gb(),
                threads=torch.get_num_threads(), target="ratio <= 1.2")


def _kl_memory_child(vocab: int, hidden_size: int, tokens: int, chunk: int, dtype_name: str):
    """One fused-KL forward+backward on random heads: (peak resident growth over the loaded tensors, the head
    gradient's bytes, seconds)."""
    from tcal.calibration.stats import _rss_kib
    from tcal.training.kd import chunked_kd_loss

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    heads = [torch.nn.Linear(hidden_size, vocab, bias=False, dtype=dtype) for _ in range(2)]
    for head in heads:
        head.weight.data.normal_(0, 0.02, generator=gen)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(1, tokens, hidden_size, generator=gen).to(dtype)
    ids = torch.randint(vocab, (1, tokens), generator=gen)

    def step():
        loss, _ = chunked_kd_loss(hidden, teacher_hidden, heads[0], heads[1], ids, chunk_size=chunk)
        loss.backward()

    step()  # warm-up; then gradients set to None, as the optimizer's zero_grad leaves them before each step
    hidden.grad = heads[0].weight.grad = None
    before = _reset_peak_rss()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    gradient_bytes = heads[0].weight.grad.numel() * heads[0].weight.grad.element_size()
    return (_rss_kib("VmHWM") * 1024) - before, gradient_bytes, seconds


def bench_kl_memory(vocab: int = 151_936, hidden_size: int = 1024, tokens: int = 1024, chunk: int = 256) -> list[dict]:
    """Peak memory one fused-KL step adds to its inputs and heads, for a Qwen-sized vocabulary: the head's
    gradient (which any backward makes) and, beyond it, how many chunks of float32 logits (chunk x vocab x 4
    bytes). Each dtype in a fresh process (peak RSS is per process)."""
    lines = []
    for dtype_name in ("float32", "bfloat16"):
        extra, gradient_bytes, seconds = in_fresh_process(_kl_memory_child, vocab, hidden_size, tokens, chunk,
                                                          dtype_name)
        chunk_bytes = chunk * vocab * 4
        beyond = extra - gradient_bytes
        lines.append(emit(f"kl_memory_{dtype_name}", vocab=vocab, hidden=hidden_size, tokens=tokens, chunk=chunk,
                          extra_peak_gb=extra / 2**30, head_gradient_gb=gradient_bytes / 2**30,
                          beyond_gradient_gb=beyond / 2**30, float32_chunk_gb=chunk_bytes / 2**30,
                          beyond_gradient_in_chunks=beyond / chunk_bytes, seconds=seconds,
                          target="beyond_gradient_in_chunks about 2-3 (a head copy would add vocab x hidden)"))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = ["gdn", "kl_memory", "student", "stats", "phase2", "init", "stage1", "stage2", "stage2_plain", "plan"]
    parser.add_argument("groups", nargs="*", default=groups, choices=[*groups, "longctx"])
    parser.add_argument("--override", "-o", action="append", default=[], help="Hydra override, e.g. teacher=tiny_llama")

    def numbers(kind):
        return lambda text: tuple(kind(part) for part in text.split(","))

    long = parser.add_argument_group("longctx")
    long.add_argument("--contexts", type=numbers(int), default=LONG_CONTEXTS, help="comma list of context lengths")
    long.add_argument("--batches", type=numbers(int), default=LONG_CONTEXT_BATCHES, help="comma list of decode batches")
    long.add_argument("--ratios", type=numbers(float), default=LONG_CONTEXT_RATIOS,
                      help="comma list of retention ratios")
    long.add_argument("--decode-tokens", type=int, default=LONG_CONTEXT_DECODE_TOKENS,
                      help="decoding steps timed per model and batch (the figure is their median)")
    long.add_argument("--no-peak-rss", dest="peak_rss", action="store_false",
                      help="skip the peak-RSS processes (each repeats its model's prefill)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    if "gdn" in args.groups:
        bench_gdn()
    if "kl_memory" in args.groups:
        bench_kl_memory()
    if "plan" in args.groups:
        bench_plan(args.override)
    if set(args.groups) - {"gdn", "kl_memory", "plan"}:
        from hydra import compose, initialize_config_dir

        from tcal.app import CONF_DIR
        from tcal.retention.uniform import uniform_layers
        from tcal.teachers.load import load_teacher

        run_overrides = [o for o in args.override if not o.startswith("stage.")]

        def compose_cfg(*extra):
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                return compose("config", overrides=["calibration.cache=false", *extra, *run_overrides])

        cfg = compose_cfg()
        teacher, _ = load_teacher(cfg.teacher, cfg.paths.cache_dir)
        if "student" in args.groups:
            bench_student(teacher, uniform_layers(teacher.config.num_hidden_layers, 0.5))
        if "longctx" in args.groups:
            bench_longctx(teacher, cfg.teacher, cfg.paths.cache_dir, args.ratios, args.contexts, args.batches,
                          args.decode_tokens, args.peak_rss)
        if "stats" in args.groups:
            bench_stats(teacher)
        if "phase2" in args.groups:
            bench_phase2_step(teacher, cfg.calibration)
        if "init" in args.groups:
            bench_init_modes(compose_cfg)
        keep = uniform_layers(teacher.config.num_hidden_layers, 0.5)
        for group, bench in (("stage2", bench_stage2), ("stage2_plain", partial(bench_stage2, plain=True)),
                             ("stage1", bench_stage1)):
            if group in args.groups:
                bench(teacher, keep, overrides=args.override)

if __name__ == "__main__":
    main()
