"""How many worker processes a pool of this library starts, decided where it forks: what was asked (`data.workers`;
None: one per CPU), at most the CPUs this process may use and at most the tasks there are. The command line refuses
more workers than CPUs before any work (`tcal.preflight.check_resources`); the Python API, which has no such check,
is bounded here, with a warning that says so."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool_size(asked: int | None, what: str) -> int:
    """The most processes a pool started for `what` (its setting, named in the warning) may have: `asked`, or one
    per CPU where None; never more than the CPUs this process may use, never fewer than one. The pool bounds it by
    its tasks too (a pool of more workers than tasks leaves the rest idle)."""
    cpus = usable_cpus()
    if asked and int(asked) > cpus:
        log.warning("%s=%d: at most %d worker processes, the CPUs this process may use", what, int(asked), cpus)
    return max(1, min(int(asked) if asked else cpus, cpus))
