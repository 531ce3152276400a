"""Progress bars that suit a terminal and a log file alike.

On a terminal a bar redraws in place, many times a second, at no cost. In a log file (a SLURM job's output, or
`tcal ... > log.txt`) every redraw stays: a run wrote thousands of carriage-return redraws, most of its log, and the
run's log lines joined the open line of a bar. So when a bar's stream is not a terminal, the bar draws at most every
`LOG_REDRAW_S` seconds (and its first and last states), each draw a line of its own (`DrawnLines`); on a terminal it
draws as tqdm does. Every bar of a run follows this:

- `progress(...)`: tqdm for tcal's own bars (calibration, retention, evaluation);
- `tcal.runtime.lightning_output.ProgressBar`: Lightning's bar, for the Trainers of the stages and of the evaluation;
- `throttle_transformers_bars()`: transformers' own bars ("Loading weights"), through its tqdm hook.
"""

from __future__ import annotations

import re
import sys

from tqdm.asyncio import tqdm as text_tqdm
from tqdm.auto import tqdm

LOG_REDRAW_S = 5.0
CURSOR_UP = "\x1b[A"  # tqdm moves between nested bars with it
WIDGET_BARS = tqdm is not text_tqdm  # tqdm.auto's bar: a widget in a notebook, text elsewhere


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (False for a file, a pipe, a closed stream, or an object without isatty)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def draws_in_place(stream) -> bool:
    """Whether a bar on `stream` redraws in place: on a terminal, or as a notebook's widget."""
    return WIDGET_BARS or is_terminal(stream)


class DrawnLines:
    """A log file as a bar's stream: each draw of the bar (tqdm writes a carriage return, the bar and blanks) is
    written as a line of its own; what only moves or clears a line on a terminal (a bar's final newline, a cleared
    bar, cursor moves) is left out. So a bar never leaves a line open for the run's next log line to join."""

    def __init__(self, stream):
        self.stream = stream
        self.last_line = ""

    def write(self, text: str) -> int:
        for piece in re.split(r"[\r\n]", str(text).replace(CURSOR_UP, "")):
            line = piece.rstrip()
            if line.strip() and line != self.last_line:  # a redraw of the same state is no news
                self.stream.write(line + "\n")
                self.last_line = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # encoding, fileno, isatty: the stream's
        return getattr(self.stream, name)


def for_log_files(kwargs: dict) -> dict:
    """tqdm's keyword arguments for its stream (`file`, else stderr): unchanged for a terminal or a notebook (whose
    widget draws in place); for anything else the stream as `DrawnLines` and `mininterval` `LOG_REDRAW_S` (unless
    one is given)."""
    stream = kwargs.get("file") or sys.stderr
    if draws_in_place(stream) or isinstance(stream, DrawnLines):
        return kwargs
    return {"mininterval": LOG_REDRAW_S, **kwargs, "file": DrawnLines(stream)}


def progress(iterable=None, **kwargs) -> tqdm:
    """`tqdm(iterable, **kwargs)` (tqdm.auto: a widget in a notebook) that, when its stream (`file`, else stderr) is
    not a terminal, draws at most every `LOG_REDRAW_S` seconds, each draw a line (`for_log_files`): a log file gets
    a few lines per bar. On a terminal it draws as tqdm does."""
    return tqdm(iterable, **for_log_files(kwargs))


def _throttled_transformers_bar(factory, args: tuple, kwargs: dict):
    return factory(*args, **for_log_files(kwargs))


def throttle_transformers_bars() -> None:
    """Give transformers' bars (e.g. "Loading weights" in `from_pretrained`) the redraw interval of `progress`,
    through transformers' supported hook (`transformers.utils.logging.set_tqdm_hook`); a hook someone else set
    is kept. The GGUF conversion's bar is not made by that hook: it draws as tqdm does, once per cache."""
    from transformers.utils import logging as transformers_logging

    earlier = transformers_logging.set_tqdm_hook(_throttled_transformers_bar)
    if earlier is not None and earlier is not _throttled_transformers_bar:
        transformers_logging.set_tqdm_hook(earlier)
