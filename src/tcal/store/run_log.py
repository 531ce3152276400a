"""The run's log file (`hydra.job_logging.handlers.file`, conf/config.yaml): a write the filesystem refuses (a full
disk) stops the run like any other refused write, with `tcal`'s one line and exit code 1, instead of logging's
traceback on stderr for every later line while the run goes on."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tcal.store.files import os_error_of, write_failure


class RunLogFile(logging.FileHandler):
    """`logging.FileHandler` whose first refused write raises `WriteFailed` naming the file (from the logging call
    that met it); after that it writes nothing more, so the run's failure path can log without meeting it again."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        refused = os_error_of(sys.exc_info()[1]) if sys.exc_info()[1] is not None else None
        if refused is None or self.failed:
            return super().handleError(record)
        self.failed = True
        raise write_failure(Path(self.baseFilename), refused, kept=False) from None
