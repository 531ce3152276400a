"""Init modes: what happens to the naive student before evaluation (DESIGN section 5).

An init mode is `fn(student, cfg, ctx) -> dict` registered by name; `cfg` is the `init` config node, `ctx`
the run's `RunContext`. It changes the student in place and returns what it measured (for results.json
under "calibration").
"""

from __future__ import annotations

from tcal.registry import Registry

INIT_MODES = Registry("init mode", __name__)


def apply_init(student, cfg, ctx) -> dict:
    return INIT_MODES[cfg.name](student, cfg, ctx)
