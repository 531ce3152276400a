"""Retained-layer policies: which layers stay softmax attention (docs/method.md, section "Retained-layer policies").

A policy is `fn(cfg, ctx) -> Selection`, registered by name; `cfg` is the `retention` config node and `ctx`
the run's `RunContext` (teacher, tokenizer, data splits, init config, cache folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tcal.registry import Registry

POLICIES = Registry("retention policy", __name__)


@dataclass
class Selection:
    keep_layers: list[int]
    scores: dict[int, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # what a policy measured besides the scores (results.json)


def select_layers(cfg, ctx) -> Selection:
    return POLICIES[cfg.name](cfg, ctx)
