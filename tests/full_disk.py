"""`python tests/full_disk.py PATTERN open|write ARGS...`: `tcal ARGS...` on a disk that is full for the files whose
absolute path matches PATTERN (fnmatch): opening one for writing raises ENOSPC (`open`), or it opens and every write
to it fails with ENOSPC, as on a full disk (`write`: its descriptor is /dev/full's). Run by tests/test_full_disk.py
in a process of its own; it covers Python's open (Hydra's and tcal's writes, logging's file handler) and os.open
(temporary files). With FULL_DISK_SKIP=N the first N files that match are written (the disk fills later); the
number of files that matched is the last line on stderr."""

from __future__ import annotations

import atexit
import builtins
import errno
import fnmatch
import io
import logging
import os
import sys

PATTERN, WHEN, *ARGS = sys.argv[1:]
SKIP = int(os.environ.get("FULL_DISK_SKIP", "0"))  # this many matching files are written before the disk is full
REAL_OPEN, REAL_OS_OPEN = builtins.open, os.open
matched: list[str] = []


def is_full(path) -> bool:
    if not isinstance(path, (str, os.PathLike)) or not fnmatch.fnmatch(os.path.abspath(os.fspath(path)), PATTERN):
        return False
    matched.append(os.fspath(path))
    return len(matched) > SKIP


def enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))


def fill(fd: int) -> None:
    """Every later write to `fd` meets a full disk (ENOSPC): it now points at /dev/full."""
    full = REAL_OS_OPEN("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)


def full_open(file, mode="r", *args, **kwargs):
    full = any(c in mode for c in "wax+") and is_full(file)
    if full and WHEN == "open":
        raise enospc(file)
    handle = REAL_OPEN(file, mode, *args, **kwargs)
    if full:
        fill(handle.fileno())
    return handle


def full_os_open(path, flags, *args, **kwargs):
    full = flags & (os.O_WRONLY | os.O_RDWR) and is_full(path)
    if full and WHEN == "open":
        raise enospc(path)
    fd = REAL_OS_OPEN(path, flags, *args, **kwargs)
    if full:
        fill(fd)
    return fd


builtins.open = io.open = full_open
logging.FileHandler._builtin_open = staticmethod(full_open)
os.open = full_os_open
sys.argv = ["tcal", *ARGS]
atexit.register(lambda: print(f"full_disk: {len(matched)} files matched", file=sys.stderr))

from tcal.cli.app import main  # noqa: E402 - after the disk is made full

main()
