"""Naive conversion (docs/method.md, section "Naive conversion"): teacher + keep list -> hybrid student.

Kept layers keep the teacher's attention module; GDN layers take Wq and Wo as they are and Wk, Wv
expanded from the KV heads to the query heads. Everything else is copied unchanged.
"""

from __future__ import annotations

import itertools
import logging

import torch

from tcal.settings import derived_seed
from tcal.settings.init import GQA_EXPANSIONS
from tcal.settings.retention import validate_keep_layers
from tcal.student.gdn import GatedDeltaNet
from tcal.student.hybrid import LINEAR, HybridConfig, HybridForCausalLM, teacher_layer_types
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)



def expand_kv(weight: torch.Tensor, kv_heads: int, query_heads: int, head_dim: int, mode: str = "whole_head"):
    """[Hkv*dh, D] -> [Hq*dh, D]. `whole_head`: query head i reads KV head i // g.
    `row_repeat` reproduces the reference code, which repeats single rows and scrambles heads."""
    group = query_heads // kv_heads
    if mode == "whole_head":
        per_head = weight.view(kv_heads, head_dim, weight.shape[-1])
        return per_head.repeat_interleave(group, dim=0).reshape(query_heads * head_dim, -1)
    if mode == "row_repeat":
        return weight.repeat_interleave(group, dim=0)
    raise ValueError(f"gqa_expansion={mode!r}; expected one of {GQA_EXPANSIONS}")


def hybrid_config(teacher_config, keep_layers) -> HybridConfig:
    """The student's config: the teacher's, with a GDN in every layer outside `keep_layers`."""
    own = teacher_layer_types(teacher_config)
    keep = set(validate_keep_layers(keep_layers, len(own)))
    layer_types = [kind if i in keep else LINEAR for i, kind in enumerate(own)]
    config = HybridConfig(teacher_config=teacher_config.to_dict(), layer_types=layer_types)
    config._attn_implementation = teacher_config._attn_implementation
    return config


def meta_student(teacher_config, keep_layers, dtype: torch.dtype = torch.float32) -> HybridForCausalLM:
    """The hybrid student's shapes on the meta device (no weights, no conversion): for counting and planning."""
    with torch.device("meta"):
        return HybridForCausalLM(hybrid_config(teacher_config, keep_layers)).to(dtype)


@torch.no_grad()
def convert_layer(gdn, attention, adapter, config, gqa_expansion: str, generator: torch.Generator) -> None:
    """Teacher attention -> GDN weights; new parameters at fla's defaults (seeded)."""
    query_heads, kv_heads, head_dim = adapter.heads(config)
    gdn.q_proj.weight.copy_(attention.q_proj.weight)
    gdn.k_proj.weight.copy_(expand_kv(attention.k_proj.weight, kv_heads, query_heads, head_dim, gqa_expansion))
    gdn.v_proj.weight.copy_(expand_kv(attention.v_proj.weight, kv_heads, query_heads, head_dim, gqa_expansion))
    gdn.o_proj.weight.copy_(attention.o_proj.weight)
    for linear in (gdn.a_proj, gdn.b_proj, gdn.g_proj):
        bound = 1.0 / linear.in_features**0.5  # nn.Linear's default (kaiming uniform, a=sqrt(5))
        # drawn in float32 on the CPU (the generator's device), whatever the layer's dtype and device
        draw = torch.empty(linear.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        linear.weight.copy_(draw)
    gdn.o_norm.weight.fill_(1.0)
    gdn.reset_dynamics(generator)


def layer_generator(seed: int, layer: int) -> torch.Generator:
    """One RNG per layer, so a layer's naive init does not depend on which other layers are converted."""
    return torch.Generator().manual_seed(derived_seed(seed, 100_003, layer))


def naive_gdn(teacher, layer: int, gqa_expansion: str = "whole_head", seed: int = 0) -> GatedDeltaNet:
    """The naive GDN for one teacher layer on its own, identical to that layer in any `build_student` result."""
    adapter = adapter_for(teacher.config)
    query_heads, _, head_dim = adapter.heads(teacher.config)
    gdn = GatedDeltaNet(teacher.config.hidden_size, query_heads, head_dim, layer_idx=layer)
    gdn.to(next(teacher.parameters()).dtype)
    convert_layer(gdn, adapter.attention(teacher, layer), adapter, teacher.config, gqa_expansion,
                  layer_generator(seed, layer))
    return gdn


def take_buffers(student, teacher) -> None:
    """The teacher's buffers, in their own dtype, replace the student's of the same name: `.to(dtype)` cast the
    student's RoPE frequencies to the weights' dtype, while transformers keeps the teacher's in float32."""
    own = dict(student.named_buffers())
    for name, buffer in teacher.named_buffers():
        if name in own:
            module_name, _, attr = name.rpartition(".")
            module = student.get_submodule(module_name)
            module.register_buffer(attr, buffer.clone(), persistent=attr not in module._non_persistent_buffers_set)


def _copies(state: dict) -> dict:
    """A clone of each tensor of `state` (same device and dtype), one per storage: tied entries stay tied."""
    clones: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key not in clones:
            clones[key] = tensor.detach().clone()
        out[name] = clones[key]
    return out


def build_student(teacher, keep_layers, gqa_expansion: str = "whole_head", seed: int = 0) -> HybridForCausalLM:
    """The naive hybrid student: a copy of the teacher with GDN mixers outside `keep_layers`, on the teacher's
    device and in its dtype.

    Built on the meta device and filled by assignment, so building it holds one copy of the student's weights in
    their dtype and nothing more (1.005x them for Qwen2.5-1.5B's architecture in bfloat16, against 1.44x for a random
    student first: `make bench ARGS="host_memory host_memory_replaced"`). Every weight comes from the
    teacher or from the per-layer generators (`layer_generator`): no global RNG draw is involved, and the weights
    are those of a student initialized at random and then overwritten."""
    if gqa_expansion not in GQA_EXPANSIONS:
        raise ValueError(f"gqa_expansion={gqa_expansion!r}; expected one of {GQA_EXPANSIONS}")
    adapter = adapter_for(teacher.config)
    first = next(teacher.parameters())
    student = meta_student(teacher.config, keep_layers, first.dtype)
    config = student.config
    converted = tuple(f"model.layers.{i}.self_attn." for i in config.gdn_layers)
    state = teacher.state_dict()
    kept_state = _copies({k: v for k, v in state.items() if not k.startswith(converted)})
    missing, unexpected = student.load_state_dict(kept_state, strict=False, assign=True)
    del kept_state
    stray = [k for k in missing if not k.startswith(converted)]
    if stray or unexpected:
        raise RuntimeError(f"teacher and student disagree outside converted layers: missing {stray}, unexpected {unexpected}")
    take_buffers(student, teacher)
    dropped = sorted({k.split("self_attn.")[1] for k in state if k.startswith(converted)} & set(adapter.dropped))
    if dropped:
        log.info("conversion drops teacher %s (no place in a GDN layer)", ", ".join(dropped))
    del state
    for i in config.gdn_layers:
        student.gdn(i).to_empty(device=first.device)
        convert_layer(student.gdn(i), adapter.attention(teacher, i), adapter, teacher.config, gqa_expansion,
                      layer_generator(seed, i))
    student.tie_weights()
    left = [name for name, t in itertools.chain(student.named_parameters(), student.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"the student's {left[:5]} were not filled from the teacher or the conversion")
    student.eval()
    return student
