"""The ranks of one job: started by the job's own process, one fresh set per job (`python -m tcal.cli.rank SPEC`).

A multi-device run that nothing else started ranks for (`tcal.runtime.distributed.starts_ranks`) runs like this: the
job's process (a `tcal` run, or one job of `tcal -m`) converts its settings and decides what its folder holds,
once; then `run_ranks` writes the settings to a scratch file and starts one process per device, each
given RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK and MASTER_ADDR/MASTER_PORT (a free port per job). Lightning's
default environment sees LOCAL_RANK and treats them as started from outside: it never relaunches the command,
so a sweep runs once, in one sweep folder, with one folder per job.

The job's process waits for its ranks. When one fails, the others get `STOP_GRACE_S` to stop on their own
(a shared decision makes every rank raise the same error at once, `tcal.runtime.distributed`); those still running
after that (waiting in a collective on the failed rank) are stopped. The ranks' failure becomes the job's:
the error a rank reported (a ConfigError, exit code 2; a Divergence; any other error as `RankFailed`), or
how the first rank to fail died. The next job starts fresh processes and a fresh process group.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tcal.runtime.signals import Interrupted, as_interrupt

log = logging.getLogger("tcal.cli.rank")  # also when run as __main__

# How long the other ranks get to stop on their own once one rank failed: a rank that raised a shared error is
# on its way out, but ending a torch process takes seconds on a loaded machine.
STOP_GRACE_S = 30.0
KILL_AFTER_S = 10.0  # how long a stopped rank (SIGTERM) gets before SIGKILL
POLL_S = 0.1
# How long a rank that took a signal, or whose job's process is gone, may take to stop on its own before it ends
# itself: a rank blocked in a collective on a peer that left runs no Python until the process group's timeout.
RANK_EXIT_GRACE_S = 15.0


class RankFailed(RuntimeError):
    """A rank of the job failed with an error other than a configuration error or a divergence, or died."""


def free_port() -> int:
    """A TCP port nothing listens on now, for one job's process group on this node."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def meeting_point(num_nodes: int) -> tuple[str, int]:
    """(address, port) of the job's process group: this node and a free port. Ranks on several nodes are
    started by SLURM: the job processes of separate nodes could not take one decision for all of them."""
    from tcal.errors import ConfigError

    if num_nodes != 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes} outside SLURM: ranks on several nodes are started by "
                          f"SLURM (hydra/launcher=slurm_gpu with nodes={num_nodes}); expected trainer.num_nodes=1 "
                          f"here")
    return "127.0.0.1", free_port()


def job_logging() -> dict | None:
    """The job's Hydra logging config (console and the job's log file), resolved, for its ranks to use too."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.job_logging is None:
        return None
    return {"config": OmegaConf.to_container(hydra.job_logging, resolve=True),
            "verbose": OmegaConf.to_container(hydra.verbose) if OmegaConf.is_config(hydra.verbose) else hydra.verbose}


def run_ranks(settings, run_dir: Path, resume: bool) -> None:
    """Run `settings` (a `RunSettings`) in `run_dir` on the trainer's ranks, started here and waited for; raises
    the ranks' failure (after marking the record failed: the rank that writes it may have been stopped before it
    could)."""
    from tcal.errors import ConfigError
    from tcal.runtime.distributed import world_size
    from tcal.store.record import describe, record_failure

    from tcal.preflight import check_cpu_ranks

    check_cpu_ranks(settings.trainer)  # bounded where they start, also for a caller that made no preflight
    world = world_size(settings.trainer)
    address, port = meeting_point(int(settings.trainer.num_nodes))
    tree = settings.tree()
    with tempfile.TemporaryDirectory(prefix="tcal-ranks-") as scratch:
        spec = Path(scratch) / "job.json"
        spec.write_text(json.dumps({"config": tree, "run_dir": str(run_dir),
                                    "resume": bool(resume), "logging": job_logging(), "reports": scratch,
                                    "parent": os.getpid()}), encoding="utf-8")
        log.info("starting ranks 0-%d of %d (process group at %s:%d)", world - 1, world, address, port)
        shared = {**os.environ, "MASTER_ADDR": address, "MASTER_PORT": str(port), "NODE_RANK": "0",
                  "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        processes: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(world):
                env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                processes[rank] = subprocess.Popen([sys.executable, "-m", "tcal.cli.rank", str(spec)], env=env,
                                                   stdin=subprocess.DEVNULL)
            failed = wait_for_ranks(processes, Path(scratch))
        except (Interrupted, KeyboardInterrupt) as err:  # the ranks get the job's signal, then the record says it
            interrupt = as_interrupt(err)
            stop(processes, [rank for rank, process in processes.items() if process.poll() is None],
                 interrupt.signum)
            mark_unless_complete(run_dir, interrupt, tree)  # whatever rank 0 could write before it stopped
            raise
        finally:
            stop(processes, [rank for rank, process in processes.items() if process.poll() is None])
        if not failed:
            return
        error = first_error({rank: processes[rank].returncode for rank in failed}, Path(scratch))
    if isinstance(error, Interrupted):  # a rank was signalled alone: the job stops as if it had been
        mark_unless_complete(run_dir, error, tree)
        log.error("run %s (record: %s)", error, Path(run_dir) / "results.json")
        raise error
    if not isinstance(error, ConfigError) and record_failure(run_dir, error, tree) is not None:
        log.error("run failed: %s (record: %s)", describe(error), Path(run_dir) / "results.json")
    raise error


def mark_unless_complete(run_dir: Path, interrupt: Interrupted, config: dict) -> None:
    """The record of an interrupted run says which signal stopped it (a record already complete stays so: the
    signal came after the work)."""
    from tcal.store.record import read_record, record_failure

    if (read_record(run_dir) or {}).get("status") != "complete":
        record_failure(run_dir, interrupt, config)


def wait_for_ranks(processes: dict[int, subprocess.Popen], reports: Path | None = None) -> list[int]:
    """Wait until every rank ended; the ranks seen failed first (one, or several ended between two looks; their
    peers stopped `STOP_GRACE_S` later if still running), or [] when all succeeded. A rank that stopped for a signal
    (one sent to it alone) passes that signal on to the others at once: every rank stops as it would have."""
    failed: list[int] = []
    deadline = None
    while True:
        codes = {rank: process.poll() for rank, process in processes.items()}
        if not failed:
            failed = [rank for rank, code in codes.items() if code not in (None, 0)]
            if failed:
                deadline = time.monotonic() + STOP_GRACE_S
                log.error("rank %s failed (exit code %s)", ", ".join(map(str, failed)),
                          ", ".join(str(codes[rank]) for rank in failed))
                signum = interrupting_signal(codes[failed[0]], reports, failed[0])
                if signum is not None:
                    for rank, code in codes.items():
                        if code is None:
                            processes[rank].send_signal(signum)
        running = [rank for rank, code in codes.items() if code is None]
        if not running:
            return failed
        if deadline is not None and time.monotonic() > deadline:
            log.warning("stopping ranks %s: still running %.0f s after rank %d failed", running, STOP_GRACE_S,
                        failed[0])
            stop(processes, running)
            return failed
        time.sleep(POLL_S)


def stop(processes: dict[int, subprocess.Popen], ranks: list[int], signum: int = signal.SIGTERM) -> None:
    """`signum` (SIGTERM) to `ranks`, then SIGKILL to those still running `KILL_AFTER_S` later; waits for all."""
    for rank in ranks:
        processes[rank].send_signal(signum)
    deadline = time.monotonic() + KILL_AFTER_S
    for rank in ranks:
        try:
            processes[rank].wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            processes[rank].kill()
            processes[rank].wait()


def interrupting_signal(code: int, reports: Path | None, rank: int) -> int | None:
    """The signal a rank that ended with `code` stopped for (its report, or an exit code of 128 + a handled signal),
    or None when it failed otherwise."""
    from tcal.runtime.signals import SIGNALS

    report_file = reports / f"rank_{rank}.json" if reports is not None else None
    if report_file is not None and report_file.is_file():
        reported = json.loads(report_file.read_text(encoding="utf-8"))
        return reported.get("signum")
    for signum in (code - 128, -code):  # stopped by our handler, or by a signal's default action before it was set
        if signum in SIGNALS:
            return signum
    return None


def first_error(codes: dict[int, int], reports: Path) -> Exception:
    """The error of the rank that failed first among `codes` ({rank: exit code}, seen failed together): one that
    died without a report (killed) before one that reported, reports by the time of the error."""
    reported = {rank: json.loads((reports / f"rank_{rank}.json").read_text(encoding="utf-8"))
                for rank in codes if (reports / f"rank_{rank}.json").is_file()}
    rank = min(codes, key=lambda rank: (rank in reported, reported.get(rank, {}).get("time", 0.0), rank))
    return rank_error(rank, codes[rank], reported.get(rank))


def rank_error(rank: int, code: int, reported: dict | None) -> Exception:
    """The error rank `rank` reported (its own type for tcal's errors; `Interrupted` for a signal), or how it died
    when it reported none."""
    from tcal import errors

    if reported is not None and reported.get("signum") is not None:
        return Interrupted(reported["signum"])
    signum = interrupting_signal(code, None, rank) if reported is None else None
    if signum is not None:
        return Interrupted(signum)
    if reported is not None:
        kind = getattr(errors, reported["type"], None)
        if isinstance(kind, type) and issubclass(kind, (errors.ConfigError, errors.Divergence)):
            return kind(reported["message"])
        return RankFailed(f"rank {rank}: {reported['type']}: {reported['message']}")
    if code < 0:
        return RankFailed(f"rank {rank} was killed by {signal.Signals(-code).name}")
    return RankFailed(f"rank {rank} exited with code {code} before reporting an error (see its output)")


# ---------------------------------------------------------------------------------------------------------------
# One rank


def exit_code(error: Exception) -> int:
    from tcal.errors import ConfigError

    return 2 if isinstance(error, ConfigError) else 1


def die_with_parent(parent: int) -> None:
    """SIGTERM to this rank when the job's process ends (Linux), so a killed job leaves no rank behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the job's process ended before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def report(folder: Path, rank: int, error: BaseException) -> None:
    from tcal.store.files import write_json_atomic

    signum = error.signum if isinstance(error, Interrupted) else None
    write_json_atomic(folder / f"rank_{rank}.json", {"rank": rank, "type": type(error).__name__, "signum": signum,
                                                     "message": str(error), "time": time.time()})


def exit_unless_stopped(reason: str, signum: int, grace: float, record) -> None:
    """In `grace` seconds, end this rank (exit code 128 + `signum`) if it has not ended: a rank blocked in a
    collective on a peer that left runs no Python, and would otherwise hold its folder's lock until the process
    group's timeout. `record()` marks the run's record first (rank 0)."""
    def expire() -> None:
        time.sleep(grace)
        log.error("rank stops: %s, and it did not stop on its own within %.0f s", reason, grace)
        try:
            record()
        finally:
            os._exit(128 + signum)

    threading.Thread(target=expire, name="tcal-rank-exit", daemon=True).start()


def watch_job(parent: int, record) -> None:
    """A thread that notices the job's process is gone (its ranks then get SIGTERM, `die_with_parent`) and ends this
    rank if that SIGTERM could not stop it."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S * 5)
        exit_unless_stopped("the job's process is gone", signal.SIGTERM, RANK_EXIT_GRACE_S, record)

    threading.Thread(target=watch, name="tcal-job-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """One rank of a job: join the job's process group, run the job's settings, report a failure to the job."""
    from hydra.core.utils import configure_log
    from omegaconf import OmegaConf

    from tcal.errors import ConfigError, Divergence
    from tcal.runtime.distributed import launch
    from tcal.runtime import signals
    from tcal.settings.conversion import run_settings
    from tcal.store.record import describe

    spec = json.loads(Path((argv if argv is not None else sys.argv[1:])[0]).read_text(encoding="utf-8"))
    die_with_parent(int(spec["parent"]))
    logging_spec = spec["logging"] or {"config": None, "verbose": False}  # None: Hydra's default, to stdout
    verbose = logging_spec["verbose"]
    configure_log(None if logging_spec["config"] is None else OmegaConf.create(logging_spec["config"]),
                  OmegaConf.create(verbose) if isinstance(verbose, list) else verbose)
    settings = run_settings(spec["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def mark_interrupted(signum: int = signal.SIGTERM) -> None:
        if rank == 0:
            mark_unless_complete(Path(spec["run_dir"]), Interrupted(signum), spec["config"])

    signals.on_signal.append(lambda signum: exit_unless_stopped(f"{signal.Signals(signum).name} received", signum,
                                                                RANK_EXIT_GRACE_S, lambda: mark_interrupted(signum)))
    watch_job(int(spec["parent"]), mark_interrupted)
    try:
        from tcal.pipeline import run

        run(settings, Path(spec["run_dir"]), resume=bool(spec["resume"]), ranks=launch(settings.trainer))
    except (Interrupted, KeyboardInterrupt) as err:  # the record says so (tcal.store.record); the job's process exits
        interrupt = as_interrupt(err)
        report(Path(spec["reports"]), rank, interrupt)
        log.warning("rank %d of %d stops: %s", rank, world, interrupt)
        sys.exit(interrupt.exit_code)
    except Exception as err:  # noqa: BLE001 - reported to the job's process, which decides what the job did
        report(Path(spec["reports"]), rank, err)
        if isinstance(err, (ConfigError, Divergence)):
            log.error("rank %d of %d stops: %s", rank, world, describe(err))
        else:
            log.exception("rank %d of %d stops: %s", rank, world, describe(err))
        sys.exit(exit_code(err))


if __name__ == "__main__":
    main()
