"""A Qwen3-family student as transformers' `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`), weight for weight.

Qwen3.5 is a dense hybrid whose `layer_types` mix `linear_attention` (a Gated DeltaNet) and `full_attention`. A
Qwen3 student is one of its instances once three conventions are matched:

- Kept attention. Qwen3.5 gates its attention output, o = Wo (attn(q, k, v) * sigmoid(Wgate x)), with the gate
  rows interleaved per head in `q_proj` ([q_h; gate_h] for each head h). Zero gate rows give sigmoid(0) = 1/2
  exactly, so `o_proj` is doubled: Wo' (a / 2) = Wo a. RoPE covers the whole head (`partial_rotary_factor` 1.0;
  Qwen3.5's default is 1/4).
- Norms. Qwen3.5's RMSNorms (decoder, final, q/k norms) are zero-centred: y = (1 + w) x / rms(x). Qwen3's are
  y = w x / rms(x), so they are written as w - 1. The GDN's gated norm is a plain one in both: written as it is.
- GDN layers. Qwen3.5 runs in_proj_qkv -> causal depthwise conv (kernel 4) -> SiLU -> split q, k, v -> l2-norm q, k.
  Ours is SiLU(W x) for each of q, k, v, then l2-norm q, k. With in_proj_qkv = [Wq; Wk; Wv] and the identity conv
  (taps [0, 0, 0, 1]: the last tap is the current token), Qwen3.5's SiLU after the conv is ours. The gate, beta
  and decay projections are `in_proj_z`, `in_proj_b`, `in_proj_a`; `A_log`, `dt_bias`, the gated norm (`norm`)
  and `o_proj` (`out_proj`) carry over as they are: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b),
  y = out_proj(norm(o) * silu(z)) in both.

One number cannot be matched: Qwen3.5 has a single `rms_norm_eps` for every norm, ours has the teacher's for the
decoder norms (1e-6 for Qwen teachers) and the GDN's own for the gated norm (`gdn_norm_eps`, 1e-5). The export
writes the GDN's: the gated norm's input (the delta rule's readout, o = S q / sqrt(d)) can be small enough for
eps to matter, while the decoder norms see the residual stream, whose mean square dwarfs both values. The
parity check measures what the choice costs on every export (the manifest records both values); training Qwen3
students with the teacher's eps would make the map bit-exact.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from tcal.export.formats import ExportFormat
from tcal.export.parity import Parity, compare
from tcal.export.refusal import ExportRefused

CONV_KERNEL = 4  # Qwen3.5's short-conv width; the identity conv puts its single 1 on the last tap
QWEN3 = "qwen3"
log = logging.getLogger(__name__)


def check_qwen3_student(config) -> None:
    """Refuse, in one line naming why, a student that `Qwen3_5ForCausalLM` cannot hold exactly."""
    teacher = config.teacher_config
    family = teacher.model_type
    if family != QWEN3:
        raise ExportRefused(f"--format qwen3_5 holds Qwen3-family students only; this student's teacher is "
                            f"{family!r}, whose attention has no QK-norm while Qwen3.5's always applies one: use "
                            f"--format vllm or --format hf")
    if getattr(teacher, "attention_bias", False):
        raise ExportRefused("--format qwen3_5: the teacher's attention has biases (attention_bias=true); the map "
                            "covers bias-free Qwen3 attention only: use --format vllm or --format hf")
    if getattr(teacher, "use_sliding_window", False):
        raise ExportRefused("--format qwen3_5: the teacher uses sliding-window attention, which Qwen3.5 has not: "
                            "use --format hf")
    if teacher.hidden_act != "silu":
        raise ExportRefused(f"--format qwen3_5: hidden_act={teacher.hidden_act!r}; Qwen3.5's MLP and short conv "
                            f"use 'silu'")


def qwen3_5_config(config):
    """The `Qwen3_5TextConfig` of a Qwen3 student's `HybridConfig`."""
    from transformers import Qwen3_5TextConfig

    teacher = config.teacher_config
    head_dim = getattr(teacher, "head_dim", None) or teacher.hidden_size // teacher.num_attention_heads
    rope = dict(teacher.rope_parameters or {"rope_type": "default", "rope_theta": teacher.rope_theta})
    rope["partial_rotary_factor"] = 1.0
    exported = Qwen3_5TextConfig(
        vocab_size=teacher.vocab_size, hidden_size=teacher.hidden_size, intermediate_size=teacher.intermediate_size,
        num_hidden_layers=teacher.num_hidden_layers, num_attention_heads=teacher.num_attention_heads,
        num_key_value_heads=teacher.num_key_value_heads, hidden_act=teacher.hidden_act,
        max_position_embeddings=teacher.max_position_embeddings, rms_norm_eps=config.gdn_norm_eps,
        tie_word_embeddings=bool(getattr(teacher, "tie_word_embeddings", False)), rope_parameters=rope,
        attention_bias=False, head_dim=head_dim, linear_conv_kernel_dim=CONV_KERNEL,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_num_key_heads=teacher.num_attention_heads, linear_num_value_heads=teacher.num_attention_heads,
        layer_types=list(config.layer_types), pad_token_id=teacher.pad_token_id, bos_token_id=teacher.bos_token_id,
        eos_token_id=teacher.eos_token_id,
    )
    if exported.rope_parameters.get("partial_rotary_factor") != 1.0:
        raise RuntimeError(f"Qwen3_5TextConfig kept partial_rotary_factor="
                           f"{exported.rope_parameters.get('partial_rotary_factor')}; expected 1.0")
    exported.architectures = ["Qwen3_5ForCausalLM"]
    return exported


def _gated_q_proj(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[H*d, D] -> [H*2d, D]: each head's query rows followed by d zero gate rows."""
    per_head = weight.view(heads, head_dim, -1)
    return torch.cat([per_head, torch.zeros_like(per_head)], dim=1).reshape(heads * 2 * head_dim, -1)


def qwen3_5_state_dict(student) -> dict[str, torch.Tensor]:
    """The student's weights under Qwen3.5's names and conventions (module doc), as new tensors."""
    config = student.config
    teacher = config.teacher_config
    heads = teacher.num_attention_heads
    head_dim = getattr(teacher, "head_dim", None) or teacher.hidden_size // heads
    state = {name: tensor.detach() for name, tensor in student.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def centred(name: str) -> torch.Tensor:
        return state[name] - 1.0

    out["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out["model.norm.weight"] = centred("model.norm.weight")
    if not getattr(teacher, "tie_word_embeddings", False):
        out["lm_head.weight"] = state["lm_head.weight"].clone()
    for i, kind in enumerate(config.layer_types):
        src, dst = f"model.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = centred(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = centred(src + "post_attention_layernorm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[dst + f"mlp.{proj}.weight"] = state[src + f"mlp.{proj}.weight"].clone()
        attn = src + "self_attn."
        if kind == "linear_attention":
            gdn = dst + "linear_attn."
            qkv = torch.cat([state[attn + "q_proj.weight"], state[attn + "k_proj.weight"],
                             state[attn + "v_proj.weight"]])
            out[gdn + "in_proj_qkv.weight"] = qkv
            conv = torch.zeros(qkv.shape[0], 1, CONV_KERNEL, dtype=qkv.dtype)
            conv[:, 0, -1] = 1.0
            out[gdn + "conv1d.weight"] = conv
            out[gdn + "in_proj_z.weight"] = state[attn + "g_proj.weight"].clone()
            out[gdn + "in_proj_b.weight"] = state[attn + "b_proj.weight"].clone()
            out[gdn + "in_proj_a.weight"] = state[attn + "a_proj.weight"].clone()
            out[gdn + "A_log"] = state[attn + "A_log"].clone()
            out[gdn + "dt_bias"] = state[attn + "dt_bias"].clone()
            out[gdn + "norm.weight"] = state[attn + "o_norm.weight"].clone()
            out[gdn + "out_proj.weight"] = state[attn + "o_proj.weight"].clone()
        else:
            sa = dst + "self_attn."
            out[sa + "q_proj.weight"] = _gated_q_proj(state[attn + "q_proj.weight"], heads, head_dim)
            out[sa + "k_proj.weight"] = state[attn + "k_proj.weight"].clone()
            out[sa + "v_proj.weight"] = state[attn + "v_proj.weight"].clone()
            out[sa + "o_proj.weight"] = state[attn + "o_proj.weight"] * 2.0
            out[sa + "q_norm.weight"] = centred(attn + "q_norm.weight")
            out[sa + "k_norm.weight"] = centred(attn + "k_norm.weight")
    return out


def qwen3_5_model(student):
    """`Qwen3_5ForCausalLM` holding the student's weights (float32, eval mode)."""
    check_qwen3_student(student.config)
    return qwen3_5_from_state(qwen3_5_config(student.config), qwen3_5_state_dict(student))


def qwen3_5_from_state(config, state: dict[str, torch.Tensor]):
    """`Qwen3_5ForCausalLM` of `config` holding `state` (Qwen3.5's names, every weight present), float32 eval mode."""
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"Qwen3.5 map incomplete: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.tie_weights()
    model.model.rotary_emb = Qwen3_5TextRotaryEmbedding(config)  # its frequency buffers, not kept on the meta device
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise RuntimeError(f"Qwen3.5 map left {left[:5]} without values")
    return model.float().eval()


TORCH_REFERENCE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                             "causal_conv1d_update")


@contextlib.contextmanager
def torch_reference_kernels():
    """Within the block, transformers' Qwen3.5 runs its own torch delta rule and conv on every device.

    transformers binds those functions, when its Qwen3.5 module is first imported, to fla's Triton kernels whenever
    fla imports (tcal's venv has fla), and Triton has no CPU backend ("0 active drivers"). Each binding keeps the
    torch function it replaced as `__wrapped__` (functools.wraps), which the block puts back in the module and
    restores afterwards. Logged, so the path that ran is named."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    before = {name: getattr(modeling_qwen3_5, name) for name in TORCH_REFERENCE_FUNCTIONS}
    replaced = []
    for name, bound in before.items():
        reference = getattr(bound, "__wrapped__", None)
        if reference is not None and reference is not bound:
            setattr(modeling_qwen3_5, name, reference)
            replaced.append(name)
    log.info("Qwen3.5 GDN path: transformers' torch reference (%s)",
             f"rebound {', '.join(replaced)} from their kernels" if replaced else "already bound")
    try:
        yield
    finally:
        for name, bound in before.items():
            setattr(modeling_qwen3_5, name, bound)


class Qwen35Format(ExportFormat):
    """`--format qwen3_5`: a Qwen3-family student as stock `Qwen3_5ForCausalLM`, reloaded by stock transformers and
    compared under its torch reference kernels; the record names the norm eps each side has (`rms_norm_eps`)."""

    def check(self, config) -> None:
        check_qwen3_student(config)

    def write(self, student, tokenizer, folder: Path) -> None:
        qwen3_5_model(student).save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    def reload(self, folder: Path):
        model = super().reload(folder)
        if not type(model).__module__.startswith("transformers."):
            raise RuntimeError(f"--format qwen3_5 reloaded through {type(model).__module__}, not stock transformers")
        return model

    def check_written(self, student, folder: Path, prompts: list[list[int]], tolerance: float) -> tuple[Parity, dict]:
        with torch_reference_kernels():
            parity = compare(student, self.reload(folder), prompts, tolerance)
        teacher = student.config.teacher_config
        eps = {"teacher": teacher.rms_norm_eps, "gdn": student.config.gdn_norm_eps,
               "written": student.config.gdn_norm_eps}
        return parity, {"rms_norm_eps": eps}


QWEN3_5 = Qwen35Format()
