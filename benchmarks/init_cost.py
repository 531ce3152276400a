"""The calibration benchmarks: `stats` (peak memory of the streaming statistics against a plain forward), `phase2`
(a Phase 2 step against one GDN forward+backward) and `init` (wall time and peak memory of the `phase2`, `full` and
`full_plus` inits, uncached, Phase 2 one layer after another and batched, and their ratios)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch
from measurement import best_time, emit, in_fresh_process, reset_peak_rss, rss_kib

from tcal.store.fingerprint import weights_digest


def stats_forward_peak(path: str, mode: str, seq_len: int, block_size: int) -> tuple[int, int]:
    """(peak resident bytes, peak increase over the warmed-up process) of one forward of the teacher saved at
    `path`: `plain`, or under `collect_teacher_stats`. Meant for `in_fresh_process`."""
    from transformers import AutoModelForCausalLM

    from tcal.init.calibration.stats import collect_teacher_stats

    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_pretrained(path)  # safetensors: no pickle
    teacher.eval()
    vocab = teacher.config.vocab_size
    warm = torch.randint(vocab, (1, 8))
    ids = torch.randint(vocab, (1, seq_len))
    run = ((lambda x: teacher(x)) if mode == "plain"
           else (lambda x: collect_teacher_stats(teacher, x, block_size=block_size, keep_tensors=True)))
    with torch.no_grad():
        run(warm)  # fault in weights and lazy initialisation before measuring
        before = reset_peak_rss()
        result = run(ids)
        peak = rss_kib("VmHWM") * 1024
    del result
    return peak, peak - before


def peak_memory_report(teacher, seq_len: int = 4096, block_size: int = 256) -> dict:
    """Peak RSS increase of a plain forward vs collect_teacher_stats, each in a fresh process.

    Also reports the bytes an output_attentions=True approach would hold for the attention maps
    alone (float32, one sequence). Linux only (/proc). The teacher is saved to a temporary folder.
    """
    cfg = teacher.config
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "teacher")
        teacher.save_pretrained(path)
        plain = in_fresh_process(stats_forward_peak, path, "plain", seq_len, block_size)
        stats = in_fresh_process(stats_forward_peak, path, "stats", seq_len, block_size)
    attn_maps = cfg.num_hidden_layers * cfg.num_attention_heads * seq_len * seq_len * 4
    return {
        "seq_len": seq_len,
        "block_size": block_size,
        "plain_forward_peak_bytes": plain[0],
        "stats_forward_peak_bytes": stats[0],
        "stats_over_plain_peak": stats[0] / max(plain[0], 1),
        "plain_forward_increase_bytes": plain[1],
        "stats_forward_increase_bytes": stats[1],
        "stats_over_plain_increase": stats[1] / max(plain[1], 1),
        "output_attentions_bytes": attn_maps,
        "output_attentions_over_stats_increase": attn_maps / max(stats[1], 1),
    }


def bench_stats(teacher, seq_len=4096) -> dict:
    report = peak_memory_report(teacher, seq_len)
    return emit("stats_peak_memory", **report, target="stats_over_plain_peak <= 1.3")


def bench_phase2_step(teacher, cfg, layer: int = 1, steps: int = 20) -> dict:
    """Phase 2 seconds per step on one layer, against one forward+backward of that GDN on the same batch."""
    from tcal.init.calibration.phase2 import FullBatch, fit_stack
    from tcal.init.calibration.stats import collect_teacher_stats
    from tcal.student.alignment import alignment_loss
    from tcal.student.convert import naive_gdn

    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, teacher.config.vocab_size, (int(cfg.batch_size), int(cfg.seq_len)), generator=gen)
    stats = collect_teacher_stats(teacher, batch, layers=[layer])[layer]
    gdn = naive_gdn(teacher, layer)

    def fwd_bwd():
        alignment_loss(gdn, stats.inputs, stats.attn_output).backward()
        gdn.zero_grad(set_to_none=True)

    plain = best_time(fwd_bwd)
    phase2 = dataclasses.replace(cfg.phase2, steps=steps)
    start = time.perf_counter()
    fit_stack([naive_gdn(teacher, layer)], FullBatch(stats.inputs[None], stats.attn_output[None]), phase2)
    per_step = (time.perf_counter() - start) / steps
    return emit("phase2_step", batch=f"{cfg.batch_size}x{cfg.seq_len}", layer=layer, fwd_bwd_s=plain,
                phase2_step_s=per_step, ratio=per_step / plain, target="ratio <= 1.2")


INIT_MODES_BENCHED = ("phase2", "full", "full_plus")


def measure_init(cfg) -> dict:
    """Wall time and peak resident memory of one init mode (conversion + calibration, no cache, no evaluation)."""
    from tcal.init import init_student
    from tcal.run import Run
    from tcal.retention import select_layers
    from tcal.student.convert import build_student

    ctx = Run.build(cfg, run_dir=Path(cfg.paths.output_dir))
    keep_layers = select_layers(cfg.retention, ctx).keep_layers
    before = reset_peak_rss()
    start = time.perf_counter()
    student = build_student(ctx.teacher, keep_layers, cfg.init.gqa_expansion, int(cfg.seed))
    init_student(student, cfg.init, ctx)
    wall = time.perf_counter() - start
    peak = rss_kib("VmHWM") * 1024
    return {"init": cfg.init.name, "init_weights_digest": weights_digest(student), "teacher": cfg.teacher.name,
            "ratio": getattr(cfg.retention, "ratio", None), "seconds": wall,
            "peak_rss_bytes": peak, "peak_increase_bytes": peak - before, "threads": torch.get_num_threads()}


def bench_init(cfg) -> dict:
    """`measure_init` in a fresh process, so one mode's freed memory does not hide the next one's peak."""
    return emit("init_wall", **in_fresh_process(measure_init, cfg))


def bench_init_modes(compose_cfg, modes=INIT_MODES_BENCHED, phase2_steps: int | None = None) -> dict:
    """Each mode twice in a row, each in a fresh process: Phase 2 one layer after another
    (`calibration.fit=sequential`: stacks of one layer) and batched (`calibration.fit=batched`, the default); the time of
    each and batched / sequential. Then each mode's batched time and peak-memory increase over `full`'s (the budget
    full_plus is held to: at most 1.5x the time and 2x the memory of full). `phase2_steps`: every mode's Phase 2
    cut to that many steps (on a loaded machine the whole 300 can take hours; the per-step work is the same)."""
    figures, fits = {}, {}
    for mode in modes:
        steps = [] if phase2_steps is None else [f"calibration.phase2.steps={phase2_steps}"] + (
            [f"init.phase2.steps={phase2_steps}"] if mode == "full_plus" else [])
        runs = {fit: bench_init(compose_cfg(f"init={mode}", f"calibration.fit={fit}", *steps))
                for fit in ("sequential", "batched")}
        figures[mode] = runs["batched"]
        fits[mode] = {"sequential_s": runs["sequential"]["seconds"], "batched_s": runs["batched"]["seconds"],
                      "batched_over_sequential": runs["batched"]["seconds"] / runs["sequential"]["seconds"]}
    emit("init_batched_over_sequential", modes=fits, threads=torch.get_num_threads(), phase2_steps=phase2_steps,
         target="batched_over_sequential <= 0.75 on 2 CPU threads")
    base = figures["full"]
    ratios = {mode: {"time_over_full": f["seconds"] / base["seconds"],
                     "peak_increase_over_full": f["peak_increase_bytes"] / max(base["peak_increase_bytes"], 1)}
              for mode, f in figures.items()}
    return emit("init_ratios", modes=ratios, target="full_plus: time <= 1.5x, memory <= 2x full")
