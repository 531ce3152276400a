"""`make gpu-check` on a machine without CUDA: one line that says so, exit code 0 (its GPU figures come from a
GPU machine); its budget, deadlines and output file with stand-in checks; its GPU checks' settings compose here."""

import json
import os
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


def test_the_budget_runs_checks_in_order_stops_one_past_its_deadline_and_skips_what_does_not_fit(tmp_path,
                                                                                                 monkeypatch):
    """The budget machinery on a CPU, with stand-in checks on a faked CUDA machine: a quick check runs, one that
    overruns its deadline is stopped and said so (the next still runs), one whose planned cost exceeds the budget
    left is skipped and said so; every line is in the JSON-lines file as well as on stdout, and the exit code is 1
    (a check failed)."""
    import time

    gpu_check = _gpu_check()
    ran = []

    def quick():
        ran.append("quick")
        gpu_check.emit("quick_figure", True, value=1.0)

    def overrun():
        ran.append("overrun")
        time.sleep(30)

    def after():
        ran.append("after")

    monkeypatch.setattr(gpu_check, "CHECKS", (("quick", quick, 1), ("overrun", overrun, 1), ("after", after, 1),
                                               ("huge", lambda: ran.append("huge"), 10_000)))
    monkeypatch.setattr(gpu_check, "DEADLINE_FACTOR", 0.5)
    monkeypatch.setattr(gpu_check, "check_stack", lambda choice: choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "lines.jsonl"
    start = time.perf_counter()
    code = gpu_check.main(["--budget", "60", "--out", str(out), "--triton-cache", str(tmp_path / "triton")])
    assert time.perf_counter() - start < 20 and code == 1 and ran == ["quick", "overrun", "after"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by_check = {}
    for line in lines:
        by_check.setdefault(line["check"], []).append(line)
    assert by_check["quick_figure"][0]["ok"] is True
    assert by_check["overrun"][0]["ok"] is False
    assert by_check["overrun"][0]["error"] == "PastDeadline: past its deadline of 0 s"  # 0.5 x 1 s, printed rounded
    assert "after" in by_check and "ok" not in by_check["after"][0]
    assert by_check["huge"] == [{"check": "huge", "skipped": by_check["huge"][0]["skipped"]}]
    assert by_check["huge"][0]["skipped"].startswith("needs about 10000 s (planned)")
    assert by_check["gpu"][-1]["failed"] == ["overrun"]
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "triton").resolve())


def test_the_zero_shot_and_stage2_checks_compose_and_plan_on_a_cpu():
    """The zero-shot check's settings compose under each kernel choice, its CPU figure is set, and Stage 2's MFU has
    its FLOPs per token from tcal-plan."""
    gpu_check = _gpu_check()
    for choice in ("auto", "fla", "torch"):
        gpu_check.GDN_KERNEL["choice"] = choice
        settings = gpu_check.compose_cfg(*gpu_check.ZERO_SHOT, "trainer=gpu")
        assert settings.trainer.gdn_kernel == choice and settings.calibration.phase2.steps == 30
    gpu_check.GDN_KERNEL["choice"] = "auto"
    assert gpu_check.CPU_ZERO_SHOT_PPL > 1
    assert gpu_check.stage2_flops_per_token() > 6 * 100e6  # at least 6 x the trained parameters of SmolLM2's student


@pytest.mark.parametrize("where", ["a_folder", "a_file/lines.jsonl", "/proc/tcal-gpu-check/lines.jsonl"])
def test_an_out_that_cannot_be_written_is_one_line_before_the_first_check(where, tmp_path, monkeypatch, capsys):
    """`--out` to a folder, under a file, or where no user can write: one line naming it, exit code 2, on a (faked)
    CUDA machine before the stack line or any check runs; nothing is written there."""
    gpu_check = _gpu_check()
    ran = []
    monkeypatch.setattr(gpu_check, "CHECKS", (("quick", lambda: ran.append("quick"), 1),))
    monkeypatch.setattr(gpu_check, "check_stack", lambda choice: ran.append("stack") or choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("not a folder\n")
    out = tmp_path / where
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(out), "--triton-cache", str(tmp_path / "triton")])
    err = capsys.readouterr()
    assert exited.value.code == 2 and ran == [] and err.out == ""
    assert ": error: --out " in err.err.strip().splitlines()[-1] and "Traceback" not in err.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_folder"]
    assert list((tmp_path / "a_folder").iterdir()) == []


@pytest.mark.parametrize("where", ["a_file/triton", "/proc/tcal-gpu-check/triton"])
def test_a_triton_cache_that_cannot_be_written_is_one_line_before_the_first_check(where, tmp_path, monkeypatch,
                                                                                   capsys):
    gpu_check = _gpu_check()
    ran = []
    monkeypatch.setattr(gpu_check, "CHECKS", (("quick", lambda: ran.append("quick"), 1),))
    monkeypatch.setattr(gpu_check, "check_stack", lambda choice: ran.append("stack") or choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "a_file").write_text("not a folder\n")
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path / "lines.jsonl"), "--triton-cache", str(tmp_path / where)])
    err = capsys.readouterr()
    assert exited.value.code == 2 and ran == [] and err.out == ""
    assert ": error: --triton-cache " in err.err.strip().splitlines()[-1] and "Traceback" not in err.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
