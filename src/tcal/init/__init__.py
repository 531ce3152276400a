"""Init modes: what happens to the naive GDN layers before evaluation (docs/method.md, section "Init modes").

An init mode is an option of `tcal.registry.INIT_MODES`, `fn(gdns, init, ctx) -> dict`: `gdns` maps layer index to
that layer's naive `GatedDeltaNet` (changed in place), `init` is the mode's settings (its registered class), `ctx`
the run's `RunContext`. It returns what it measured (results.json "calibration"). A mode sees layers, not students,
because a layer's init never depends on which other layers are kept: GA-S2 initializes every layer once this way.
"""

from __future__ import annotations

from tcal.registry import INIT_MODES
from tcal.settings.init import InitSettings


def apply_init(gdns: dict, init: InitSettings, ctx) -> dict:
    return INIT_MODES[init.name].implementation(gdns, init, ctx)


def init_student(student, init: InitSettings, ctx) -> dict:
    return apply_init({i: student.gdn(i) for i in student.config.gdn_layers}, init, ctx)
