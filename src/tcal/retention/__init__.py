"""Retained-layer policies: which layers stay softmax attention (docs/method.md, section "Retained-layer policies").

A policy is an option of `tcal.registry.POLICIES`, `fn(retention, ctx) -> Selection`: `retention` is the policy's
settings (its registered class), `ctx` the run's `RunContext` (teacher, tokenizer, data splits, init settings,
cache folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tcal.registry import POLICIES


@dataclass
class Selection:
    keep_layers: list[int]
    scores: dict[int, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # what a policy measured besides the scores (results.json)


def select_layers(retention, ctx) -> Selection:
    return POLICIES[retention.name].implementation(retention, ctx)
