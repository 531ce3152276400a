"""The decode-path benchmarks: `student` (the student against the teacher at 50% retention: forward,
forward+backward, cache bytes, decode time) and `longctx` (the naive uniform students against the teacher at long
contexts: prefill, decode per token at several batches, cache bytes and peak RSS)."""

from __future__ import annotations

import copy
import statistics

import torch
from measurement import Clock, best_time, emit, in_fresh_process, reset_peak_rss, rss_kib


def cached_tensors(cache):
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
    return sum(tensor.numel() * tensor.element_size() for _, _, tensor in cached_tensors(cache))


def repeat_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """`tensor`'s rows (dim 0) repeated cyclically up to `batch` rows."""
    return tensor.index_select(0, torch.arange(batch, device=tensor.device) % tensor.shape[0])


def expand_cache_batch(cache, batch: int) -> None:
    """Repeat the rows of every cached tensor up to `batch` rows, in place and one tensor at a time (the peak
    holds one tensor twice, not the whole cache). Decoding costs the same whatever the cache holds, so a
    batch-1 prefill stands in for a batch-`batch` one."""
    for holder, key, tensor in cached_tensors(cache):
        if isinstance(holder, dict):
            holder[key] = repeat_rows(tensor, batch)
        else:
            setattr(holder, key, repeat_rows(tensor, batch))


def expanded_copy(cache, batch: int):
    """A copy of `cache` with every cached tensor's rows repeated up to `batch` rows; `cache` is left as it was
    (and never copied at its own batch)."""
    return copy.deepcopy(cache, {id(tensor): repeat_rows(tensor, batch) for _, _, tensor in cached_tensors(cache)})



@torch.no_grad()
def prefill(model, ids: torch.Tensor):
    """(Clock, cache, greedy next token [B, 1]) of one cached forward over `ids`; logits of the last position
    only (a 32k-token prefill would otherwise hold 32k x vocab float32 logits). Teacher and student alike get
    the cache the hybrid student makes for itself (softmax layers appending in place), so both decode with the
    same KV cache code."""
    from transformers import DynamicCache

    from tcal.student.hybrid import use_growing_kv

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


def decode_time(model, context: torch.Tensor, steps: int = 8) -> tuple[float, int]:
    """(wall seconds per generated token at `context` length, cache bytes after the prefill)."""
    _, cache, nxt = prefill(model, context)
    size = cache_bytes(cache)
    clocks, _ = decode_steps(model, cache, nxt, steps)
    return sum(c.wall for c in clocks) / steps, size


def bench_student(teacher, keep_layers, batch=4, seq_len=512, context=4096) -> list[dict]:
    from tcal.student.convert import build_student

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
    t_dec, t_bytes = decode_time(teacher, long)
    s_dec, s_bytes = decode_time(student, long)
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


def context_ids(vocab: int, context: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(1))


def time_long_context(models: dict, context: int, batches, decode_tokens: int, rounds: int = 4) -> dict:
    """{retention: {"prefill": Clock, "decode": {batch: (median CPU s, median wall s) per token},
    "cache_bytes": {batch: bytes}, "kv_layer": name}} for each of `models` ({retention ratio: model}) at
    `context` tokens, all in this process. Prefill is at batch 1, the models in turn (3 times up to
    SHORT_PREFILL tokens, the fastest kept). Every batch decodes from a copy of that cache with its rows
    repeated, the models in turn in `rounds` blocks of tokens (one batch-8 copy at a time: all of them would not
    fit at 32k), so a drift in the machine's load reaches teacher and students alike."""
    ids = context_ids(next(iter(models.values())).config.vocab_size, context)
    figures = {retention: {"decode": {}, "cache_bytes": {}} for retention in models}
    prefilled = {}
    for _ in range(3 if context <= SHORT_PREFILL else 1):
        for retention, model in models.items():
            clock, cache, next_ids = prefill(model, ids)
            prefilled[retention] = (cache, next_ids)
            if "prefill" not in figures[retention] or clock.cpu < figures[retention]["prefill"].cpu:
                figures[retention]["prefill"] = clock
    for retention, (cache, _) in prefilled.items():
        figures[retention]["kv_layer"] = next(type(h).__name__ for h, _, _ in cached_tensors(cache)
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

    from tcal.student.convert import build_student
    from tcal.teachers.load import load_teacher

    model, _ = load_teacher(teacher_cfg, cache_dir)
    if keep_layers is not None:
        model = build_student(model, keep_layers)
    gc.collect()
    reset_peak_rss()
    _, cache, next_ids = prefill(model, context_ids(model.config.vocab_size, context))
    peaks = {}
    for batch in sorted(batches):
        expand_cache_batch(cache, batch)
        _, next_ids = decode_steps(model, cache, repeat_rows(next_ids, batch), decode_tokens)
        peaks[batch] = rss_kib("VmHWM") * 1024
    return peaks


def long_context_lines(context: int, retention: float, teacher: dict, student: dict, peaks: dict | None = None,
                       **extra):
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

    if peaks:  # measured after the timed figures, which are printed first: a killed run keeps those
        return [line("peak_rss", batch, "bytes", peaks[TEACHER_RETENTION][batch], peaks[retention][batch])
                for batch in teacher["decode"]]
    lines = [timed("prefill", 1, *((m["prefill"].cpu, m["prefill"].wall) for m in (teacher, student)))]
    for batch in teacher["decode"]:
        lines.append(timed("decode_per_token", batch, teacher["decode"][batch], student["decode"][batch]))
        lines.append(line("cache_bytes", batch, "bytes", teacher["cache_bytes"][batch], student["cache_bytes"][batch]))
    return lines


def bench_longctx(teacher, teacher_cfg, cache_dir, ratios=LONG_CONTEXT_RATIOS, contexts=LONG_CONTEXTS,
                  batches=LONG_CONTEXT_BATCHES, decode_tokens: int = LONG_CONTEXT_DECODE_TOKENS,
                  peak_rss: bool = True) -> list[dict]:
    """Prefill, decode per token, cache bytes and peak RSS of the naive uniform students at `ratios` against the
    teacher, per context length. Times are measured in this process, teacher and students side by side; the peak
    RSS of each model and context in a fresh process of its own (`long_context_peak_rss`)."""
    from tcal.retention.uniform import uniform_layers
    from tcal.student.convert import build_student

    keep = {ratio: uniform_layers(teacher.config.num_hidden_layers, ratio) for ratio in ratios}
    models = {TEACHER_RETENTION: teacher, **{ratio: build_student(teacher, keep[ratio]) for ratio in ratios}}
    for model in models.values():  # warm-up: first-call allocations and lazy initialization
        _, cache, next_ids = prefill(model, context_ids(teacher.config.vocab_size, 64))
        decode_steps(model, cache, next_ids, 2)
    lines = []
    for context in contexts:
        timed = time_long_context(models, context, batches, decode_tokens)
        extra = dict(model=teacher_cfg.name, threads=torch.get_num_threads(),
                     kv_layer=timed[TEACHER_RETENTION]["kv_layer"])
        for ratio in ratios:
            lines += long_context_lines(context, ratio, timed[TEACHER_RETENTION], timed[ratio], **extra)
        if not peak_rss:
            continue
        peaks = {retention: in_fresh_process(long_context_peak_rss, teacher_cfg, str(cache_dir), keep.get(retention),
                                             context, tuple(batches))
                 for retention in models}
        for ratio in ratios:
            lines += long_context_lines(context, ratio, timed[TEACHER_RETENTION], timed[ratio], peaks, **extra)
    return lines

