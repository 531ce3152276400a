"""Crash-safe writes: results, reports, cache entries and exported folders appear whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
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


def write_folder_atomic(folder: str | Path, write: Callable[[Path], None], replace: bool = True) -> Path:
    """`write(tmp)` into a temporary sibling folder, then rename it to `folder`. With `replace=False` (a cache
    folder that a parallel job may have finished first) an existing folder is kept and ours is dropped."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        write(tmp)
        if folder.exists() and not replace:
            shutil.rmtree(tmp)
            return folder
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
