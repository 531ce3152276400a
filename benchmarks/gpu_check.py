"""`make gpu-check`: the paper-scale path on one CUDA GPU, in a few minutes, one JSON line per figure.

    make gpu-check                      # or: .venv/bin/python benchmarks/gpu_check.py [--only kernels,decode]

Checks, each a line with `"ok": true|false` (the exit code is 1 when any is false):
- `kernel_parity`: fla's chunk kernel against the torch chunk path (the CPU path, run on the GPU) at SmolLM2 and
  Qwen2.5-1.5B widths, forward and gradients, bfloat16 and float32;
- `zero_shot_full`: SmolLM2 `init=full` on the GPU (calibration, evaluation): wall time, and the student's
  perplexity against the CPU run's figure (within 1%);
- `calibration_batched`: SmolLM2 `init=full` with Phase 2 one layer after another and batched: the init's
  seconds of each (target: batched <= 20 s on an H100/H200), the student's perplexity, and each layer's loss after
  Phase 2 (within 1%);
- `stage2_throughput`: 50 Stage 2 steps at 8 x 2048 tokens in bf16-mixed: tokens/s, peak memory, and the first
  step's loss against the same step in float32 on the CPU;
- `decode`: time per generated token at 4k, 16k and 32k tokens of context, student (ratio 0.5) against teacher;
- `qwen_width`: a random 4-layer model of Qwen2.5-1.5B's width through `full` calibration and Stage 2 steps in
  bf16-mixed (finite, and the loss falls);
- `fsdp_single`: a short Stage 2 under `trainer=fsdp trainer.devices=1` (FSDP2 units, one rank) against the same run
  under `trainer=gpu` (curve within 1e-3 relative), and `bf16_kernel_inputs`: the dtypes fla's chunk kernel
  received during the FSDP run's training under bf16-mixed (bfloat16 q, k, v expected);
- `kill_resume`: the FSDP run SIGKILLed in a child process after its first checkpoint, then resumed: its curve
  against the uninterrupted run's (within 1e-3 relative);
- `qwen3_8b_slice`: Qwen3-8B's width on 4 random layers, Stage 2 under the paper's distill settings (batch, 4,096
  tokens, layer checkpointing) in bf16-mixed: the measured step peak against `tcal-plan`'s (within 15%), and the peak
  of the stage's end and the final evaluation;
- `fsdp_two` (two GPUs or more): a 2-rank FSDP2 Stage 1 then Stage 2 under the paper's checkpointing flags in
  bf16-mixed completes, finite, with a falling Stage 2 loss.
Without CUDA it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

# `tcal init=full` on SmolLM2-135M, CPU, float32, uniform 0.5, held-out Shakespeare 16 x 512 (results.json of
# `make run`; docs/results.md): the figure the GPU run must reproduce within 1%.
CPU_FULL_STUDENT_PPL = 70.68
ROOT = Path(__file__).resolve().parents[1]
FAILED: list[str] = []


def emit(check: str, ok: bool | None = None, **values) -> None:
    line = {"check": check, **({} if ok is None else {"ok": bool(ok)}),
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()}}
    print(json.dumps(line), flush=True)
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
    from tcal.settings.compose import settings_for

    return settings_for(*overrides)


def check_kernels() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from tcal.student.gdn import chunk_gated_delta_rule_torch

    for width, heads, dim in (("smollm2", 9, 64), ("qwen2_5_1_5b", 12, 128)):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device="cuda").manual_seed(0)
            shape = (2, 2048, heads, dim)
            q, k = (torch.nn.functional.normalize(torch.randn(shape, device="cuda", generator=gen), dim=-1) for _ in "qk")
            v = torch.randn(shape, device="cuda", generator=gen)
            g = -torch.rand(shape[:3], device="cuda", generator=gen) * 0.1
            beta = torch.rand(shape[:3], device="cuda", generator=gen)
            grad_out = torch.randn(shape, device="cuda", generator=gen)

            def run(kernel):
                inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [g.clone().requires_grad_(),
                                                                             beta.to(dtype).requires_grad_()]
                if kernel:
                    o, _ = chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], scale=dim**-0.5,
                                                  use_qk_l2norm_in_kernel=False)
                else:
                    o, _ = chunk_gated_delta_rule_torch(*[t.float() for t in inputs[:3]], inputs[3],
                                                        inputs[4].float(), 64, dim**-0.5)
                (o.float() * grad_out).sum().backward()
                return [o.float()] + [t.grad.float() for t in inputs]

            fla, ours = run(True), run(False)
            errors = [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(fla, ours)]
            tolerance = 1e-3 if dtype == torch.float32 else 3e-2
            emit("kernel_parity", max(errors) < tolerance, width=width, dtype=str(dtype).removeprefix("torch."),
                 relative_errors=dict(zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [round(e, 6) for e in errors])),
                 tolerance=tolerance)


def check_zero_shot() -> None:
    from tcal.pipeline import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_cfg("init=full", "trainer=gpu", "eval/harness=none", "save_student=false",
                          f"paths.cache_dir={tmp}/cache")
        start = time.perf_counter()
        results = run(cfg, Path(tmp) / "run")
        wall = time.perf_counter() - start
    ppl = results["metrics"]["shakespeare"]["student_ppl"]
    emit("zero_shot_full", abs(ppl / CPU_FULL_STUDENT_PPL - 1) < 0.01, wall_s=wall, student_ppl=ppl,
         cpu_student_ppl=CPU_FULL_STUDENT_PPL, teacher_ppl=results["metrics"]["shakespeare"]["teacher_ppl"],
         init_s=results["timings"]["init"], evaluate_s=results["timings"]["evaluate"],
         kernel_path=results["kernel_path"])


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
    from tcal.teachers.load import load_teacher

    cfg = compose_cfg()
    teacher, _ = load_teacher(cfg.teacher, cfg.paths.cache_dir)
    student = build_student(teacher, uniform_layers(teacher.config.num_hidden_layers, ratio))
    return teacher, student


def distill_module(teacher, student, steps: int):
    from tcal.training.stages import DistillStage

    return DistillStage(student, teacher, compose_cfg("stage=distill").stage, steps)


def check_stage2(steps: int = 50, batch: int = 8, seq_len: int = 2048) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    teacher, student = smollm2_pair()
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(3, teacher.config.vocab_size, (steps * batch, seq_len), generator=gen)
    with torch.no_grad():  # the first step's loss on the CPU, float32, same weights and batch
        cpu_loss = distill_module(teacher, student, steps).loss(batches[:batch])[0].item()
    module = distill_module(teacher.cuda(), student.cuda(), steps)
    losses = []
    original = module.loss
    module.loss = lambda b: (lambda out: (losses.append(out[0].item()), out)[1])(original(b))
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, DataLoader(batches, batch_size=batch))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    emit("stage2_throughput", abs(losses[0] / cpu_loss - 1) < 0.05 and all(map(math.isfinite, losses)),
         steps=steps, batch=batch, seq_len=seq_len, tokens_per_s=steps * batch * seq_len / wall,
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


def check_fsdp_single() -> None:
    from tcal.pipeline import run

    with tempfile.TemporaryDirectory() as tmp:
        single = run(short_stage2_cfg(f"{tmp}/cache", "trainer=gpu", "trainer.precision=bf16-mixed"),
                     Path(tmp) / "gpu")
        with KernelInputs() as inputs:
            fsdp = run(short_stage2_cfg(f"{tmp}/cache", "trainer=fsdp", "trainer.devices=1"), Path(tmp) / "fsdp")
    gap = curve_gap(fsdp["curve"], single["curve"])
    emit("fsdp_single", gap < 1e-3, curve_relative_gap=gap, loss_last_fsdp=fsdp["stages"]["distill"]["loss_last"],
         loss_last_gpu=single["stages"]["distill"]["loss_last"])
    emit("bf16_kernel_inputs", inputs.dtypes == {("bfloat16",) * 3}, seen=sorted(inputs.dtypes))


def sigkill_at(step: int):
    """A Lightning callback that SIGKILLs its own process once training reaches `step` (nothing after it runs)."""
    import os
    import signal

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

    with tempfile.TemporaryDirectory() as tmp:
        run_dir, cache = Path(tmp) / "killed", f"{tmp}/cache"
        child = subprocess.run([sys.executable, __file__, "--killed-child", str(run_dir), cache],
                               capture_output=True, text=True, timeout=900)
        checkpoints = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("last*"))
        resumed = run(short_stage2_cfg(cache, "trainer=fsdp", "trainer.devices=1"), run_dir, resume=True)
        straight = run(short_stage2_cfg(cache, "trainer=fsdp", "trainer.devices=1"), Path(tmp) / "straight")
    gap = curve_gap(resumed["curve"], straight["curve"])
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
            f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache_dir}"]


def check_fsdp_two() -> None:
    """Two ranks, FSDP2, Stage 1 then Stage 2 with the paper's checkpointing flags (GPUs 0 and 1)."""
    import subprocess

    if torch.cuda.device_count() < 2:
        emit("fsdp_two", None, skipped=f"{torch.cuda.device_count()} GPU visible; two are needed")
        return
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(two_rank_command(f"{tmp}/run", f"{tmp}/cache"), capture_output=True, text=True,
                              timeout=1200, cwd=ROOT)
        record = json.loads((Path(tmp) / "run" / "results.json").read_text()) if done.returncode == 0 else {}
    stages = record.get("stages", {})
    losses = [stages.get(kind, {}).get(key) for kind in ("align", "distill") for key in ("loss_first", "loss_last")]
    ok = record.get("status") == "complete" and all(x is not None and math.isfinite(x) for x in losses)
    emit("fsdp_two", ok and losses[3] < losses[2], exit=done.returncode, losses=losses,
         stderr_tail=done.stderr[-300:] if done.returncode else "")


CHECKS = {"kernels": check_kernels, "zero_shot": check_zero_shot, "calibration": check_calibration,
          "stage2": check_stage2, "decode": check_decode,
          "qwen_width": check_qwen_width, "fsdp": check_fsdp_single, "kill_resume": check_kill_resume,
          "qwen3_8b_slice": check_qwen3_8b_slice, "fsdp_two": check_fsdp_two}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    parser.add_argument("--killed-child", nargs=2, metavar=("RUN_DIR", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.killed_child:
        killed_child(*args.killed_child)
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "skipped": "no CUDA device visible; nothing to check here"}), flush=True)
        return 0
    emit("gpu", None, device=torch.cuda.get_device_name(), torch=torch.__version__)
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            CHECKS[name]()
        except Exception as err:  # one broken check must not hide the others' figures
            emit(name, False, error=f"{type(err).__name__}: {err}")
        print(json.dumps({"check": name, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
