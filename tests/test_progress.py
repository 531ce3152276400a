"""What a run writes to a log file (not a terminal): every progress bar draws at most every few seconds, each draw a
line of its own that no log line joins, Lightning's lines are written once, and Lightning's tips not at all. On a
terminal the bars are tqdm's and Lightning's own."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import lightning as L
import torch
from conftest import REPO, isolated_cache_dir
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from tcal.runtime.lightning_output import TIP_MARK, ProgressBar
from tcal.runtime.progress import LOG_REDRAW_S, DrawnLines, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def timed_loop(bar, steps: int, pause_s: float) -> float:
    """Advance `bar` `steps` times, `pause_s` apart; the seconds it took."""
    start = time.perf_counter()
    with bar:
        for _ in range(steps):
            time.sleep(pause_s)
            bar.update(1)
    return time.perf_counter() - start


def test_a_bar_in_a_log_file_draws_every_few_seconds_each_draw_a_line():
    steps, pause_s = 30, 0.01  # longer than tqdm's own interval: a plain bar redraws on its way
    plain_log, log = io.StringIO(), io.StringIO()
    timed_loop(tqdm(total=steps, file=plain_log), steps, pause_s)
    bar = progress(total=steps, file=log)
    assert bar.mininterval == LOG_REDRAW_S
    elapsed = timed_loop(bar, steps, pause_s)
    plain_draws = plain_log.getvalue().count("\r")
    lines = log.getvalue().splitlines()
    assert plain_draws > 2  # first, some on the way, last
    assert "\r" not in log.getvalue()
    assert 2 <= len(lines) <= 2 + elapsed // LOG_REDRAW_S  # first, last, and one per interval at most
    assert lines[0].startswith("  0%") and lines[-1].startswith("100%") and f"{steps}/{steps}" in lines[-1]


def test_a_bar_on_a_terminal_draws_as_tqdm_does():
    screen = Terminal()
    bar, plain = progress(total=3, file=screen), tqdm(total=3, file=Terminal())
    assert bar.mininterval == plain.mininterval
    bar.update(3)
    bar.close()
    plain.close()
    assert "\r" in screen.getvalue()  # redrawn in place


def test_a_log_line_after_a_draw_starts_a_line_of_its_own():
    log = io.StringIO()
    bar = progress(total=4, file=log, desc="calibrate")
    bar.update(1)
    log.write("[INFO] - layer 0 done\n")
    bar.close()
    lines = log.getvalue().splitlines()
    assert "[INFO] - layer 0 done" in lines
    assert all(line.startswith("calibrate") for line in lines if line != "[INFO] - layer 0 done")


def test_drawn_lines_leave_out_cursor_moves_cleared_bars_and_repeated_states():
    log = io.StringIO()
    lines = DrawnLines(log)
    for text in ("\rstep 1/3", "\rstep 1/3", "\n\x1b[A", "\r      \r", "\rstep 2/3  ", "\n"):
        lines.write(text)
    assert log.getvalue() == "step 1/3\nstep 2/3\n"


class TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).square().mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val", self.layer(batch).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_output(bar, steps: int, capsys) -> tuple[str, float]:
    """stdout (captured: not a terminal) of `steps` training steps with a validation halfway, and the seconds."""
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[bar], val_check_interval=steps // 2,
                        num_sanity_val_steps=0)
    capsys.readouterr()
    start = time.perf_counter()
    trainer.fit(TinyModule(), DataLoader(torch.randn(2 * steps, 4), batch_size=2),
                DataLoader(torch.randn(8, 4), batch_size=2))
    return capsys.readouterr().out, time.perf_counter() - start


def test_lightning_bar_in_a_log_file_draws_every_few_seconds_each_draw_a_line(capsys):
    steps = 100
    lightnings, _ = fit_output(TQDMProgressBar(), steps, capsys)
    ours, elapsed = fit_output(ProgressBar(), steps, capsys)
    assert lightnings.count("\r") >= steps  # Lightning's own bar: a redraw per step
    assert "\r" not in ours and "\x1b[A" not in ours
    drawn = [line for line in ours.splitlines() if line.startswith("Epoch 0")]
    assert drawn and f"{steps}/{steps}" in drawn[-1]
    assert len(drawn) <= 6 + elapsed // LOG_REDRAW_S  # start, the validation, the end; one per interval at most
    assert not any(line.startswith("Validation") for line in ours.splitlines())  # the stage logs each evaluation


def test_a_run_logs_lightnings_lines_once_no_tips_and_few_bar_lines(tmp_path):
    """`tcal` with a tiny Stage 2 of 24 steps on three small documents, its output to a file: Hydra's logging
    (console and job log)."""
    steps, tokens_per_step = 24, 2 * 32
    documents = [tmp_path / f"doc{i}.txt" for i in range(3)]
    for i, path in enumerate(documents):
        path.write_text(f"Document {i}: words and more words. " * 200)
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "tcal.cli.app", "experiment=smoke", "init=naive", "eval.num_windows=2",
             "data.source=files", f"data.files=[{','.join(map(str, documents))}]", "data.calibration_docs=1",
             "data.evaluation_docs=1", "calibration.check=false",
             "stage=distill", "stage.batch_size=2", "stage.seq_len=32", f"stage.max_tokens={steps * tokens_per_step}",
             f"stage.eval_every_tokens={steps // 2 * tokens_per_step}", "logger=none", "save_student=false",
             f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            stdout=log, stderr=subprocess.STDOUT, timeout=600)
    output = log_path.read_text()
    assert done.returncode == 0, output[-3000:]
    lightning_lines = re.findall(r"^\[[\d-]+ [\d:,]+\]\[lightning[\w.]*\]\[INFO\] - (.*)$", output, re.MULTILINE)
    assert f"`Trainer.fit` stopped: `max_steps={steps}` reached." in lightning_lines
    for message in lightning_lines:
        assert output.count(message) == lightning_lines.count(message), message  # no second copy of it
    assert TIP_MARK not in output and "litlogger" not in output and "litmodels" not in output
    assert "\r" not in output
    bar_lines = [line for line in output.splitlines() if line.startswith("Epoch 0")]
    assert bar_lines and len(bar_lines) < steps
