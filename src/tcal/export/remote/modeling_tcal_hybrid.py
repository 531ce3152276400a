"""A tcal hybrid student (a Transformer with some attention layers replaced by Gated DeltaNet mixers) for
transformers, with nothing but torch and transformers: this file ships inside the checkpoint and is loaded with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`.

The model is the teacher's own base model (LlamaModel, Qwen2Model, Qwen3Model, built from `teacher_config`) with the
`self_attn` of every `linear_attention` layer replaced by a `GatedDeltaNet`, so kept layers run transformers'
attention code unchanged and weight names are the teacher's. The GDN layer, its equations and shapes are tcal's own
(`tcal.student.gdn_torch`, torch alone): `tcal-export --format hf` writes this file with the line importing them
replaced by that module's text (`tcal.export.remote.modeling_code`).
"""

from __future__ import annotations

from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from tcal.student.gdn_torch import GatedDeltaNet, padding_mask

LINEAR = "linear_attention"
MIRRORED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window", "bos_token_id", "eos_token_id",
            "pad_token_id")


class TcalHybridConfig(PreTrainedConfig):
    """The teacher's config (`teacher_config`) plus `layer_types` (`linear_attention` marks a GDN layer) and the
    GDN's norm eps; the teacher's sizes are mirrored at the top level, where generation and caches read them."""

    model_type = "tcal_hybrid_hf"  # not tcal's own `tcal_hybrid`: where tcal is installed, this code still loads
    sub_configs = {"teacher_config": AutoConfig}

    def __init__(self, teacher_config=None, layer_types=None, gdn_norm_eps: float = 1e-5, use_cache: bool = True,
                 **kwargs):
        if isinstance(teacher_config, dict):
            teacher_config = AutoConfig.for_model(**teacher_config)
        self.teacher_config = teacher_config
        self.layer_types = list(layer_types) if layer_types is not None else None
        self.gdn_norm_eps = gdn_norm_eps
        self.use_cache = use_cache  # a plain `model(input_ids)` reads it: the base config no longer declares it
        for name in MIRRORED:
            kwargs.pop(name, None)
        kwargs["tie_word_embeddings"] = bool(getattr(teacher_config, "tie_word_embeddings", False))
        super().__init__(**kwargs)
        if teacher_config is not None:
            for name in MIRRORED:
                setattr(self, name, getattr(teacher_config, name, None))

    def to_dict(self):
        out = super().to_dict()
        if isinstance(self.teacher_config, PreTrainedConfig):
            out["teacher_config"] = self.teacher_config.to_dict()
        return out


class TcalHybridPreTrainedModel(PreTrainedModel):
    config_class = TcalHybridConfig
    base_model_prefix = "model"
    _supports_sdpa = True
    _supports_attention_backend = True


class TcalHybridForCausalLM(TcalHybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TcalHybridConfig):
        super().__init__(config)
        teacher = config.teacher_config
        self.model = AutoModel.from_config(teacher, attn_implementation=config._attn_implementation)
        head_dim = getattr(teacher, "head_dim", None) or teacher.hidden_size // teacher.num_attention_heads
        for i, kind in enumerate(config.layer_types):
            if kind == LINEAR:
                self.model.layers[i].self_attn = GatedDeltaNet(teacher.hidden_size, teacher.num_attention_heads,
                                                               head_dim, config.gdn_norm_eps, i)
        self.lm_head = nn.Linear(teacher.hidden_size, teacher.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             linear_attention_mask=padding_mask(attention_mask, length), **kwargs)
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)
