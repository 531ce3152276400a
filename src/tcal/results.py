"""Crash-safe writes: results, reports and checkpoints appear whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file in the same folder, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be read by others
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    return write_atomic(path, write)


def write_json_atomic(path: str | Path, data) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")
