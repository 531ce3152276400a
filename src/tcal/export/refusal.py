"""Why an export is not written: one line each, exit code 2 (`ExportRefused`) or 1 (`ParityFailed`)."""

from __future__ import annotations

from tcal.errors import ConfigError


class ExportRefused(ConfigError):
    """The format cannot hold this student exactly (or the source is not a student): refused before any work."""


class ParityFailed(RuntimeError):
    """What was written does not reproduce the student on the fixed prompts; nothing is left at the destination."""
