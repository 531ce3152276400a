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


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_only_checks_compose_and_plan_on_a_cpu(tmp_path):
    """The slice and the 2-rank run are GPU work, but their settings compose and plan here: a typo in a key fails
    now, not in a GPU session's few minutes."""
    from tcal.settings.compose import settings_for
    from tcal.tools.plan import make_plan

    gpu_check = _gpu_check()
    slice_settings = gpu_check.slice_settings(str(tmp_path / "cache"), device="gpu")
    paper = settings_for(gpu_check.PAPER).stage.distill
    assert (slice_settings.stage.seq_len, slice_settings.stage.activation_checkpointing) == (
        paper.seq_len, paper.activation_checkpointing)
    assert slice_settings.teacher.config["hidden_size"] == 4096 and slice_settings.trainer.precision == "bf16-mixed"
    assert make_plan(slice_settings)["stages"]["distill"]["peak_gb"] > 0
    command = gpu_check.two_rank_command(str(tmp_path / "run"), str(tmp_path / "cache"))
    overrides = [arg for arg in command[3:] if not arg.startswith("hydra.")]
    two = settings_for(*overrides)
    assert two.stage.align.checkpoint_mixers and two.stage.distill.activation_checkpointing
    assert (two.trainer.strategy, two.trainer.devices) == ("fsdp", 2)
