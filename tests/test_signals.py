"""A signal never reports success: SIGTERM, SIGINT or SIGUSR1 anywhere in a run (calibration, Stage 1, Stage 2, the
final evaluation) leaves the record `failed` with `interrupted by <signal>`, `tcal` exits with 128 + the signal's
number, a sweep lists the job it stopped and the jobs that did not run, the library raises (KeyboardInterrupt
for SIGINT, never SystemExit), and the same command afterwards continues to the uninterrupted result.

The command-line tests send a real signal to a real `tcal` process the moment it logs that a phase started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, isolated_cache_dir, repo_cache_dir
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from tcal import api
from tcal.pipeline import run
from tcal.runtime.signals import Interrupted, KeyboardInterrupted, handling
from tcal.settings import DataSettings, DistillSettings, EvalSettings, init_settings, tiny_teacher

TINY = ("experiment=smoke", "init=naive", "eval.num_windows=2", "logger=none")
DISTILL = ("stage=distill", "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=256",
           "stage.eval_every_tokens=128")
COMPARED = ("curve", "metrics", "keep_layers", "init_weights_digest", "calibration")
SMALL_EVAL = EvalSettings(seq_len=64, num_windows=2)  # the curve's windows in a library run (default: 16 of 512)
STAGE_COMPARED = ("steps", "tokens_seen", "curve", "loss_first", "loss_last", "rank_weight_digests")


class SignalAt(Callback):
    """Send `signum` to this process after `step` optimizer steps of the stage."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def read(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())


def uncached(value):
    """`value` with its `cached` flags off and without the rank that built an entry: a resumed run reuses what the
    interrupted one cached, which no rank of the resumed run built."""
    if isinstance(value, dict):
        built = "cached" in value
        return {k: False if k == "cached" else uncached(v) for k, v in value.items() if not (built and k == "rank")}
    if isinstance(value, list):
        return [uncached(v) for v in value]
    return value


def assert_same_result(resumed: dict, straight: dict) -> None:
    assert resumed["status"] == "complete" and "error" not in resumed
    for key in COMPARED:
        assert uncached(resumed.get(key)) == uncached(straight.get(key)), key
    for kind, record in straight.get("stages", {}).items():
        for key in STAGE_COMPARED:
            assert resumed["stages"][kind][key] == record[key], (kind, key)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "student" / "model.safetensors"), load_file(b / "student" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def distill_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    cache = isolated_cache_dir(root / "cache")
    run(compose(*TINY, *DISTILL, f"paths.cache_dir={cache}"), root / "straight")
    return cache, root / "straight"


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                    pytest.param(signal.SIGUSR1, marks=pytest.mark.slow)], ids=lambda s: s.name)
def test_a_signal_mid_stage_is_recorded_and_the_run_resumes_exactly(signum, distill_cache, tmp_path):
    cache, straight = distill_cache
    cfg = compose(*TINY, *DISTILL, f"paths.cache_dir={cache}")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with pytest.raises(Interrupted) as raised:
        run(cfg, tmp_path / "run", callbacks=[SignalAt(signum, 3)])
    assert raised.value.signum == signum
    assert isinstance(raised.value, KeyboardInterrupt) == (signum == signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers it found are back
    record = read(tmp_path / "run")
    assert (record["status"], record["failed_after"]) == ("failed", "initialized")
    assert record["error"] == f"interrupted by {signum.name} (signal {int(signum)})"
    from tcal.cli.app import run_in
    run_in(cfg, tmp_path / "run")  # what the same command does: continue the unfinished run
    assert_same_result(read(tmp_path / "run"), read(straight))
    assert_same_weights(tmp_path / "run", straight)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random teacher through the library, its data and a student keeping layers 0 and 2."""
    teacher = api.load_teacher(tiny_teacher(), repo_cache_dir())
    return teacher, api.load_data(DataSettings())


def test_ctrl_c_in_api_distill_raises_keyboard_interrupt_not_system_exit(tiny, monkeypatch, tmp_path):
    """Lightning turns a KeyboardInterrupt inside `fit` into sys.exit(1); the library's SIGINT passes through it."""
    import tcal.training.run as training

    teacher, splits = tiny
    make = training.make_trainer
    monkeypatch.setattr(training, "make_trainer", lambda s, plan, d, logger, callbacks: make(
        s, plan, d, logger, [*callbacks, SignalAt(signal.SIGINT, 1)]))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as raised:
        api.distill(api.build_student(teacher, [0, 2]), teacher, splits,
                    DistillSettings(batch_size=2, seq_len=32, eval_every_tokens=64), tokens=256, eval=SMALL_EVAL,
                    run_dir=tmp_path, cache_dir=isolated_cache_dir(tmp_path / "cache"))
    assert isinstance(raised.value, KeyboardInterrupted) and raised.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_in_api_initialize_raises_interrupted_naming_it(signum, tiny, monkeypatch, tmp_path):
    """Calibration through the library: the signal stops it with Interrupted (a BaseException: `except
    Exception` in user code does not swallow it)."""
    import tcal.init.calibration.calibrate as calibrate

    teacher, splits = tiny
    original = calibrate.start_record

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(calibrate, "start_record", signalled)
    caught = None
    with pytest.raises(Interrupted, match=f"interrupted by {signum.name}"):
        try:
            api.initialize(api.build_student(teacher, [0, 2]), teacher, splits, init_settings("phase2"),
                           cache_dir=tmp_path)
        except Exception as err:  # noqa: BLE001 - what user code may write; the interrupt is not an Exception
            caught = err
    assert caught is None


def test_nested_blocks_share_one_handler_and_restore_the_first():
    before = signal.getsignal(signal.SIGTERM)
    with handling():
        inner = signal.getsignal(signal.SIGTERM)
        with handling():
            assert signal.getsignal(signal.SIGTERM) is inner
        assert signal.getsignal(signal.SIGTERM) is inner
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10 ** 7):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------------------------------------------------------
# Real signals to real `tcal` processes, in every phase


PHASES = {  # phase -> (the line that says it started, the status the record reached before it)
    "calibration": ("calibrating layers", "converted"),
    "stage1": ("align at 0 tokens", "initialized"),
    "stage2": ("distill at 0 tokens", "trained_align"),
    "final_evaluation": ("final evaluation: ", "trained_distill"),
}
EVERY_PHASE = ["experiment=smoke", "init=phase2", "calibration.phase2.steps=150", "eval.num_windows=8",
               "logger=none", "stage=align_distill", "stage.align.cache=false",
               *(f"stage.{kind}.{key}={value}" for kind in ("align", "distill") for key, value in
                 (("batch_size", 2), ("seq_len", 32), ("max_tokens", 512), ("eval_every_tokens", 256)))]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def tcal(*args: str, signal_on: str | None = None, signum: int = signal.SIGTERM) -> tuple[int, str, bool]:
    """Run `tcal ARGS`; with `signal_on`, send `signum` the moment a line containing it appears. (exit code,
    output, whether the signal was sent)."""
    proc = subprocess.Popen([sys.executable, "-m", "tcal.cli.app", *args], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines, sent = [], False
    for line in proc.stdout:
        lines.append(line)
        if signal_on and not sent and signal_on in line:
            proc.send_signal(signum)
            sent = True
    return proc.wait(timeout=900), "".join(lines), sent


@pytest.fixture(scope="module")
def every_phase_straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("every_phase")
    code, out, _ = tcal(*EVERY_PHASE, f"paths.cache_dir={isolated_cache_dir(root / 'cache')}",
                        f"hydra.run.dir={root / 'straight'}")
    assert code == 0, out[-3000:]
    assert all(marker in out for marker, _ in PHASES.values())
    return root / "straight"


def tcal_lines(out: str) -> list[str]:
    return [line.strip() for line in out.replace("\r", "\n").splitlines() if line.strip().startswith("tcal: ")]


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_to_tcal_in_any_phase_exits_128_plus_its_number_and_resumes(signum, phase, every_phase_straight,
                                                                            tmp_path):
    marker, reached = PHASES[phase]
    args = (*EVERY_PHASE, f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}",
            f"hydra.run.dir={tmp_path / 'run'}")
    code, out, sent = tcal(*args, signal_on=marker, signum=signum)
    assert sent and code == 128 + signum, out[-3000:]
    assert "Traceback" not in out
    record = read(tmp_path / "run")
    assert (record["status"], record["failed_after"]) == ("failed", reached), record.get("error")
    assert record["error"] == f"interrupted by {signum.name} (signal {int(signum)})"
    assert tcal_lines(out)[-1] == (f"tcal: interrupted by {signum.name} (signal {int(signum)}) (record: "
                                   f"{tmp_path / 'run' / 'results.json'}; the same command continues it)")
    code, out, _ = tcal(*args)
    assert code == 0, out[-3000:]
    assert_same_result(read(tmp_path / "run"), read(every_phase_straight))
    assert_same_weights(tmp_path / "run", every_phase_straight)


SWEEP_SEEDS = "seed=0,1"


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_to_a_sweep_lists_what_did_not_run_and_the_rerun_completes_it(signum, phase, every_phase_straight,
                                                                              tmp_path):
    marker, reached = PHASES[phase]
    sweep_dir = tmp_path / "sweep"
    args = ("-m", *EVERY_PHASE, SWEEP_SEEDS, f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}",
            f"hydra.sweep.dir={sweep_dir}")
    code, out, sent = tcal(*args, signal_on=marker, signum=signum)
    assert sent and code == 128 + signum, out[-3000:]
    assert "Traceback" not in out
    name = f"{signum.name} (signal {int(signum)})"
    assert tcal_lines(out)[-3:] == [
        f"tcal: sweep interrupted by {name} in job 0 of 2; the same command skips finished jobs and continues",
        f"tcal: sweep job 0 did not finish ({sweep_dir / '0'}): interrupted by {name}",
        f"tcal: sweep job 1 did not run ({sweep_dir / '1'}): seed=1"]
    record = read(sweep_dir / "0")
    assert (record["status"], record["failed_after"], record["error"]) == ("failed", reached, f"interrupted by {name}")
    assert not (sweep_dir / "1").exists()
    listed = [json.loads(line) for line in (sweep_dir / "failed_jobs.jsonl").read_text().splitlines()]
    assert [(job["job"], job["error"]) for job in listed] == [
        (0, f"interrupted by {name}"), (1, f"not run: the sweep was interrupted by {name}")]
    code, out, _ = tcal(*args)
    assert code == 0, out[-3000:]
    assert_same_result(read(sweep_dir / "0"), read(every_phase_straight))
    assert_same_weights(sweep_dir / "0", every_phase_straight)
    assert read(sweep_dir / "1")["status"] == "complete"


@pytest.mark.slow
def test_an_interrupted_sweep_lists_its_failed_jobs_too(tmp_path):
    """A job that failed before the signal is listed with its error, then the interrupted job, then those not run.
    Job 0's budget is less than one step: a check of the job's own (a bad value any job's settings show would stop
    the whole sweep before it starts)."""
    sweep_dir = tmp_path / "sweep"
    code, out, sent = tcal("-m", *TINY, *DISTILL, "stage.batch_size=16,2,4",
                           f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", f"hydra.sweep.dir={sweep_dir}",
                           signal_on="distill at 0 tokens", signum=signal.SIGTERM)
    assert sent and code == 128 + signal.SIGTERM, out[-3000:]
    assert tcal_lines(out)[-4:] == [
        "tcal: sweep interrupted by SIGTERM (signal 15) in job 1 of 3; the same command skips finished jobs and "
        "continues",
        f"tcal: sweep job 0 failed ({sweep_dir / '0'}): configuration error: stage.max_tokens=256 is less than one "
        f"step of 512 tokens (stage.batch_size x stage.seq_len x 1 devices)",
        f"tcal: sweep job 1 did not finish ({sweep_dir / '1'}): interrupted by SIGTERM (signal 15)",
        f"tcal: sweep job 2 did not run ({sweep_dir / '2'}): stage.batch_size=4"]


TWO_RANKS = ("trainer=ddp", "trainer.accelerator=cpu")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_a_two_rank_job_reaches_its_ranks_and_the_rerun_resumes_exactly(signum, tmp_path):
    """The job's process passes its signal to the ranks it started: the record says which signal, the job exits
    128 + its number, no rank is left running, and the same command continues to the uninterrupted 2-rank result."""
    straight = tmp_path / "straight"
    code, out, _ = tcal(*EVERY_PHASE, *TWO_RANKS, f"paths.cache_dir={isolated_cache_dir(tmp_path / 'c0')}",
                        f"hydra.run.dir={straight}")
    assert code == 0, out[-3000:]
    args = (*EVERY_PHASE, *TWO_RANKS, f"paths.cache_dir={isolated_cache_dir(tmp_path / 'c1')}",
            f"hydra.run.dir={tmp_path / 'run'}")
    code, out, sent = tcal(*args, signal_on=PHASES["stage2"][0], signum=signum)
    assert sent and code == 128 + signum, out[-3000:]
    ranks = [pid for pid in os.listdir("/proc") if pid.isdigit() and b"tcal.cli.rank" in
             Path(f"/proc/{pid}/cmdline").read_bytes()] if Path("/proc/self/cmdline").exists() else []
    assert not ranks  # the tests run one at a time: any rank process still alive is this job's
    record = read(tmp_path / "run")
    assert record["status"] == "failed"
    assert record["error"] == f"interrupted by {signum.name} (signal {int(signum)})"
    code, out, _ = tcal(*args)
    assert code == 0, out[-3000:]
    assert_same_result(read(tmp_path / "run"), read(straight))
    assert_same_weights(tmp_path / "run", straight)


def test_while_a_trainer_runs_every_signal_is_tcal_s_alone(tiny, tmp_path):
    """No Lightning handler is installed under a Trainer tcal builds: Lightning's SIGTERM handler broadcasts from
    inside the handler and hangs ranks signalled together (tests/test_rank_signals.py)."""
    from lightning.pytorch.callbacks import Callback

    from tcal.runtime import signals

    seen = {}

    class Handlers(Callback):
        def on_train_batch_start(self, *args):
            seen.update({signum: signal.getsignal(signum) for signum in signals.SIGNALS})

    teacher, splits = tiny
    api.distill(api.build_student(teacher, [0, 2]), teacher, splits,
                DistillSettings(batch_size=2, seq_len=32, eval_every_tokens=64), tokens=128, eval=SMALL_EVAL,
                run_dir=tmp_path, cache_dir=isolated_cache_dir(tmp_path / "cache"), callbacks=[Handlers()])
    assert seen and all(handler is signals._handler for handler in seen.values()), seen
