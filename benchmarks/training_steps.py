"""The training-step benchmarks: `stage1` / `stage2` (a step against its parts measured apart, and the process's
peak RSS), `stage2_plain` (the same step with full-batch logits and an unchunked KL, for the memory comparison),
`plan` (`tcal-plan`'s Stage 2 peak against the measured one) and `kl_memory` (the fused KL's extra peak memory)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from measurement import best_time, emit, fit_step_time, in_fresh_process, peak_rss_gb, reset_peak_rss, rss_kib

from tcal.training.stages import AlignStage, DistillStage


def stage_config(kind: str, overrides=()):
    """src/tcal/conf/stage/<kind>.yaml with the `stage.*` entries of `overrides` applied."""
    from tcal.settings.compose import settings_for

    return settings_for(f"stage={kind}", *(o for o in overrides if o.startswith("stage."))).stage


def stage_setup(teacher, kind: str, keep_layers, batch: int, seq_len: int, steps: int, overrides=()):
    from tcal.student.convert import build_student

    cfg = stage_config(kind, overrides)
    student = build_student(teacher, keep_layers)
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, teacher.config.vocab_size, (steps * batch, seq_len), generator=gen)
    return cfg, student, batches


def bench_stage2(teacher, keep_layers, batch=4, seq_len=512, steps=3, plain=False, overrides=()) -> dict:
    """A Stage 2 step against (teacher forward + student forward+backward) on the same batch, and peak RSS."""
    cfg, student, batches = stage_setup(teacher, "distill", keep_layers, batch, seq_len, steps, overrides)
    module = (PlainDistill if plain else DistillStage)(student, teacher, cfg, steps)
    step = fit_step_time(module, batches, batch)
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
    from tcal.student.convert import build_student
    from tcal.teachers.load import load_teacher

    base = rss_kib("VmRSS") * 1024
    teacher, _ = load_teacher(cfg.teacher, cfg.paths.cache_dir)
    student = build_student(teacher, keep_layers)
    steps = int(cfg.stage.max_tokens) // (int(cfg.stage.batch_size) * int(cfg.stage.seq_len))
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, teacher.config.vocab_size, (steps * int(cfg.stage.batch_size), int(cfg.stage.seq_len)),
                            generator=gen)
    module = DistillStage(student, teacher, cfg.stage, steps)
    reset_peak_rss()
    step_s = fit_step_time(module, batches, int(cfg.stage.batch_size))
    return {"measured_increase_bytes": rss_kib("VmHWM") * 1024 - base, "step_s": step_s}


# glibc's malloc maps blocks of 128 KiB and more on their own and unmaps them when freed (by default it raises that
# threshold as blocks are freed and keeps freed memory in its heap): resident memory then follows live tensors.
EAGER_RELEASE = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def bench_plan(overrides=(), batch: int = PLAN_BATCH[0], seq_len: int = PLAN_BATCH[1], steps: int = 2) -> dict:
    """`tcal-plan`'s Stage 2 peak for the CPU against the peak RSS increase of the same short Stage 2, measured in a
    fresh process twice: with glibc releasing freed blocks at once (`EAGER_RELEASE`: the memory allocated, which is
    what the plan counts and what the target is about) and with glibc's defaults (what a CPU run shows; the
    difference is free memory glibc keeps). SmolLM2 by default: the real teacher, float32."""
    from tcal.settings.compose import settings_for
    from tcal.tools.plan import make_plan
    from tcal.tools.plan.memory import GB

    cfg = settings_for(*plan_overrides(overrides, batch, seq_len, steps))
    plan = make_plan(cfg)
    stage = plan["stages"]["distill"]
    keep = plan["retention"]["keep_layers"]
    if keep is None:
        raise ValueError(f"make bench ARGS=plan: retention={plan['retention']['policy']} scores layers; "
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
    from tcal.student.alignment import alignment_loss, capture_teacher_io

    cfg, student, batches = stage_setup(teacher, "align", keep_layers, batch, seq_len, steps, overrides)
    module = AlignStage(student, teacher, cfg, steps)
    step = fit_step_time(module, batches, batch)
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


def kl_memory_child(vocab: int, hidden_size: int, tokens: int, chunk: int, dtype_name: str):
    """One fused-KL forward+backward on random heads: (peak resident growth over the loaded tensors, the head
    gradient's bytes, seconds)."""
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
    before = reset_peak_rss()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    gradient_bytes = heads[0].weight.grad.numel() * heads[0].weight.grad.element_size()
    return (rss_kib("VmHWM") * 1024) - before, gradient_bytes, seconds


def bench_kl_memory(vocab: int = 151_936, hidden_size: int = 1024, tokens: int = 1024, chunk: int = 256) -> list[dict]:
    """Peak memory one fused-KL step adds to its inputs and heads, for a Qwen-sized vocabulary: the head's
    gradient (which any backward makes) and, beyond it, how many chunks of float32 logits (chunk x vocab x 4
    bytes). Each dtype in a fresh process (peak RSS is per process)."""
    lines = []
    for dtype_name in ("float32", "bfloat16"):
        extra, gradient_bytes, seconds = in_fresh_process(kl_memory_child, vocab, hidden_size, tokens, chunk,
                                                          dtype_name)
        chunk_bytes = chunk * vocab * 4
        beyond = extra - gradient_bytes
        lines.append(emit(f"kl_memory_{dtype_name}", vocab=vocab, hidden=hidden_size, tokens=tokens, chunk=chunk,
                          extra_peak_gb=extra / 2**30, head_gradient_gb=gradient_bytes / 2**30,
                          beyond_gradient_gb=beyond / 2**30, float32_chunk_gb=chunk_bytes / 2**30,
                          beyond_gradient_in_chunks=beyond / chunk_bytes, seconds=seconds,
                          target="beyond_gradient_in_chunks about 2-3 (a head copy would add vocab x hidden)"))
    return lines

