"""`make gpu-check`: the GPU path on one CUDA device, most important checks first, within a time budget. One JSON
line per figure, printed and appended to a file as it comes, so a job that is killed keeps what it measured.

    make gpu-check ARGS="--budget 360"                  # what does not fit the budget is skipped, and said so
    .venv/bin/python benchmarks/gpu_check.py --only kernels,decode --gdn-kernel torch --out gpu_check.jsonl

The first line is the stack (`stack`: torch, Triton, fla, the device) and the GDN kernel the checks use
(`--gdn-kernel`, as `trainer.gdn_kernel`: auto, fla, torch; docs/gpu.md "The stack check"). Where `auto` is refused
on this stack, the line says why and every check runs on the torch path. Then, in this order:
- `kernels` (`kernel_parity`): fla's chunk kernel against the torch chunk path on the GPU at head_dim 64 and 128
  (SmolLM2's and Qwen2.5-1.5B's widths), float32 and bfloat16: the output and the gradients dq, dk, dv, dg, dbeta.
  Where fla refuses the stack, the forward is still compared and the gradients are skipped, saying why;
- `zero_shot` (`zero_shot_full`): SmolLM2 `init=full` with a short calibration (`ZERO_SHOT` settings) on the GPU:
  wall time, and the student's perplexity against the CPU figure of the same settings (within 1%);
- `calibration` (`calibration_batched`): SmolLM2 `init=full` with Phase 2 one layer after another and batched: the
  init's seconds of each (target: batched <= 20 s on an H100/H200), the student's perplexity, and each layer's loss
  after Phase 2 (within 1%);
- `stage2` (`stage2_throughput`): Stage 2 steps at 8 x 2048 tokens in bf16-mixed: tokens/s, MFU (`tcal-plan`'s
  FLOPs per token over the device's peak), peak memory, and the first step's loss against the CPU's in float32;
- `kill_resume`: a short FSDP run SIGKILLed in a child process after its first checkpoint, then resumed: its curve
  against the uninterrupted run's (within 1e-3 relative);
- `fsdp` (`fsdp_single`, `bf16_kernel_inputs`): the same Stage 2 under `trainer=fsdp trainer.devices=1` against
  `trainer=gpu` (curve within 1e-3 relative), and the dtypes fla's kernel received under bf16-mixed;
- `qwen3_8b_slice`: Qwen3-8B's width on 4 random layers, Stage 2 under the paper's distill settings: the measured
  step peak against `tcal-plan`'s (within 15%), and the peak of the stage's end and the final evaluation;
- `decode`: time per generated token at 4k, 16k and 32k tokens of context, student (ratio 0.5) against teacher;
- `qwen_width`: a random 4-layer model of Qwen2.5-1.5B's width through `full` calibration and Stage 2 steps in
  bf16-mixed (finite, and the loss falls);
- `fsdp_two` (two GPUs or more): a 2-rank FSDP2 Stage 1 then Stage 2 under the paper's checkpointing flags.

Budget: each check has a planned cost on a warm H100/H200 (`CHECKS`; predicted, not yet measured: the first GPU
session's `seconds` lines replace them). A check runs only when the budget left holds its planned cost, and gets a
deadline of `DEADLINE_FACTOR` times that cost (never past the budget); a check past its deadline is stopped and
said so, and the next one runs. Triton's compiled kernels and fla's autotune results are kept on disk in
`--triton-cache` (TRITON_CACHE_DIR; by default under the tcal cache), so a second allocation starts warm.
Without CUDA it prints one line saying so and exits 0. The exit code is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from tcal.errors import ConfigError
from tcal.store.files import check_writable, in_the_way

ROOT = Path(__file__).resolve().parents[1]
FAILED: list[str] = []
OUT: list = []  # the open JSON-lines file, once main has made it
GDN_KERNEL = {"choice": "auto"}  # the checks' trainer.gdn_kernel (main sets it from --gdn-kernel and the stack)
# The zero-shot check's run: SmolLM2 `init=full` with 30 Phase 2 steps per layer (a tenth of the default), and the
# student's held-out Shakespeare perplexity the CPU gave for exactly these settings (float32, 1 thread, 2026-12-04,
# the same 115.94 again after Phase 2 became a batched fit;
# `tcal init=full calibration.phase2.steps=30 eval/harness=none save_student=false calibration.cache=false`,
# docs/gpu.md): the GPU run must land within 1%.
ZERO_SHOT = ("init=full", "calibration.phase2.steps=30", "eval/harness=none", "save_student=false")
CPU_ZERO_SHOT_PPL = 115.94


def emit(check: str, ok: bool | None = None, **values) -> None:
    line = {"check": check, **({} if ok is None else {"ok": bool(ok)}),
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}}
    text = json.dumps(line)
    print(text, flush=True)
    for out in OUT:
        out.write(text + "\n")
        out.flush()
        os.fsync(out.fileno())
    if ok is False:
        FAILED.append(check)


def cuda_seconds(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def compose_cfg(*overrides: str):
    """The settings of `tcal <overrides>` on the checks' GDN kernel."""
    from tcal.settings.compose import settings_for

    return settings_for(*overrides, f"trainer.gdn_kernel={GDN_KERNEL['choice']}")


def check_kernels() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from tcal.student.gdn_torch import chunk_gated_delta_rule_torch
    from tcal.student.stack import gdn_kernel_for

    try:
        gdn_kernel_for("fla", True)
        refused = None
    except Exception as err:  # the stack check's one line: fla's backward would raise or compute wrong here
        refused = str(err)
    for width, heads, dim in (("smollm2", 9, 64), ("qwen2_5_1_5b", 12, 128)):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device="cuda").manual_seed(0)
            shape = (2, 2048, heads, dim)
            q, k = (torch.nn.functional.normalize(torch.randn(shape, device="cuda", generator=gen), dim=-1) for _ in "qk")
            v = torch.randn(shape, device="cuda", generator=gen)
            g = -torch.rand(shape[:3], device="cuda", generator=gen) * 0.1
            beta = torch.rand(shape[:3], device="cuda", generator=gen)
            grad_out = torch.randn(shape, device="cuda", generator=gen)

            def run(kernel, backward):
                inputs = [t.to(dtype).requires_grad_(backward) for t in (q, k, v)] + [
                    g.clone().requires_grad_(backward), beta.to(dtype).requires_grad_(backward)]
                with torch.set_grad_enabled(backward):
                    if kernel:
                        o, _ = chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], scale=dim**-0.5,
                                                      use_qk_l2norm_in_kernel=False)
                    else:
                        o, _ = chunk_gated_delta_rule_torch(*[t.float() for t in inputs[:3]], inputs[3],
                                                            inputs[4].float(), 64, dim**-0.5)
                if not backward:
                    return [o.float()]
                (o.float() * grad_out).sum().backward()
                return [o.float()] + [t.grad.float() for t in inputs]

            backward = refused is None
            fla, ours = run(True, backward), run(False, backward)
            errors = [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(fla, ours)]
            tolerance = 1e-3 if dtype == torch.float32 else 3e-2
            emit("kernel_parity", max(errors) < tolerance, width=width, head_dim=dim,
                 dtype=str(dtype).removeprefix("torch."),
                 relative_errors=dict(zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [round(e, 6) for e in errors])),
                 tolerance=tolerance, **({} if backward else {"gradients_skipped": refused}))


def check_zero_shot() -> None:
    from tcal.pipeline import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_cfg(*ZERO_SHOT, "trainer=gpu", f"paths.cache_dir={tmp}/cache")
        start = time.perf_counter()
        results = run(cfg, Path(tmp) / "run")
        wall = time.perf_counter() - start
    ppl = results["metrics"]["shakespeare"]["student_ppl"]
    emit("zero_shot_full", abs(ppl / CPU_ZERO_SHOT_PPL - 1) < 0.01, wall_s=wall, student_ppl=ppl,
         cpu_student_ppl=CPU_ZERO_SHOT_PPL, settings=" ".join(ZERO_SHOT),
         teacher_ppl=results["metrics"]["shakespeare"]["teacher_ppl"], init_s=results["timings"]["init"],
         evaluate_s=results["timings"]["evaluate"], kernel_path=results["kernel_path"])


def check_calibration() -> None:
    """SmolLM2 `init=full` on the GPU with Phase 2 one layer after another and batched (every layer in one stack):
    each run's init seconds (target: batched <= 20 s on an H100/H200) and student perplexity, and each layer's
    Phase 2 loss after, batched against one by one (within 1%: GPU rounding, amplified by 300 Adam steps)."""
    from tcal.pipeline import run

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fit in ("sequential", "batched"):
            cfg = compose_cfg("init=full", "trainer=gpu", "eval/harness=none", "save_student=false",
                              "calibration.cache=false", f"calibration.fit={fit}", f"paths.cache_dir={tmp}/cache")
            results[fit] = run(cfg, Path(tmp) / fit)
    layers = {fit: r["calibration"]["layers"] for fit, r in results.items()}
    gap = max(abs(layers["batched"][i]["phase2"]["loss_after"] / layers["sequential"][i]["phase2"]["loss_after"] - 1)
              for i in layers["sequential"])
    seconds = {fit: r["timings"]["init"] for fit, r in results.items()}
    emit("calibration_batched", seconds["batched"] <= 20 and gap < 0.01, init_s=seconds,
         batched_over_sequential=seconds["batched"] / seconds["sequential"], loss_after_max_relative_gap=gap,
         student_ppl={fit: r["metrics"]["shakespeare"]["student_ppl"] for fit, r in results.items()},
         target_init_s=20)


def smollm2_pair(ratio: float = 0.5):
    from tcal.retention.uniform import uniform_layers
    from tcal.student.convert import build_student
    from tcal.student.gdn import use_gdn_kernel
    from tcal.student.stack import gdn_kernel_for
    from tcal.teachers.load import load_teacher

    cfg = compose_cfg()
    teacher, _ = load_teacher(cfg.teacher, cfg.paths.cache_dir)
    student = build_student(teacher, uniform_layers(teacher.config.num_hidden_layers, ratio))
    return teacher, use_gdn_kernel(student, gdn_kernel_for(str(cfg.trainer.gdn_kernel), True))


def distill_module(teacher, student, steps: int):
    from tcal.training.stages import DistillStage

    return DistillStage(student, teacher, compose_cfg("stage=distill").stage, steps)


# Peak dense bfloat16 tensor throughput of SXM parts (vendor data sheets), for MFU; a device not named here gets none.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
STAGE2_SHAPE = ("stage=distill", "stage.batch_size=8", "stage.seq_len=2048", "trainer=gpu",
                "trainer.precision=bf16-mixed")


def stage2_flops_per_token() -> float:
    """`tcal-plan`'s training FLOPs per token of SmolLM2's Stage 2 at 8 x 2048 (`FLOPS_FORMULA`)."""
    from tcal.tools.plan import make_plan

    return make_plan(compose_cfg(*STAGE2_SHAPE))["hours"]["stages"]["distill"]["flops_per_token"]


def check_stage2(steps: int = 24, warmup: int = 4, batch: int = 8, seq_len: int = 2048) -> None:
    """Tokens/s over the steps after `warmup` (kernels compiled and tuned by then), MFU from them."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    teacher, student = smollm2_pair()
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(3, teacher.config.vocab_size, (steps * batch, seq_len), generator=gen)
    with torch.no_grad():  # the first step's loss on the CPU, float32, same weights and batch
        cpu_loss = distill_module(teacher, student, steps).loss(batches[:batch])[0].item()
    module = distill_module(teacher.cuda(), student.cuda(), steps)
    losses, ends = [], []
    original = module.loss
    module.loss = lambda b: (lambda out: (losses.append(out[0].item()), out)[1])(original(b))

    class StepEnds(Callback):
        def on_train_batch_end(self, *args):
            torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, callbacks=[StepEnds()])
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(batches, batch_size=batch))
    tokens_per_s = (steps - warmup) * batch * seq_len / (ends[-1] - ends[warmup - 1])
    name = torch.cuda.get_device_name()
    peak = next((tflops for part, tflops in PEAK_BF16_TFLOPS.items() if part in name), None)
    flops_per_token = stage2_flops_per_token()
    emit("stage2_throughput", abs(losses[0] / cpu_loss - 1) < 0.05 and all(map(math.isfinite, losses)),
         steps=steps, timed_steps=steps - warmup, batch=batch, seq_len=seq_len, tokens_per_s=tokens_per_s,
         flops_per_token=flops_per_token, peak_bf16_tflops=peak,
         mfu=tokens_per_s * flops_per_token / (peak * 1e12) if peak else None,
         peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30, first_loss_gpu_bf16=losses[0],
         first_loss_cpu_fp32=cpu_loss, last_loss=losses[-1])


@torch.no_grad()
def decode_seconds(model, context: int, new_tokens: int = 32) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, context), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(new_tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_decode() -> None:
    teacher, student = smollm2_pair()
    teacher, student = teacher.to("cuda", torch.bfloat16), student.to("cuda", torch.bfloat16)
    for context in (4096, 16384, 32768):
        t, s = decode_seconds(teacher, context), decode_seconds(student, context)
        emit("decode", None, context=context, teacher_s=t, student_s=s, ratio=s / t)


def check_qwen_width() -> None:
    from tcal.pipeline import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_cfg("teacher=tiny_qwen2", "teacher.config.hidden_size=1536", "teacher.config.intermediate_size=8960",
                          "teacher.config.num_attention_heads=12", "teacher.config.num_key_value_heads=2",
                          "teacher.config.head_dim=128", "teacher.config.vocab_size=151936", "teacher.dtype=bfloat16",
                          "init=full", "calibration.phase2.steps=20", "trainer=gpu", "stage=distill",
                          "stage.max_tokens=65536", "stage.eval_every_tokens=32768", "stage.batch_size=4",
                          "stage.seq_len=2048", "eval/harness=none", "eval.num_windows=4", "save_student=false",
                          f"paths.cache_dir={tmp}/cache")
        start = time.perf_counter()
        results = run(cfg, Path(tmp) / "run")
    record = results["stages"]["distill"]
    finite = all(math.isfinite(x) for x in (record["loss_first"], record["loss_last"]))
    emit("qwen_width", finite and record["loss_last"] < record["loss_first"], wall_s=time.perf_counter() - start,
         loss_first=record["loss_first"], loss_last=record["loss_last"], steps=record["steps"],
         init_s=results["timings"]["init"])


# A short Stage 2 on a tiny random Qwen2 teacher: 16 steps of 4 x 512 tokens, a curve point and checkpoint every 4.
SCRATCH: list[Path] = []  # the check session's scratch folder (main makes it): runs and the cache they share
STRAIGHT_FSDP: dict = {}
SHORT_STAGE2 = ["teacher=tiny_qwen2", "init=naive", "stage=distill", "stage.max_tokens=32768",
                "stage.eval_every_tokens=8192", "stage.batch_size=4", "stage.seq_len=512", "eval/harness=none",
                "eval.num_windows=4", "save_student=false", "logger=none"]
KILL_AT_STEP = 6  # after the checkpoint at step 4, before the one at step 8


def short_stage2_cfg(cache_dir, *overrides: str):
    return compose_cfg(*SHORT_STAGE2, f"paths.cache_dir={cache_dir}", *overrides)


def curve_gap(a: dict, b: dict) -> float:
    """Largest relative difference between two records' curves (same eval sets, same points)."""
    if a.keys() != b.keys() or any(len(a[k]) != len(b[k]) for k in a):
        return math.inf
    return max(abs(p["ppl"] / q["ppl"] - 1) for k in a for p, q in zip(a[k], b[k]))


class KernelInputs:
    """Records the dtypes of q, k, v that fla's chunk kernel receives while installed."""

    def __init__(self):
        import fla.ops.gated_delta_rule as fla_rule

        self.module, self.original, self.dtypes = fla_rule, fla_rule.chunk_gated_delta_rule, set()

    def __enter__(self):
        def recording(q, k, v, *args, **kwargs):
            if torch.is_grad_enabled():
                self.dtypes.add(tuple(str(t.dtype).removeprefix("torch.") for t in (q, k, v)))
            return self.original(q, k, v, *args, **kwargs)

        self.module.chunk_gated_delta_rule = recording
        return self

    def __exit__(self, *exc):
        self.module.chunk_gated_delta_rule = self.original


def straight_fsdp() -> dict:
    """The short Stage 2 under `trainer=fsdp trainer.devices=1`, uninterrupted, with the dtypes fla's kernel got: run
    once, for `fsdp` and `kill_resume` both."""
    from tcal.pipeline import run

    if "record" not in STRAIGHT_FSDP:
        with KernelInputs() as inputs:
            STRAIGHT_FSDP["record"] = run(short_stage2_cfg(SCRATCH[0] / "cache", "trainer=fsdp", "trainer.devices=1"),
                                          SCRATCH[0] / "fsdp_straight")
        STRAIGHT_FSDP["kernel_dtypes"] = inputs.dtypes
    return STRAIGHT_FSDP["record"]


def check_fsdp_single() -> None:
    from tcal.pipeline import run

    single = run(short_stage2_cfg(SCRATCH[0] / "cache", "trainer=gpu", "trainer.precision=bf16-mixed"),
                 SCRATCH[0] / "gpu_single")
    fsdp = straight_fsdp()
    gap = curve_gap(fsdp["curve"], single["curve"])
    emit("fsdp_single", gap < 1e-3, curve_relative_gap=gap, loss_last_fsdp=fsdp["stages"]["distill"]["loss_last"],
         loss_last_gpu=single["stages"]["distill"]["loss_last"])
    dtypes = STRAIGHT_FSDP["kernel_dtypes"]
    if fsdp["kernel_path"] == "fla-triton-chunk":
        emit("bf16_kernel_inputs", dtypes == {("bfloat16",) * 3}, seen=sorted(dtypes))
    else:
        emit("bf16_kernel_inputs", None, skipped=f"the run's kernel path is {fsdp['kernel_path']}, not fla's")


def sigkill_at(step: int):
    """A Lightning callback that SIGKILLs its own process once training reaches `step` (nothing after it runs)."""
    from lightning.pytorch.callbacks import Callback

    class SigkillAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step >= step:
                os.kill(os.getpid(), signal.SIGKILL)

    return SigkillAt()


def killed_child(run_dir: str, cache_dir: str) -> None:
    """`gpu_check.py --killed-child RUN CACHE`: the FSDP run, SIGKILLed at KILL_AT_STEP."""
    from tcal.pipeline import run

    run(short_stage2_cfg(cache_dir, "trainer=fsdp", "trainer.devices=1"), Path(run_dir),
        callbacks=[sigkill_at(KILL_AT_STEP)])


def check_kill_resume() -> None:
    import subprocess

    from tcal.pipeline import run

    run_dir, cache = SCRATCH[0] / "killed", str(SCRATCH[0] / "cache")
    child = subprocess.run([sys.executable, __file__, "--killed-child", str(run_dir), cache, "--gdn-kernel",
                            GDN_KERNEL["choice"]], capture_output=True, text=True, timeout=max(seconds_left(), 1))
    checkpoints = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("last*"))
    resumed = run(short_stage2_cfg(cache, "trainer=fsdp", "trainer.devices=1"), run_dir, resume=True)
    gap = curve_gap(resumed["curve"], straight_fsdp()["curve"])
    emit("kill_resume", child.returncode == -9 and gap < 1e-3, child_exit=child.returncode,
         checkpoints_at_kill=checkpoints, curve_relative_gap=gap,
         child_stderr_tail=child.stderr[-300:] if child.returncode != -9 else "")


PAPER = "experiment=qwen3_8b_uniform_r025_align_distill"
# Qwen3-8B's width (its published config.json) on 4 random layers: one kept softmax layer, three GDN at ratio 0.25.
QWEN3_8B_SLICE = ["teacher=tiny_qwen3", "teacher.config.hidden_size=4096", "teacher.config.intermediate_size=12288",
                  "teacher.config.num_attention_heads=32", "teacher.config.num_key_value_heads=8",
                  "teacher.config.head_dim=128", "teacher.config.vocab_size=151936",
                  "teacher.config.max_position_embeddings=40960", "teacher.config.tie_word_embeddings=false",
                  "teacher.dtype=bfloat16", "retention.ratio=0.25", "init=naive"]
SLICE_STEPS = 4


def paper_stage_overrides(kind: str, steps: int, ranks: int = 1) -> list[str]:
    """The paper experiment's settings of stage `kind` (batch, length, checkpointing, lr), with a budget of `steps`."""
    node = getattr(compose_cfg(PAPER).stage, kind)
    tokens = steps * node.batch_size * node.seq_len * ranks
    keys = ("batch_size", "seq_len", "checkpoint_mixers", "activation_checkpointing", "fused_optimizer", "lr_mixer",
            "lr") if kind == "distill" else ("batch_size", "seq_len", "checkpoint_mixers", "lr")
    values = {key: getattr(node, key) for key in keys if hasattr(node, key)}
    return [f"stage.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in
            values.items()] + [f"stage.max_tokens={tokens}", f"stage.eval_every_tokens={tokens}"]


def slice_settings(cache_dir: str, device: str = "gpu"):
    """The Qwen3-8B-width slice's Stage 2 under the paper's distill settings, bf16-mixed on one device."""
    return compose_cfg(*QWEN3_8B_SLICE, "stage=distill", *paper_stage_overrides("distill", SLICE_STEPS),
                       f"trainer={device}", "trainer.precision=bf16-mixed", "eval/harness=none",
                       "eval.num_windows=1", "eval.seq_len=2048", "save_student=false", "logger=none",
                       f"paths.cache_dir={cache_dir}")


class StepPeak:
    """A Lightning callback keeping the CUDA allocator's peak over the training steps, then resetting it, so that
    what the stage's end and the final evaluation reach is measured apart."""

    def __new__(cls):
        from lightning.pytorch.callbacks import Callback

        class _StepPeak(Callback):
            peak = 0

            def on_train_start(self, trainer, module):
                torch.cuda.reset_peak_memory_stats()

            def on_train_end(self, trainer, module):
                _StepPeak.peak = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        return _StepPeak()


def check_qwen3_8b_slice() -> None:
    """A Qwen3-8B-width slice's Stage 2 step peak against `tcal-plan` (within 15%), and what the stage's end and the
    final evaluation reach."""
    from tcal.pipeline import run
    from tcal.tools.plan import make_plan

    with tempfile.TemporaryDirectory() as tmp:
        settings = slice_settings(f"{tmp}/cache")
        planned = make_plan(settings)["stages"]["distill"]
        step = StepPeak()
        results = run(settings, Path(tmp) / "run", callbacks=[step])
        after_step = torch.cuda.max_memory_allocated()
    measured, predicted = step.peak / 2**30, planned["peak_gb"]
    emit("qwen3_8b_slice", abs(measured / predicted - 1) <= 0.15, step_peak_gb=measured,
         planned_step_peak_gb=predicted, stage_end_and_eval_peak_gb=after_step / 2**30,
         steps=results["stages"]["distill"]["steps"], loss_last=results["stages"]["distill"]["loss_last"])


def two_rank_command(run_dir: str, cache_dir: str) -> list[str]:
    """`tcal` for a 2-rank FSDP align_distill of a tiny Qwen2 under the paper's stage flags, bf16-mixed."""
    align = [f"stage.align.{o.removeprefix('stage.')}" for o in paper_stage_overrides("align", 4, 2)]
    distill = [f"stage.distill.{o.removeprefix('stage.')}" for o in paper_stage_overrides("distill", 4, 2)]
    shorter = ["stage.align.seq_len=512", "stage.align.max_tokens=16384", "stage.align.eval_every_tokens=8192",
               "stage.distill.seq_len=1024", "stage.distill.max_tokens=32768", "stage.distill.eval_every_tokens=16384",
               "stage.align.batch_size=4", "stage.distill.batch_size=4"]
    return [sys.executable, "-m", "tcal.cli.app", "teacher=tiny_qwen2", "init=naive", "stage=paper", *align, *distill,
            *shorter, "trainer=fsdp", "trainer.accelerator=gpu", "trainer.devices=2", "trainer.precision=bf16-mixed",
            "eval/harness=none", "eval.num_windows=4", "save_student=false", "logger=none",
            f"trainer.gdn_kernel={GDN_KERNEL['choice']}", f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}"]


def check_fsdp_two() -> None:
    """Two ranks, FSDP2, Stage 1 then Stage 2 with the paper's checkpointing flags (GPUs 0 and 1)."""
    import subprocess

    if torch.cuda.device_count() < 2:
        emit("fsdp_two", None, skipped=f"{torch.cuda.device_count()} GPU visible; two are needed")
        return
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(two_rank_command(f"{tmp}/run", f"{tmp}/cache"), capture_output=True, text=True,
                              timeout=max(seconds_left(), 1), cwd=ROOT)
        record = json.loads((Path(tmp) / "run" / "results.json").read_text()) if done.returncode == 0 else {}
    stages = record.get("stages", {})
    losses = [stages.get(kind, {}).get(key) for kind in ("align", "distill") for key in ("loss_first", "loss_last")]
    ok = record.get("status") == "complete" and all(x is not None and math.isfinite(x) for x in losses)
    emit("fsdp_two", ok and losses[3] < losses[2], exit=done.returncode, losses=losses,
         stderr_tail=done.stderr[-300:] if done.returncode else "")


# (name, function, planned seconds on a warm H100/H200): the order they run in, most important first. The planned
# costs are predictions (no GPU session has measured these checks at these sizes yet); each check's measured
# `seconds` line is what to put here once one has.
CHECKS = (("kernels", check_kernels, 45), ("zero_shot", check_zero_shot, 60), ("stage2", check_stage2, 45),
          ("kill_resume", check_kill_resume, 60), ("fsdp", check_fsdp_single, 30),
          ("qwen3_8b_slice", check_qwen3_8b_slice, 45), ("decode", check_decode, 40),
          ("qwen_width", check_qwen_width, 45), ("calibration", check_calibration, 200),
          ("fsdp_two", check_fsdp_two, 90))
DEADLINE_FACTOR = 3
DEADLINE: list[float] = []  # perf_counter time at which the running check is stopped


class PastDeadline(Exception):
    pass


def seconds_left() -> float:
    return DEADLINE[0] - time.perf_counter() if DEADLINE else math.inf


@contextmanager
def deadline(seconds: float):
    """Stop the block with PastDeadline after `seconds` (SIGALRM: Python code, or the next return from C code)."""
    def stop(*_):
        raise PastDeadline(f"past its deadline of {seconds:.0f} s")

    DEADLINE[:] = [time.perf_counter() + seconds]
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        DEADLINE.clear()


def check_stack(choice: str) -> str:
    """The `stack` line, and the kernel the checks use: `choice`, or `torch` where `auto` is refused here (said)."""
    from tcal.student.gdn import kernel_path
    from tcal.student.stack import gdn_kernel_for, read_stack

    stack = read_stack()
    facts = dict(device=stack.device_name, capability=".".join(map(str, stack.capability)), torch=stack.torch,
                 triton=stack.triton, fla=stack.fla, tilelang=stack.tilelang, gdn_kernel=choice)
    try:
        emit("stack", None, kernel_path=kernel_path("cuda", gdn_kernel_for(choice, True)), **facts)
        return choice
    except ConfigError as err:
        if choice != "auto":
            raise
        emit("stack", None, refused=str(err), kernel_path=kernel_path("cuda", "torch"),
             note="auto is refused on this stack: every check runs with trainer.gdn_kernel=torch", **facts)
        return "torch"


def out_path(path: str | None) -> Path:
    """The JSON-lines file every line is appended to: `path`, or outputs/gpu_check/<UTC time>.jsonl."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(path) if path else ROOT / "outputs" / "gpu_check" / f"{stamp}.jsonl"


def out_problem(target: Path) -> str | None:
    """Why lines cannot be appended to `target` (None: they can), found without writing it: a folder there, a file
    on its way, a folder this user cannot write in, a file this user cannot write."""
    if target.is_dir():
        return f"{target} is a folder; expected a file to append JSON lines to"
    blocker = in_the_way(target.parent)
    if blocker is not None:
        return f"{blocker} is a file; expected a folder there (writing {target})"
    try:
        check_writable(target.parent)
    except ConfigError as err:
        return str(err)
    if target.exists() and not os.access(target, os.W_OK):
        return f"{target} cannot be written by this user; expected a file this user can write"
    return None


def open_out(target: Path):
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.open("a", encoding="utf-8")


def default_triton_cache() -> Path:
    return Path(os.environ.get("TCAL_CACHE_DIR") or ROOT / ".cache" / "tcal") / "triton"


def main(argv=None) -> int:
    names = [name for name, _, _ in CHECKS]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(names), help=f"comma list of {', '.join(names)}")
    parser.add_argument("--budget", type=float, default=math.inf, metavar="SECONDS",
                        help="wall seconds for every check together; what does not fit is skipped, and said so")
    parser.add_argument("--gdn-kernel", choices=("auto", "fla", "torch"), default="auto",
                        help="trainer.gdn_kernel of every check (auto: fla where this stack is safe for it)")
    parser.add_argument("--out", help="the JSON-lines file (default outputs/gpu_check/<UTC time>.jsonl)")
    parser.add_argument("--triton-cache", default=None, metavar="DIR",
                        help="TRITON_CACHE_DIR: compiled kernels and fla's autotune results, kept between allocations "
                             "(default: <tcal cache>/triton)")
    parser.add_argument("--killed-child", nargs=2, metavar=("RUN_DIR", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(names))
    if unknown:
        parser.error(f"--only {args.only}: no check named {', '.join(unknown)}; expected some of {', '.join(names)}")
    if not args.budget > 0:
        parser.error(f"--budget {args.budget}: expected a positive number of seconds")
    out = out_path(args.out)
    problem = out_problem(out)
    if problem:
        parser.error(f"--out {problem}")
    triton_cache = Path(args.triton_cache or default_triton_cache()).resolve()
    if in_the_way(triton_cache) is not None:
        parser.error(f"--triton-cache {triton_cache}: {in_the_way(triton_cache)} is a file; expected a folder")
    try:
        check_writable(triton_cache)
    except ConfigError as err:
        parser.error(f"--triton-cache {err}")
    os.environ["TRITON_CACHE_DIR"] = str(triton_cache)
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    GDN_KERNEL["choice"] = args.gdn_kernel
    if args.killed_child:
        killed_child(*args.killed_child)
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "skipped": "no CUDA device visible; nothing to check here"}), flush=True)
        return 0
    try:
        OUT.append(open_out(out))
    except OSError as err:
        parser.error(f"--out {out}: cannot be written ({err.strerror or type(err).__name__})")
    started = time.perf_counter()
    emit("gpu", None, out=OUT[0].name, budget_s=args.budget, triton_cache=os.environ["TRITON_CACHE_DIR"])
    GDN_KERNEL["choice"] = check_stack(args.gdn_kernel)
    with tempfile.TemporaryDirectory() as scratch:
        SCRATCH[:] = [Path(scratch)]
        for name, check, planned in CHECKS:
            if name not in args.only.split(","):
                continue
            left = args.budget - (time.perf_counter() - started)
            if left < planned:
                emit(name, None, skipped=f"needs about {planned} s (planned), {max(left, 0):.0f} s of the budget left")
                continue
            start = time.perf_counter()
            try:
                with deadline(min(DEADLINE_FACTOR * planned, left)):
                    check()
            except Exception as err:  # one broken check must not hide the others' figures
                emit(name, False, error=f"{type(err).__name__}: {err}"[:2000])
            emit(name, None, seconds=round(time.perf_counter() - start, 1), planned_s=planned)
    emit("gpu", None, seconds=round(time.perf_counter() - started, 1), failed=FAILED)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
