"""The errors a user fixes in their input rather than in the code; `tcal` prints them on one line (exit code 2)."""

from __future__ import annotations

import math
import sys
from typing import Callable

CONFIG_ERROR_EXIT = 2


class ConfigError(ValueError):
    """A setting the run cannot use; raised before any work, so the run directory stays empty."""


class DataError(ConfigError):
    """Text the run cannot read (empty, not UTF-8, a bad jsonl line); names the file and the line."""


class HubUnavailable(ConnectionError, ConfigError):
    """A hub resource the run cannot reach (offline, not cached); both a connection and a configuration error."""


class FolderInUse(ConfigError):
    """A run folder that holds a run of another config: refused, so that no result is written over."""


class FolderHeld(FolderInUse):
    """A run folder a live run holds now: the run is someone else's to finish, not a fault of this command's."""


class DamagedCheckpoint(ConfigError):
    """A checkpoint a resumed run cannot read: named, before any work, with the record on disk left as it is."""


class Divergence(FloatingPointError):
    """A non-finite loss or perplexity: it stops the calibration or the stage where it appears, naming the step and
    the tokens; the last good checkpoint (and the record so far) is kept."""

    @classmethod
    def in_stage(cls, stage: str, what: str, value: float, step: int, tokens: int) -> Divergence:
        return cls(f"{stage}: {what} is {value} at step {step} (tokens_seen {tokens}); stopping with the last "
                   f"checkpoint kept")

    @classmethod
    def in_phase2(cls, layer: int, value: float, step: int, tokens: int) -> Divergence:
        """Phase 2 of one layer: that layer is left as it was before the step, and nothing of it is saved."""
        return cls(f"phase 2: alignment loss of layer {layer} is {value} at step {step} ({tokens} calibration "
                   f"tokens); stopping")


def check_finite(value, divergence: Callable[[float], Divergence]) -> None:
    """Raise `divergence(value)` when `value` (a number or a one-element tensor) is NaN or infinite."""
    value = value.item() if hasattr(value, "item") else float(value)
    if not math.isfinite(value):
        raise divergence(value)


def config_error_exit(err: Exception, program: str = "tcal") -> None:
    """Print a configuration error on one line of stderr and exit with code 2 (what every console script does)."""
    print(f"{program}: configuration error: {err}", file=sys.stderr, flush=True)
    sys.exit(CONFIG_ERROR_EXIT)
