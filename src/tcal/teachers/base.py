"""What the conversion needs to know about a teacher family, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class TeacherAdapter:
    """Where a family keeps its decoder layers and attention, its head counts, and what the GDN drops.

    `dropped` names attention parameters with no place in a GDN layer (biases, q/k norms); the conversion
    logs them. The three supported families share the `model.layers[i].self_attn.{q,k,v,o}_proj` layout. The
    `model_type` a family serves is its name in `tcal.registry.TEACHER_FAMILIES`.
    """

    family: str
    dropped: tuple[str, ...] = ()

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        base = getattr(model, "model", model)
        return base.layers

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.decoder_layers(model)[layer].self_attn

    def heads(self, config) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim)."""
        query_heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or query_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // query_heads
        return query_heads, kv_heads, head_dim

    def check(self, model: nn.Module) -> None:
        """Refuse teachers whose attention has parts the conversion cannot carry over silently."""
        attn = self.attention(model, 0)
        if getattr(attn.o_proj, "bias", None) is not None:
            raise ValueError(f"{self.family} teacher has an o_proj bias; the GDN output projection has none")
