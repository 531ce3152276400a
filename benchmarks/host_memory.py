"""Host memory of building the student: `make bench ARGS="host_memory"` (`-o teacher=<paper teacher>` for another).

A paper teacher's architecture (`teacher.architecture`, no weights) with random bfloat16 weights stands in for the
loaded teacher; `convert.build_student` builds the naive uniform-0.25 student from it, and `weights_digest` hashes
it, in a fresh process. The figure is the peak resident memory the step adds above the process with the
teacher loaded, against the student's own bfloat16 weight bytes: 1.0 is one copy of the weights in their dtype.
The construction it replaced (a randomly initialized float32 student, cast, then the teacher's state copied in) is
measured the same way by `make bench ARGS="host_memory_replaced"`; both print the student's `weights_digest`, which
must agree.
"""

from __future__ import annotations

import torch
from measurement import emit, in_fresh_process, reset_peak_rss, rss_kib


def _random_teacher(overrides: list[str]):
    """The teacher's architecture in bfloat16 with seeded uniform weights (every page written, as a loaded
    teacher's are); the RoPE buffers are recomputed on the CPU as transformers builds them."""
    from transformers import AutoModelForCausalLM

    from tcal.settings.compose import settings_for
    from tcal.teachers.load import teacher_architecture

    cfg = settings_for("teacher=qwen2_5_1_5b", *overrides)
    config = teacher_architecture(cfg.teacher, cfg.paths.cache_dir)
    config._attn_implementation = str(cfg.teacher.attn_implementation)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    teacher.to_empty(device="cpu")
    teacher.tie_weights()  # to_empty gives each module its own tensor: a tied head is tied again, as loaded
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in teacher.parameters():
            param.uniform_(-0.02, 0.02, generator=gen)
    rotary = type(teacher.model.rotary_emb)(config=config)
    for name, buffer in rotary.named_buffers():
        getattr(teacher.model.rotary_emb, name).copy_(buffer)
    return cfg.teacher.name, teacher.eval().requires_grad_(False)


def _replaced_construction(teacher, keep_layers):
    """The construction `build_student` replaced: float32 random student, cast, teacher state copied in."""
    from tcal.student.convert import convert_layer, hybrid_config, layer_generator, take_buffers
    from tcal.student.hybrid import HybridForCausalLM
    from tcal.teachers import adapter_for

    adapter = adapter_for(teacher.config)
    config = hybrid_config(teacher.config, keep_layers)
    student = HybridForCausalLM(config).to(torch.bfloat16)
    take_buffers(student, teacher)
    converted = tuple(f"model.layers.{i}.self_attn." for i in config.gdn_layers)
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if not k.startswith(converted)},
                            strict=False)
    for i in config.gdn_layers:
        convert_layer(student.gdn(i), adapter.attention(teacher, i), adapter, teacher.config, "whole_head",
                      layer_generator(0, i))
    return student


def measure_build(overrides: list[str], construction: str) -> dict:
    """Peak RSS (bytes) above the teacher-loaded process while building the student by `construction`
    (`meta` = `build_student`, `replaced`), then while hashing it (`weights_digest`)."""
    from tcal.retention.uniform import uniform_layers
    from tcal.store.fingerprint import weights_digest
    from tcal.student.convert import build_student

    name, teacher = _random_teacher(overrides)
    keep = uniform_layers(teacher.config.num_hidden_layers, 0.25)
    base = reset_peak_rss()
    student = build_student(teacher, keep) if construction == "meta" else _replaced_construction(teacher, keep)
    build_peak = rss_kib("VmHWM") * 1024 - base
    student_bytes = sum(p.numel() * p.element_size() for p in student.parameters())  # a tied head counts once
    held = reset_peak_rss()
    digest = weights_digest(student)
    digest_peak = rss_kib("VmHWM") * 1024 - held
    return {"teacher": name, "construction": construction, "build_peak_bytes": build_peak,
            "student_bytes": student_bytes, "digest_peak_bytes": digest_peak, "digest": digest,
            "params": sum(p.numel() for p in student.parameters())}


def bench_host_memory(overrides: list[str], construction: str = "meta") -> dict:
    """`construction`: `meta` (`build_student`, group `host_memory`) or `replaced` (group `host_memory_replaced`:
    the construction build_student replaced, for comparison), in a fresh process."""
    r = in_fresh_process(measure_build, overrides, construction)
    return emit(f"host_memory_build_{construction}", teacher=r["teacher"], params=r["params"],
                student_bf16_gb=r["student_bytes"] / 2**30, build_peak_gb=r["build_peak_bytes"] / 2**30,
                build_peak_over_weights=r["build_peak_bytes"] / r["student_bytes"],
                digest_peak_gb=r["digest_peak_bytes"] / 2**30,
                digest_peak_over_weights=r["digest_peak_bytes"] / r["student_bytes"], weights_digest=r["digest"],
                target="build_peak_over_weights <= 1.1 (one copy of the weights in their dtype)"
                if construction == "meta" else "the construction build_student replaced (same weights_digest)")
