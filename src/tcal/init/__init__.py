"""Init modes: what happens to the naive GDN layers before evaluation (docs/method.md, section "Init modes").

An init mode is `fn(gdns, cfg, ctx) -> dict` registered by name: `gdns` maps layer index to that layer's
naive `GatedDeltaNet` (changed in place), `cfg` is the `init` config node, `ctx` the run's `RunContext`.
It returns what it measured (results.json "calibration"). A mode sees layers, not students, because a
layer's init never depends on which other layers are kept: GA-S2 initializes every layer once this way.
"""

from __future__ import annotations

from tcal.registry import Registry

INIT_MODES = Registry("init mode", __name__)


def apply_init(gdns: dict, cfg, ctx) -> dict:
    return INIT_MODES[cfg.name](gdns, cfg, ctx)


def init_student(student, cfg, ctx) -> dict:
    return apply_init({i: student.gdn(i) for i in student.config.gdn_layers}, cfg, ctx)
