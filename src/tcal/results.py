"""Crash-safe writes: results, reports, cache entries and exported folders appear whole or not at all.

Whatever is written gets the modes of a plain `open` under the user's umask (files 0666, folders 0777, less
the umask), not the 0600/0700 of the temporary files it starts as: a cache shared by a team stays readable.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask (Linux reports it; elsewhere it is read by setting it and putting it back)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def chmod_as_created(path: Path) -> None:
    """The mode `path` (and, for a folder, everything in it) would have had if created by `open` / `mkdir`
    under the current umask."""
    mask = umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file in the same folder, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        chmod_as_created(Path(tmp))  # after `write`: some writers (safetensors) replace the file
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


def null_non_finite(data, path: str = "") -> list[str]:
    """Replace every NaN or infinite float in `data` (nested dicts and lists, changed in place) by None, so its
    JSON holds no non-standard NaN / Infinity token; returns the replaced values as "dotted.path=value"."""
    found: list[str] = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(data, list) else f"{path}.{key}" if path else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            data[key] = None
            found.append(f"{where}={value}")
        else:
            found += null_non_finite(value, where)
    return found


def write_folder_atomic(folder: str | Path, write: Callable[[Path], None], replace: bool = True) -> Path:
    """`write(tmp)` into a temporary sibling folder, then rename it to `folder`. With `replace=False` (a cache
    folder that a parallel job may have finished first) an existing folder is kept and ours is dropped."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    try:
        write(tmp)
        chmod_as_created(tmp)
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
