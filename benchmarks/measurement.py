"""How the benchmarks measure: one JSON line per figure, the fastest of a few runs, wall and CPU clocks, and peak
resident memory (Linux `/proc`), each peak taken in a fresh process of its own (`in_fresh_process`)."""

from __future__ import annotations

import json
import time

import torch
from lightning.pytorch.callbacks import Callback


def emit(figure: str, **values) -> dict:
    line = {"figure": figure, **{k: round(v, 5) if isinstance(v, float) else v for k, v in values.items()}}
    print(json.dumps(line), flush=True)
    return line


def best_time(fn, repeats: int = 3, warmup: bool = True) -> float:
    """Minimum wall time over `repeats` runs after one warm-up (the least noisy estimate on a shared CPU)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Clock:
    """Wall and process CPU seconds of a block. On a machine shared with other jobs the CPU time of a
    one-thread process is what an idle core would take; the wall time also counts the waits for a core."""

    def __enter__(self):
        self.wall_start, self.cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall_start, time.process_time() - self.cpu_start


def rss_kib(field: str) -> int:
    """`field` of /proc/self/status in KiB: `VmRSS` (resident now) or `VmHWM` (the high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the process's resident-memory high-water mark (Linux); returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS") * 1024


def peak_rss_gb() -> float:
    """The process's peak resident memory since it started, in GiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def fresh_process_child(fn, args, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    queue.put(fn(*args))


def in_fresh_process(fn, *args, env: dict | None = None):
    """`fn(*args)` in a fresh (spawned) process with this one's thread count and `env` added to its environment, so
    its peak resident memory is its own: one measurement's freed memory cannot hide the next one's peak. `fn` must
    be a module-level function and its result picklable; a child that dies is an error, not a hang."""
    import multiprocessing as mp
    import os
    import queue as queues
    from unittest import mock

    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    proc = spawn.Process(target=fresh_process_child, args=(fn, args, torch.get_num_threads(), results))
    with mock.patch.dict(os.environ, env or {}):
        proc.start()
    while True:
        try:
            value = results.get(timeout=5)
            break
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{fn.__name__} died in its process (exit code {proc.exitcode})") from None
    proc.join()
    return value


class StepTimer(Callback):
    """Wall time of each training step (batch start to batch end, optimizer included)."""

    def __init__(self):
        self.times, self.step_start = [], 0.0

    def on_train_batch_start(self, *args):
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.times.append(time.perf_counter() - self.step_start)


def fit_step_time(module, batches: torch.Tensor, batch_size: int) -> float:
    """Fastest step after the first, through Lightning's Trainer (clip 1.0, no logger or checkpoints)."""
    import lightning as L
    from torch.utils.data import DataLoader

    timer = StepTimer()
    steps = len(batches) // batch_size
    L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, gradient_clip_val=1.0, callbacks=[timer]).fit(
        module, DataLoader(batches, batch_size=batch_size))
    return min(timer.times[1:])
