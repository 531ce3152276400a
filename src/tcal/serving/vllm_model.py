"""The tcal hybrid as a vLLM model: the teacher family's own vLLM decoder layers where attention was kept, and vLLM's
Qwen3.5 Gated DeltaNet layer where it was converted.

Kept layers are `LlamaDecoderLayer`, `Qwen2DecoderLayer` or `Qwen3DecoderLayer` built from the teacher's config, so
prefill and decode go through vLLM's paged KV cache exactly as for the teacher. A GDN layer is a Llama-style block
(RMSNorm, mixer, RMSNorm, gated SiLU MLP: the block every supported family shares) whose mixer is vLLM's
`QwenGatedDeltaNetAttention`, keeping its state in vLLM's GDN state cache. That mixer computes

    q, k, v = split(silu(conv(W_qkv x)));  q, k l2-normalized;  g = -exp(A_log) softplus(W_a x + dt_bias);
    beta = sigmoid(W_b x);  delta rule as ours;  y = W_out(RMSNorm(o) * w * silu(W_z x))

which is tcal's GDN when W_qkv = [Wq; Wk; Wv] and the causal depthwise conv is the identity (taps [0, 0, 0, 1]:
the last tap is the current token), with W_z = g_proj, W_b = b_proj, W_a = a_proj, W_out = o_proj and the gated
norm's eps the student's `gdn_norm_eps`. The checkpoint is tcal's as saved: the projections are loaded into vLLM's
fused ones (`in_proj_qkvz` = [q, k, v, z], `in_proj_ba` = [b, a]) and the identity conv is written at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from types import SimpleNamespace

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, extract_layer_index, make_layers

from tcal.registry import VLLM_FAMILIES

LINEAR = "linear_attention"
CONV_KERNEL = 4  # vLLM's GDN runs a causal conv; width 4 is the one its CPU and GPU kernels are built for
# tcal's GDN parameter -> (vLLM GDN parameter, shard of the fused projection or None)
GDN_WEIGHTS = {
    "q_proj.weight": ("in_proj_qkvz.weight", 0),
    "k_proj.weight": ("in_proj_qkvz.weight", 1),
    "v_proj.weight": ("in_proj_qkvz.weight", 2),
    "g_proj.weight": ("in_proj_qkvz.weight", 3),
    "b_proj.weight": ("in_proj_ba.weight", 0),
    "a_proj.weight": ("in_proj_ba.weight", 1),
    "A_log": ("A_log", None),
    "dt_bias": ("dt_bias", None),
    "o_norm.weight": ("norm.weight", None),
    "o_proj.weight": ("out_proj.weight", None),
}
KEPT_LAYER_WEIGHTS = WeightsMapper(orig_to_new_stacked={
    ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
})


def head_dim(teacher) -> int:
    return getattr(teacher, "head_dim", None) or teacher.hidden_size // teacher.num_attention_heads


def gdn_settings(config) -> SimpleNamespace:
    """What vLLM's Qwen3.5 GDN layer reads from a config, for tcal's GDN: one key head per value head (the GDN
    has the teacher's query-head count for q, k and v), the teacher's head dim for both, the student's norm eps."""
    teacher = config.teacher_config
    heads, dim = teacher.num_attention_heads, head_dim(teacher)
    return SimpleNamespace(hidden_size=teacher.hidden_size, hidden_act="silu", rms_norm_eps=config.gdn_norm_eps,
                           linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                           linear_value_head_dim=dim, linear_conv_kernel_dim=CONV_KERNEL, output_gate_type="silu")


class TcalGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM's Qwen3.5 GDN layer behind a decoder layer's `self_attn(positions, hidden_states)` call."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__(gdn_settings(config), vllm_config, prefix=prefix, gqa_interleaved_layout=False)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states)


class TcalGdnDecoderLayer(nn.Module):
    """A converted layer: pre-norm residual block of the GDN mixer and the teacher's MLP."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        teacher = config.teacher_config
        self.self_attn = TcalGatedDeltaNet(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(teacher.hidden_size, teacher.intermediate_size, teacher.hidden_act,
                            quant_config=vllm_config.quant_config, bias=getattr(teacher, "mlp_bias", False),
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(teacher.hidden_size, eps=teacher.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(teacher.hidden_size, eps=teacher.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def kept_layer(family: str, teacher, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """The teacher family's own vLLM decoder layer, built by the family's function in `tcal.registry.VLLM_FAMILIES`."""
    if family not in VLLM_FAMILIES:
        raise ValueError(f"tcal's vLLM plugin serves {', '.join(VLLM_FAMILIES.names())} students; got teacher "
                         f"{family!r}")
    return VLLM_FAMILIES[family].implementation(teacher, vllm_config, prefix)


def llama_layer(teacher, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix, config=teacher)


def qwen2_layer(teacher, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    return Qwen2DecoderLayer(config=teacher, cache_config=vllm_config.cache_config,
                             quant_config=vllm_config.quant_config, prefix=prefix)


def qwen3_layer(teacher, vllm_config: VllmConfig, prefix: str) -> nn.Module:
    return Qwen3DecoderLayer(config=teacher, cache_config=vllm_config.cache_config,
                             quant_config=vllm_config.quant_config, prefix=prefix)


class TcalHybridModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        teacher = config.teacher_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(teacher.vocab_size, teacher.hidden_size)

        def layer(prefix: str) -> nn.Module:
            if config.layer_types[extract_layer_index(prefix)] == LINEAR:
                return TcalGdnDecoderLayer(config, vllm_config, prefix)
            return kept_layer(teacher.model_type, teacher, vllm_config, prefix)

        self.start_layer, self.end_layer, self.layers = make_layers(teacher.num_hidden_layers, layer,
                                                                    prefix=f"{prefix}.layers")
        self.norm = RMSNorm(teacher.hidden_size, eps=teacher.rms_norm_eps)

    def forward(self, input_ids, positions, inputs_embeds=None):
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class TcalHybridForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM's entry for `architectures: ["TcalHybridForCausalLM"]` (single device: no tensor or pipeline split)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        teacher = config.teacher_config
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("tcal's vLLM plugin runs on one device (tensor_parallel_size=1, pipeline_parallel_size=1)")
        self.config = config
        self.model = TcalHybridModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(teacher.vocab_size, teacher.hidden_size, prefix="lm_head")
        self.tied = bool(getattr(teacher, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(teacher.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        settings = gdn_settings(vllm_config.model_config.hf_config)
        spec = vllm_config.speculative_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, settings.linear_num_key_heads,
            settings.linear_num_value_heads, settings.linear_key_head_dim, settings.linear_value_head_dim,
            settings.linear_conv_kernel_dim, spec.num_speculative_tokens if spec else 0)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """GDN layers' weights into vLLM's fused GDN projections (`GDN_WEIGHTS`) plus the identity conv; everything
        else through vLLM's loader with the teacher families' own fusions (qkv, gate/up)."""
        gdn_layers = {i for i, kind in enumerate(self.config.layer_types) if kind == LINEAR}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        rest = []
        for name, tensor in weights:
            parts = name.split(".")
            if name.startswith("model.layers.") and int(parts[2]) in gdn_layers and parts[3] == "self_attn":
                leaf = ".".join(parts[4:])
                if leaf not in GDN_WEIGHTS:
                    raise ValueError(f"unexpected GDN weight {name} in a tcal checkpoint")
                target, shard = GDN_WEIGHTS[leaf]
                target = f"model.layers.{parts[2]}.self_attn.{target}"
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
                loaded.add(target)
            elif self.tied and name == "lm_head.weight":
                continue
            else:
                rest.append((name, tensor))
        for i in gdn_layers:
            conv = params[f"model.layers.{i}.self_attn.conv1d.weight"]
            identity = torch.zeros_like(conv.data)
            identity[..., -1] = 1.0
            conv.data.copy_(identity)
            loaded.add(f"model.layers.{i}.self_attn.conv1d.weight")
        loaded |= AutoWeightsLoader(self).load_weights(
            rest, mapper=KEPT_LAYER_WEIGHTS)
        return loaded
