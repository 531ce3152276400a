"""`tcal-plan`'s Stage 2 activation model at a paper width: `make bench ARGS="plan_activations"`.

A 4-layer slice of a paper architecture (Qwen2.5-1.5B by default, `-o teacher=...` for another; its layers as
published, a 1,024-token vocabulary since the decoder's activations do not depend on it), one softmax layer kept
and three converted, trains on the CPU: one forward and backward of its decoder on a [1, 1024, D] input standing in
for the embeddings, in a fresh process per setting. Measured: the peak resident growth over the process with the
model, its gradients (allocated beforehand, so the backward only accumulates) and the input, less the output,
with glibc releasing freed blocks at once (resident memory then follows the live tensors). Planned: what
`tcal.tools.plan` adds up for the same slice (`memory.decoder_step`: the traced activations, and under autocast the
weight copies). Each checkpointing setting in float32, and under bf16 autocast (CPU
autocast; the plan's float32 trace is an upper bound there).
"""

from __future__ import annotations

import torch
from measurement import emit, in_fresh_process, reset_peak_rss, rss_kib
from training_steps import EAGER_RELEASE

SLICE_LAYERS = 4
SLICE_VOCAB = 1024
SLICE_BATCH = (1, 1024)
SETTINGS = ("none", "checkpoint_mixers", "activation_checkpointing")


def slice_config(overrides: list[str]):
    from tcal.settings.compose import settings_for
    from tcal.teachers.load import teacher_architecture

    cfg = settings_for("teacher=qwen2_5_1_5b", *overrides)
    config = teacher_architecture(cfg.teacher, cfg.paths.cache_dir)
    config.num_hidden_layers, config.vocab_size = SLICE_LAYERS, SLICE_VOCAB
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # ids of the full vocabulary
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:SLICE_LAYERS]
    config._attn_implementation = str(cfg.teacher.attn_implementation)
    return cfg.teacher.name, config


def planned_bytes(config, setting: str, autocast: bool, batch: int, seq_len: int) -> int:
    """The plan's bytes for the slice's decoder: activations (float32 trace) and, under autocast, weight copies
    (the compute dtype's bytes per trainable Linear parameter of the decoder; the slice runs no head)."""
    from tcal.student.convert import meta_student
    from tcal.tools.plan.memory import decoder_step, dtype_bytes

    student = meta_student(config, [0]).train().requires_grad_(True)
    student.lm_head.requires_grad_(False)
    step = decoder_step(student, batch, seq_len, torch.float32, "cpu")
    return step.activations[setting] + (step.autocast_params[setting] * dtype_bytes(torch.bfloat16) if autocast else 0)


def measure_slice(overrides: list[str], setting: str, autocast: bool, batch: int, seq_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tcal.student.convert import build_student

    name, config = slice_config(overrides)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    student = build_student(teacher, [0]).train().requires_grad_(True)
    del teacher
    for i in student.config.gdn_layers:
        student.gdn(i).checkpoint_training = setting == "checkpoint_mixers"
    if setting == "activation_checkpointing":
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for p in student.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(batch, seq_len, config.hidden_size, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    x.grad = torch.zeros_like(x)
    decoder = student.get_decoder()
    base = reset_peak_rss()
    context = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if autocast else torch.enable_grad()
    with context:
        out = decoder(inputs_embeds=x, use_cache=False).last_hidden_state
    out_bytes = out.numel() * out.element_size()
    out.backward(torch.ones_like(out))
    peak = rss_kib("VmHWM") * 1024 - base - 2 * out_bytes  # the output and its gradient are the caller's
    return {"teacher": name, "measured_bytes": peak, "planned_bytes": planned_bytes(config, setting, autocast,
                                                                                    batch, seq_len)}


def bench_plan_activations(overrides=(), batch: int = SLICE_BATCH[0], seq_len: int = SLICE_BATCH[1]) -> list[dict]:
    lines = []
    for autocast in (False, True):
        for setting in SETTINGS:
            r = in_fresh_process(measure_slice, list(overrides), setting, autocast, batch, seq_len, env=EAGER_RELEASE)
            lines.append(emit("plan_activations", teacher=r["teacher"], layers=f"{SLICE_LAYERS} (1 kept, 3 GDN)",
                              shape=f"{batch}x{seq_len}", precision="bf16 autocast" if autocast else "float32",
                              checkpointing=setting, planned_gb=r["planned_bytes"] / 2**30,
                              measured_gb=r["measured_bytes"] / 2**30,
                              ratio=r["planned_bytes"] / r["measured_bytes"],
                              target="ratio within 0.85 .. 1.15" if not autocast
                              else "ratio >= 1 (the float32 trace bounds autocast's activations)"))
    return lines
