"""The one place signals are handled: SIGTERM (what SLURM sends on preemption or time-out), SIGINT (Ctrl-C),
SIGUSR1 (SLURM's warning before the time limit) and SIGHUP (a closed terminal) stop a run wherever it is, as an
`Interrupted` error. Lightning's own handlers are never installed (`quiet_signal_connector`).

`handling()` (a context manager and decorator) installs the handler for the outermost block that uses it (the
`tcal` entry, `tcal.pipeline.run`, every step of `tcal.api`) and restores the handlers it found when that block
ends. The handler raises `Interrupted(signum)` at the point the signal arrives; it travels through Lightning
untouched, unlike a KeyboardInterrupt, which Lightning turns into `sys.exit(1)`. Leaving the outermost block, an
interrupt by SIGINT becomes `KeyboardInterrupted`, a KeyboardInterrupt, so that a notebook's Ctrl-C inside
`api.distill` raises what Python users expect, never SystemExit. A second signal while the first one unwinds is
noted in the log and otherwise ignored, so the record of the interrupt is written whole.

What an interrupt leaves: the run's record `failed`, its error `interrupted by SIGTERM (signal 15)` and the
status it had reached (`tcal.store.record.records_failure`); `tcal` exits with 128 + the signal's number
(`tcal.cli.app`); a sweep lists the job it stopped and the jobs that did not run (`tcal.cli.sweep`). A resume continues
from the last checkpoint, as after a kill.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

# SIGHUP: the terminal that started the run closed
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


class Interrupted(BaseException):
    """A run stopped by a signal. A BaseException, like KeyboardInterrupt: `except Exception` does not swallow it."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(self.signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by the signal, and what `tcal` exits with."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name} (signal {self.signum})"


class KeyboardInterrupted(Interrupted, KeyboardInterrupt):
    """An interrupt by SIGINT, as the library raises it: a KeyboardInterrupt."""


def as_interrupt(err: BaseException) -> Interrupted | None:
    """`err` as an Interrupted (a bare KeyboardInterrupt, raised where no handler was installed, is SIGINT)."""
    if isinstance(err, Interrupted):
        return err
    if isinstance(err, KeyboardInterrupt):
        return KeyboardInterrupted(signal.SIGINT)
    return None


_depth = 0
_saved: dict[int, object] = {}
_received: list[int] = []
# called with the signal's number as the handler takes a signal, before it raises (a rank arms its exit there)
on_signal: list[Callable[[int], None]] = []


def _handler(signum, frame) -> None:
    if _received:
        log.warning("%s received while stopping for %s; finishing the record first", signal.Signals(signum).name,
                    signal.Signals(_received[0]).name)
        return
    _received.append(signum)
    log.warning("%s received: stopping the run", signal.Signals(signum).name)
    for hook in on_signal:
        hook(signum)
    raise Interrupted(signum)


def quiet_signal_connector(trainer):
    """A Lightning signal connector for `trainer` that installs no handler, so this module's handler stays the only
    one while a Trainer runs. Lightning's SIGTERM handler broadcasts a tensor from inside the handler: when every rank
    is signalled at once and one of them is blocked in another collective (where no Python runs until it returns),
    that broadcast never completes and every rank hangs until the process group's timeout. Ours raises where the
    signal lands and enters no collective. Installed by `tcal.runtime.lightning_output.LeaveSignalsToTcal`."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    class QuietSignalConnector(_SignalConnector):
        def register_signal_handlers(self) -> None:
            self.received_sigterm = False
            self._original_handlers = {}

    return QuietSignalConnector(trainer)


@contextlib.contextmanager
def _installed():
    global _depth
    outermost = _depth == 0 and threading.current_thread() is threading.main_thread()
    if outermost:
        _received.clear()
        for signum in SIGNALS:
            _saved[signum] = signal.signal(signum, _handler)
    _depth += 1
    try:
        yield
    except Interrupted as err:
        if outermost and err.signum == signal.SIGINT and not isinstance(err, KeyboardInterrupt):
            converted = KeyboardInterrupted(err.signum)
            converted.__dict__.update(err.__dict__)  # where it stopped (run folder, sweep job)
            raise converted from None
        raise
    finally:
        _depth -= 1
        if outermost:
            for signum, handler in _saved.items():
                signal.signal(signum, handler)
            _saved.clear()


def handling(function=None):
    """`with handling():` or `@handling`: the block (or function) stops on SIGTERM, SIGINT and SIGUSR1 with
    `Interrupted` (see the module doc). Nested blocks share the outermost block's handler."""
    if function is None:
        return _installed()

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _installed():
            return function(*args, **kwargs)

    return wrapper
