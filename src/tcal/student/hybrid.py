"""The hybrid student as a transformers-native model (docs/method.md, section "The hybrid student").

The student *is* the teacher's own base model (LlamaModel, Qwen2Model, ...) with the `self_attn` of every
`linear_attention` layer swapped for a `GatedDeltaNet`. Parameter names therefore match the teacher's
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`), kept layers run the teacher's attention code
unchanged, and the GDN layers keep their state in transformers' hybrid `DynamicCache`, whose kept layers append
their keys and values in place (`GrowingKVLayer`).
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.modeling_outputs import CausalLMOutputWithPast

from tcal.student.gdn import GatedDeltaNet
from tcal.student.gdn_torch import padding_mask

LINEAR = "linear_attention"

# Teacher attributes that generation, lm-eval and the cache read from the top-level config.
_MIRRORED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id",
)


def teacher_layer_types(teacher_config) -> list[str]:
    """The teacher's own per-layer attention types (`full_attention` unless the config says otherwise)."""
    types = getattr(teacher_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * teacher_config.num_hidden_layers


@strict
class HybridConfig(PreTrainedConfig):
    """Teacher config plus `layer_types`: `linear_attention` marks a GDN layer, anything else a kept layer."""

    model_type = "tcal_hybrid"
    sub_configs_defaults = {"teacher_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    teacher_config: dict | PreTrainedConfig | None = None
    layer_types: list[str] | None = None
    gdn_norm_eps: float = 1e-5
    use_cache: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        teacher = self.teacher_config
        for name in _MIRRORED:
            setattr(self, name, getattr(teacher, name, None))
        self.tie_word_embeddings = bool(getattr(teacher, "tie_word_embeddings", False))
        own = teacher_layer_types(teacher)
        if self.layer_types is None:
            self.layer_types = own
        if len(self.layer_types) != len(own):
            raise ValueError(f"layer_types has {len(self.layer_types)} entries; the teacher has {len(own)} layers")
        for i, (kind, teacher_kind) in enumerate(zip(self.layer_types, own)):
            if kind not in (LINEAR, teacher_kind):
                raise ValueError(f"layer_types[{i}] = {kind!r}: expected {LINEAR!r} or the teacher's {teacher_kind!r}")
        if not self.keep_layers:
            raise ValueError("a hybrid model needs at least one softmax attention layer")

    @property
    def keep_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind != LINEAR]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]


KV_RESERVE = 128  # positions a KV buffer keeps free at least when it is (re)allocated (and 1/8 of its length)


def _append_in_place(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`cached` [B, H, n, D] followed by `new` [B, H, m, D], as a view of a buffer: written in place after
    `cached` when `cached` is the start of a buffer with room (what this function returns), otherwise into a new
    buffer with room for max(KV_RESERVE, length / 8) more positions. Anything that replaced the tensor (beam
    reordering, cropping, a copy) is noticed and costs one reallocation."""
    length = cached.shape[-2] if cached.numel() else 0
    total = length + new.shape[-2]
    buffer = cached._base
    fits = (buffer is not None and buffer.dim() == 4 and buffer.shape[:2] == new.shape[:2]
            and buffer.shape[-1] == new.shape[-1] and buffer.shape[-2] >= total and buffer.dtype == new.dtype
            and buffer.device == new.device and cached.data_ptr() == buffer.data_ptr()
            and cached.stride() == buffer.stride())
    if not fits:
        buffer = new.new_empty(*new.shape[:2], total + max(KV_RESERVE, total // 8), new.shape[-1])
        if length:
            buffer[:, :, :length].copy_(cached)
    buffer[:, :, length:total].copy_(new)
    return buffer[:, :, :total]


class GrowingKVLayer(DynamicLayer):
    """A kept layer's KV cache that appends in place. transformers' `DynamicLayer` concatenates, copying the whole
    cache at every decoded token: at 16k tokens that copy cost as much as the attention itself. Here keys and
    values are views of buffers with spare room, so a step writes one position; the buffers hold up to 1/8 (and
    at least KV_RESERVE positions) more than the cache. With autograd recording it concatenates like its parent
    (a buffer written in place would invalidate the views saved for backward)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = _append_in_place(self.keys, key_states)
        self.values = _append_in_place(self.values, value_states)
        return self.keys, self.values


def use_growing_kv(cache):
    """`cache` with each of its empty plain `DynamicLayer`s (softmax layers not yet written) replaced by a
    `GrowingKVLayer`; the linear-attention layers and any layer holding data stay as they are."""
    cache.layers = [GrowingKVLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer
                    for layer in cache.layers]
    return cache


class HybridPreTrainedModel(PreTrainedModel):
    config: HybridConfig
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GatedDeltaNet):
            module.reset_dynamics()
            module.o_norm.weight.fill_(1.0)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    """Causal LM whose decoder is the teacher family's base model with GDN mixers in the converted layers."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        teacher = config.teacher_config
        self.model = AutoModel.from_config(teacher, attn_implementation=config._attn_implementation)
        head_dim = getattr(teacher, "head_dim", None) or teacher.hidden_size // teacher.num_attention_heads
        for i in config.gdn_layers:
            self.model.layers[i].self_attn = GatedDeltaNet(
                teacher.hidden_size, teacher.num_attention_heads, head_dim, config.gdn_norm_eps, layer_idx=i
            )
        self.lm_head = nn.Linear(teacher.hidden_size, teacher.vocab_size, bias=False)
        self.post_init()

    def gdn(self, layer: int) -> GatedDeltaNet:
        return self.model.layers[layer].self_attn

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            use_growing_kv(cache)  # also the caches generate() and callers make
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache,
            linear_attention_mask=padding_mask(attention_mask, length), **kwargs,
        )
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)


AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)
