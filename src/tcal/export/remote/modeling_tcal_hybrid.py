"""A tcal hybrid student (a Transformer with some attention layers replaced by Gated DeltaNet mixers) for
transformers, with nothing but torch and transformers: this file ships inside the checkpoint and is loaded with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. Written by tcal's `tcal-export --format hf`.

The model is the teacher's own base model (LlamaModel, Qwen2Model, Qwen3Model, built from `teacher_config`) with the
`self_attn` of every `linear_attention` layer replaced by `GatedDeltaNet` below, so kept layers run transformers'
attention code unchanged and weight names are the teacher's. One GDN layer, per head (d = head_dim):

    q, k, v = l2norm(silu(Wq x)), l2norm(silu(Wk x)), silu(Wv x)
    g = -exp(A_log) * softplus(Wa x + dt_bias)         (log decay)      beta = sigmoid(Wb x)
    S_t = exp(g_t) (S_{t-1} - beta_t S_{t-1} k_t k_t^T) + beta_t v_t k_t^T,   o_t = S_t q_t / sqrt(d)
    y = Wo (RMSNorm_eps(o) * w * silu(Wg x))

The state S is float32 [B, H, d, d] in transformers' hybrid `DynamicCache`. Prompts run the chunked form of the
recurrence (chunks of 64: the WY representation, exact up to float rounding), decoding one step at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

LINEAR = "linear_attention"
CHUNK = 64
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


def chunked_delta_rule(q, k, v, g, beta, state):
    """The recurrence over a whole prompt. q, k, v: [B, H, T, d] float32 (q, k l2-normalized, q scaled); g, beta:
    [B, H, T]; state [B, H, d, d] (S^T: key rows, value columns). Within a chunk, with G the cumulative log decay,
    the corrected values U = (I + A)^-1 (beta V - beta exp(G) K S) come from a unit lower-triangular solve
    (A_ij = beta_i exp(G_i - G_j) k_i.k_j for i > j); the output is exp(G) Q S + (Q K^T * decay, causal) U and the
    state moves on as exp(G_last) S + (exp(G_last - G) K)^T U."""
    B, H, T, d = q.shape
    pad = (-T) % CHUNK
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = q.shape[2] // CHUNK
    q, k, v = (t.reshape(B, H, n, CHUNK, d) for t in (q, k, v))
    g, beta = g.reshape(B, H, n, CHUNK), beta.reshape(B, H, n, CHUNK)
    G = g.cumsum(-1)
    strict = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool), -1)
    causal = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool))
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0)
    eye = torch.eye(CHUNK)
    inverse = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    u_base = inverse @ (v * beta[..., None])
    w = inverse @ (kb * G.exp()[..., None])
    qk = q @ k.transpose(-1, -2) * decay
    q_decayed = q * G.exp()[..., None]
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]
    out = []
    for i in range(n):
        u = u_base[:, :, i] - w[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * G[:, :, i, -1].exp()[..., None, None] + k_decayed[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(B, H, n * CHUNK, d)[:, :, :T]
    return o, state


def recurrent_step(q, k, v, g, beta, state):
    """One token: q, k, v [B, H, d]; g, beta [B, H]; state [B, H, d, d]."""
    state = state * g.exp()[..., None, None]
    correction = v - (k.unsqueeze(-2) @ state).squeeze(-2)
    state = state + k.unsqueeze(-1) @ (correction * beta[..., None]).unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


class GatedDeltaNet(nn.Module):
    """The GDN mixer with tcal's (and fla's) parameter names; a decoder layer's `self_attn`."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, norm_eps: float, layer_idx: int):
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx, self.norm_eps = num_heads, head_dim, layer_idx, norm_eps
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.g_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim))
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)

    def heads(self, t):
        return t.view(*t.shape[:-1], self.num_heads, self.head_dim)

    def forward(self, hidden_states, attention_mask=None, cache=None, linear_attention_mask=None, **kwargs):
        x = hidden_states
        q = F.normalize(F.silu(self.heads(self.q_proj(x))).float(), dim=-1) * self.head_dim**-0.5
        k = F.normalize(F.silu(self.heads(self.k_proj(x))).float(), dim=-1)
        v = F.silu(self.heads(self.v_proj(x))).float()
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x).float())
        if linear_attention_mask is not None:
            keep = linear_attention_mask[:, -x.shape[1]:].to(g.dtype)[..., None]
            g, beta = g * keep, beta * keep
        layer = cache.layers[self.layer_idx] if cache is not None else None
        state = layer.recurrent_states[0] if layer is not None and layer.is_recurrent_states_initialized[0] else None
        if state is None:
            state = q.new_zeros(q.shape[0], self.num_heads, self.head_dim, self.head_dim)
        state = state.float()
        if x.shape[1] == 1:
            o, state = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]
        else:
            o, state = chunked_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), state)
            o = o.transpose(1, 2)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm.weight.float()
        y = o * F.silu(self.heads(self.g_proj(x)).float())
        return self.o_proj(y.flatten(-2).to(x.dtype)), None


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
        padding = None
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask[:, -length:].all()):
            padding = attention_mask[:, -length:]
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             linear_attention_mask=padding, **kwargs)
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)
