"""What Lightning's Trainers write to the console: each line once, no advertising, and a progress bar that does
not flood a log file. `trainer_callbacks` sets this up for every Trainer of a run (the stages' and the evaluation's).

- `log_once()`: `import lightning` adds a handler of its own to the `lightning` logger (lines as `INFO: ...` on
  stderr) and lets its records propagate too, so under Hydra's logging (the run's console and job log) each line
  came twice. Once logging is set up (the root logger has handlers), Lightning's own console handlers are removed.
- `drop_tips()`: Lightning's tip lines ("💡 Tip: ... try installing litlogger / litmodels ...") are filtered out;
  Lightning has no setting for them (Lightning-AI/pytorch-lightning#21294).
- `ProgressBar`: when stdout is not a terminal, a step is drawn at most every `tcal.runtime.progress.LOG_REDRAW_S` seconds,
  each draw a line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from tcal.runtime.progress import LOG_REDRAW_S, DrawnLines, draws_in_place
from tcal.runtime.signals import quiet_signal_connector

TIP_MARK = "💡"
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar (on stdout), the same figures. When stdout is not a terminal (a log file), it draws as
    `tcal.runtime.progress` bars do there: a training step or validation batch only when `LOG_REDRAW_S` seconds have passed
    since the bar's last draw (Lightning's own bar draws every one), each draw a line of its own; the evaluations
    between training steps draw no bar there (the stage logs each one's perplexities). On a terminal or in a notebook
    it is Lightning's bar unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.log_file = False

    def _made_for_stdout(self, make):
        """The bar `make()` gives (Lightning draws on `sys.stdout`), for a log file when stdout is one."""
        self.log_file = not draws_in_place(sys.stdout)
        if not self.log_file:
            return make()
        with contextlib.redirect_stdout(DrawnLines(sys.stdout)):
            bar = make()
        bar.mininterval = LOG_REDRAW_S
        return bar

    def init_sanity_tqdm(self):
        return self._made_for_stdout(super().init_sanity_tqdm)

    def init_train_tqdm(self):
        return self._made_for_stdout(super().init_train_tqdm)

    def init_validation_tqdm(self):
        if self.trainer.state.fn == "fit" and not draws_in_place(sys.stdout):
            return Tqdm(disable=True)
        return self._made_for_stdout(super().init_validation_tqdm)

    def init_test_tqdm(self):
        return self._made_for_stdout(super().init_test_tqdm)

    def init_predict_tqdm(self):
        return self._made_for_stdout(super().init_predict_tqdm)

    def _draws_every_batch(self, bar) -> bool:
        return not self.log_file or bar.disable or not self.is_enabled

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if self._draws_every_batch(bar):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.update(batch_idx + 1 - bar.n)  # tqdm draws only when the bar's mininterval has passed

    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        bar = self.val_progress_bar
        if self._draws_every_batch(bar):
            return super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        bar.update(batch_idx + 1 - bar.n)


def not_a_tip(record: logging.LogRecord) -> bool:
    return not record.getMessage().lstrip().startswith(TIP_MARK)


def drop_tips() -> None:
    """Lightning's tip lines are not logged; its other lines are (idempotent)."""
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not_a_tip not in logger.filters:
            logger.addFilter(not_a_tip)


def log_once() -> None:
    """When logging is set up (the root logger has handlers: Hydra's console and job log, or the caller's),
    Lightning's lines go through those only: the plain stream handlers Lightning's packages add to their loggers on
    import are removed and their records propagate. Without a setup they stay, the only ones to print its lines."""
    if not logging.getLogger().handlers:
        return
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


class LeaveSignalsToTcal(Callback):
    """Keeps Lightning from installing its signal handlers in the Trainer it is given to (its setup hook runs before
    the Trainer registers them): `tcal.runtime.signals` handles every signal, and Lightning's SIGTERM handler can hang
    a multi-rank run (`quiet_signal_connector`)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        trainer._signal_connector = quiet_signal_connector(trainer)


def trainer_callbacks(callbacks: list) -> list:
    """`callbacks` with tcal's `ProgressBar` unless they hold a progress bar already, and `LeaveSignalsToTcal`; from
    here on Lightning's lines are logged once and its tips not at all."""
    from lightning.pytorch.callbacks.progress import ProgressBar as AnyProgressBar

    log_once()
    drop_tips()
    if any(isinstance(callback, AnyProgressBar) for callback in callbacks):
        return [*callbacks, LeaveSignalsToTcal()]
    return [*callbacks, ProgressBar(), LeaveSignalsToTcal()]
