"""Exclusive locks on files that say who holds them: a run's hold on its folder, a cache entry being built.

A lock is a POSIX `flock` on a small file that holds its holder's pid, host and start time (JSON). The kernel
drops the lock when its holder exits, however it ends (SIGKILL too), so a hold left by a dead process is no
hold: the next taker gets it and says whose stale hold it took over. A process that finds the lock held reads
who holds it, to refuse with one line naming the holder (`hold`) or to say what it waits for (`wait_for`).
Without flock (Windows) locks are not taken; on a filesystem whose flock fails (NFS without a lock daemon, Lustre
mounted with noflock) the run is refused in one line naming the folder (`LocksUnsupported`), before any work.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from tcal.errors import ConfigError

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # no flock
    fcntl = None


# what flock says on a filesystem that has no locks (NFS without a lock daemon, Lustre mounted with noflock, ...)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LocksUnsupported(ConfigError):
    """A run folder or cache on a filesystem without `flock`: one run per folder and one builder per cache entry
    cannot be kept there, so it is refused before any work, naming the folder."""

    def __init__(self, path: Path, err: OSError):
        super().__init__(f"{Path(path).parent}: its filesystem does not support file locks (flock: "
                         f"{os.strerror(err.errno)}); expected run and cache folders on a filesystem with locks: put "
                         f"paths.cache_dir and paths.output_dir on node-local or lock-capable storage")


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


def _open_locked(path: Path, blocking: bool):
    """The open lock file at `path`, locked; None when `blocking` is off and another process holds it. The file
    locked is the one at `path` now (a holder that removed it on release leaves an unlinked one behind)."""
    while True:
        handle = open(path, "ab", buffering=0)  # unbuffered: nothing left to flush on a full disk
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return None
        except OSError as err:
            handle.close()
            if err.errno in NO_LOCKS:
                raise LocksUnsupported(path, err) from None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()


@contextlib.contextmanager
def locked(path: str | Path, wait: bool = True, on_wait: Callable[[dict], None] | None = None,
           remove: bool = False) -> Iterator[bool]:
    """Hold the lock at `path`; yields whether it is held. With `wait=False` it is not when another process holds
    it; otherwise `on_wait(holder)` is called once before waiting for it. With `remove`, the lock file (and its
    folder, when that is left empty) is removed on release, so a hold leaves nothing behind."""
    path = Path(path)
    if fcntl is None:
        yield True
        return
    made = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = _open_locked(path, blocking=False)
    if handle is None:
        if not wait:
            yield False
            return
        if on_wait is not None:
            on_wait(holder_of(path))
        handle = _open_locked(path, blocking=True)
    with handle:
        try:
            with contextlib.suppress(OSError):  # who holds it is a courtesy: a full disk does not stop the lock
                _claim(handle, path)
            yield True
        finally:
            with contextlib.suppress(OSError):
                if remove:
                    path.unlink()
                    if made:
                        path.parent.rmdir()  # only when empty
                else:
                    os.ftruncate(handle.fileno(), 0)
            fcntl.flock(handle, fcntl.LOCK_UN)
