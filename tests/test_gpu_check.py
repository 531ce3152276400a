"""`make gpu-check` on a machine without CUDA: one line that says so, exit code 0 (its GPU figures come from a
GPU machine)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path; on a GPU machine run `make gpu-check`")
def test_gpu_check_without_cuda_says_so_and_exits_0():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in json.loads(lines[0])["skipped"]
