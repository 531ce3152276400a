"""Exclusive locks on files that say who holds them: a run's hold on its folder, a cache entry being built.

A lock is a POSIX `flock` on a small file that holds its holder's pid, host and start time (JSON). The kernel
drops the lock when its holder exits, however it ends (SIGKILL too), so a hold left by a dead process is no
hold: the next taker gets it and says whose stale hold it took over. A process that finds the lock held reads
who holds it, to refuse with one line naming the holder (`hold`) or to say what it waits for (`wait_for`).
Without flock (Windows) locks are not taken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # no flock
    fcntl = None


def holder_of(path: Path) -> dict:
    """What the lock file says about its holder ({} when unreadable or empty)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(holder: dict) -> str:
    if not holder:
        return "another process (it has not said which yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"


def _claim(handle, path: Path) -> None:
    """Write this process as the holder (the lock is held)."""
    earlier = holder_of(path)
    if earlier and (earlier.get("pid"), earlier.get("host")) != (os.getpid(), socket.gethostname()):
        log.info("%s: taking over the stale hold of %s (that process no longer holds it)", path,
                 describe_holder(earlier))
    claim = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                        "command": " ".join(sys.argv)[:500]})
    os.ftruncate(handle.fileno(), 0)
    os.pwrite(handle.fileno(), claim.encode(), 0)


@contextlib.contextmanager
def locked(path: str | Path, wait: bool = True, on_wait: Callable[[dict], None] | None = None) -> Iterator[bool]:
    """Hold the lock at `path`; yields whether it is held. With `wait=False` it is not when another process holds
    it; otherwise `on_wait(holder)` is called once before waiting for it."""
    path = Path(path)
    if fcntl is None:
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab", buffering=0) as handle:  # unbuffered: nothing left to flush on a full disk
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if on_wait is not None:
                on_wait(holder_of(path))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(OSError):  # who holds it is a courtesy: a full disk does not stop the lock
                _claim(handle, path)
            yield True
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(handle.fileno(), 0)
            fcntl.flock(handle, fcntl.LOCK_UN)
