"""Predicted hours of a run's training stages from a FLOPs model (`FLOPS_FORMULA`), each stage's terms asked of its
settings (`trains`, `checkpointing()`, `logit_kl_chunk()`, `steps()`)."""

from __future__ import annotations

import torch

from tcal.tools.plan.memory import Model
from tcal.tools.plan.trace import FLA_CHUNK

# Peak dense bfloat16 tensor throughput (vendor data sheets, SXM parts) and the model FLOPs utilisation the hours
# assume: planning constants (no run has measured them here), stated in the output with the formula.
GPU_RATES = {
    "H100": {"peak_bf16_tflops": 989.0, "mfu": 0.35},
    "A100": {"peak_bf16_tflops": 312.0, "mfu": 0.45},
}
HOURS_GPUS = 8
FLOPS_FORMULA = ("per training token: 6 N_trained (forward and backward of the trained matmul parameters) + "
                 "2 N_teacher (the frozen teacher's forward; Stage 1 without its head) + 2 N_recomputed (checkpointed "
                 "parts run forward twice) + softmax attention 2 T d_attn per layer forward (causal, T the sequence "
                 "length), x3 in trained layers + GDN chunk 2 H (2 C d + 3 d^2) per layer forward (chunk C=64, "
                 "head dim d), x3 in trained layers; hours = FLOPs / (GPUs x peak bf16 x MFU)")


def matmul_params(modules) -> int:
    """Parameters of the nn.Linear modules among `modules`, counted once each (a tied head once): the parameters a
    token's forward multiplies (embeddings are looked up, norms are elementwise)."""
    seen = {id(p): p.numel() for module in modules if isinstance(module, torch.nn.Linear)
            for p in module.parameters(recurse=False)}
    return sum(seen.values())


def attention_flops(seq_len: int, config) -> int:
    """Forward FLOPs per token of one causal softmax attention layer (scores and weighted values, T / 2 keys on
    average): 2 T H d_head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * seq_len * config.num_attention_heads * head_dim


def gdn_flops(seq_len: int, gdn) -> int:
    """Forward FLOPs per token of one GDN layer's chunked delta rule (fla's chunk algorithm, an estimate): per head,
    the chunk's q k^T and its weighted values (2 x 2 C d), and the state's read, correction and update (3 x 2 d^2)."""
    chunk = min(FLA_CHUNK, seq_len)
    return gdn.num_heads * (4 * chunk * gdn.head_dim + 6 * gdn.head_dim ** 2)


def stage_flops(node, model: Model, world: int) -> dict:
    """Tokens and FLOPs of one training stage by `FLOPS_FORMULA`: the teacher's forward (its head only for a KL on
    the logits), the trained parameters' forward and backward, and the forward again of what is checkpointed."""
    teacher, student, config = model.teacher, model.student, model.teacher_config
    steps = node.steps(world)
    tokens = steps.total * steps.tokens_per_step
    T = int(node.seq_len)
    n_kept, gdn_layers = len(student.config.keep_layers), list(student.config.gdn_layers)
    attention = attention_flops(T, config)
    mixer_kernels = len(gdn_layers) * (gdn_flops(T, student.gdn(gdn_layers[0])) if gdn_layers else 0)
    mixers = matmul_params(m for i in gdn_layers for m in student.gdn(i).modules())
    trained = {"student": (matmul_params(student.modules()), n_kept * attention + mixer_kernels),
               "mixers": (mixers, mixer_kernels)}[node.trains]
    recompute = {"none": 0, "checkpoint_mixers": 2 * mixers + mixer_kernels,
                 "activation_checkpointing": 2 * matmul_params(student.get_decoder().layers.modules())
                 + n_kept * attention + mixer_kernels}
    teacher_runs = teacher if node.logit_kl_chunk() is not None else teacher.get_decoder()
    per_token = {"teacher_forward": 2 * matmul_params(teacher_runs.modules()) + config.num_hidden_layers * attention,
                 "trained": 6 * trained[0] + 3 * trained[1], "recompute": recompute[node.checkpointing()]}
    flops_per_token = sum(per_token.values())
    return {"tokens": tokens, "flops_per_token": flops_per_token, "flops": tokens * flops_per_token,
            "flops_per_token_parts": per_token}


def hours_plan(settings, model: Model, world: int) -> dict:
    """Predicted hours of the run's training stages on HOURS_GPUS x H100 and x A100 (`FLOPS_FORMULA`, `GPU_RATES`);
    calibration, validation and the final evaluation are not counted."""
    stages = {node.kind: stage_flops(node, model, world) for _, node in settings.stage.stages()}
    total = sum(stage["flops"] for stage in stages.values())
    gpus = {f"{HOURS_GPUS} x {name}": {**rate, "hours": round(total / (HOURS_GPUS * rate["peak_bf16_tflops"] * 1e12
                                                                         * rate["mfu"]) / 3600, 2)}
            for name, rate in GPU_RATES.items()}
    return {"formula": FLOPS_FORMULA, "total_flops": total, "stages": stages, "gpus": gpus,
            "not_counted": "calibration (init), the validation curve and the final evaluation"}
