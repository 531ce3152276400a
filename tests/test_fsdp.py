"""`trainer=fsdp` (FSDP2 units: each GDN mixer, each decoder layer, the student's root) against the unsharded path.

In one process (fast): a one-rank ShardedStrategy trains Stage 1 and Stage 2 to the single-device losses and
weights, with the token-0 validation and the fit sharing one wrap, norm clipping through the sharded root, the
GDN units called directly by Stage 1, float32 RoPE buffers under bf16-mixed, and the gathered student a plain
module equal to the single-device one. On 2 gloo processes (slow, through the command line): `stage=align_distill`
gives the `trainer=ddp` curve and exported student; a SIGKILL after a sharded (folder) checkpoint and
`tcal resume=RUN_DIR` give the uninterrupted curve and student.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from conftest import REPO, compose, isolated_cache_dir, make_teacher
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tcal.evaluate.validation import eval_dataloaders, is_sharded
from tcal.student.convert import build_student
from tcal.training.run import ShardedStrategy, stage1_key, stage_checkpoint, unsharded_student
from tcal.training.stages import AlignStage, DistillStage

STEPS = 3



def train(kind: str, sharded: bool, precision: str = "32-true", *overrides: str):
    """(losses per step, clipped norms, the module, the trained student as a plain module) after a token-0
    validation and STEPS steps of `kind` on the tiny Llama teacher, on one device or one FSDP rank."""
    teacher = make_teacher("llama", seed=3)
    student = build_student(teacher, [0, 2], seed=0)
    lrs = ["stage.lr=3e-2"] if kind == "align" else ["stage.lr_mixer=3e-2", "stage.lr_rest=3e-2"]
    cfg = compose(f"stage={kind}", *lrs, "stage.grad_clip=0.05", *overrides).stage
    module = (AlignStage if kind == "align" else DistillStage)(student, teacher, cfg, STEPS, eval_names=["x"])
    losses, norms = [], []
    original_loss = module.loss

    def recording_loss(batch):
        loss, extra = original_loss(batch)
        losses.append(loss.item())
        return loss, extra

    def recording_clip(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.full_tensor()
                                                                 if hasattr(g, "full_tensor") else g) for g in grads]))))
        type(module).configure_gradient_clipping(module, optimizer, gradient_clip_val, gradient_clip_algorithm)

    module.loss, module.configure_gradient_clipping = recording_loss, recording_clip
    gen = torch.Generator().manual_seed(1)
    batches = torch.randint(3, teacher.config.vocab_size, (STEPS * 2, 24), generator=gen)
    windows = torch.randint(3, teacher.config.vocab_size, (3, 24), generator=gen)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ShardedStrategy(1) if sharded else "auto",
                        precision=precision, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=cfg.grad_clip,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    evals = lambda: eval_dataloaders({"x": windows}, 2, 0, 1)  # noqa: E731
    trainer.validate(module, dataloaders=evals(), verbose=False)
    trainer.fit(module, DataLoader(batches, batch_size=2), val_dataloaders=evals())
    assert is_sharded(student) == sharded
    plain = unsharded_student(trainer, student, SimpleNamespace(device=torch.device("cpu")), kind)
    return losses, norms, module, plain


@pytest.mark.parametrize("kind,overrides", [("align", ()), ("distill", ()),
                                             ("distill", ("stage.activation_checkpointing=true",))])
def test_one_fsdp_rank_trains_like_one_device(kind, overrides, one_rank_group):
    losses, norms, module, student = train(kind, False, "32-true", *overrides)
    sharded_losses, sharded_norms, sharded_module, gathered = train(kind, True, "32-true", *overrides)
    assert len(losses) == STEPS and min(norms) > 0.05  # every step's update was clipped
    assert sharded_losses == pytest.approx(losses, rel=1e-6, abs=1e-9)
    assert sharded_norms == pytest.approx(norms, rel=1e-6)
    assert [p["ppl"] for p in sharded_module.curve["x"]] == pytest.approx([p["ppl"] for p in module.curve["x"]],
                                                                          rel=1e-6)
    assert len(sharded_module.curve["x"]) == 2  # token 0 (validate) and the fit's end: one wrap served both
    assert not is_sharded(gathered) and type(gathered) is type(student)
    ours, theirs = student.state_dict(), gathered.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert type(theirs[name]) is torch.Tensor, name  # plain tensors, not DTensor shards
        torch.testing.assert_close(theirs[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    if student.config.tie_word_embeddings:
        assert gathered.lm_head.weight is gathered.get_input_embeddings().weight
    assert not any(p.is_meta for p in gathered.parameters()) and not any(b.is_meta for b in gathered.buffers())


def test_fsdp_under_bf16_mixed_keeps_float32_rope_buffers(one_rank_group):
    losses, _, _, gathered = train("distill", True, "bf16-mixed")
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    frequencies = [b for name, b in gathered.named_buffers() if name.endswith("inv_freq")]
    assert frequencies and all(b.dtype == torch.float32 for b in frequencies)
    assert all(p.dtype == torch.float32 for p in gathered.parameters())  # float32 weights, autocast compute


def test_resume_finds_a_sharded_checkpoint_folder_or_the_one_a_killed_save_moved_aside(tmp_path):
    folder = tmp_path / "checkpoints" / "distill"
    assert stage_checkpoint(tmp_path, "distill") is None
    (folder / "last.ckpt.partial").mkdir(parents=True)  # a save killed while writing: never resumed from
    assert stage_checkpoint(tmp_path, "distill") is None
    (folder / "last.ckpt.old").mkdir()  # killed between moving the old one aside and the new one in
    assert stage_checkpoint(tmp_path, "distill") == folder / "last.ckpt.old"
    (folder / "last.ckpt").mkdir()
    assert stage_checkpoint(tmp_path, "distill") == folder / "last.ckpt"


def test_stage1_cache_key_tells_precisions_apart():
    """A bf16-mixed Stage 1 is not a float32 one: the cache must not hand one to the other."""
    from conftest import repo_cache_dir

    from tcal.data.documents import load_splits
    from tcal.teachers.load import load_tokenizer

    teacher = make_teacher("llama", seed=3)
    student = build_student(teacher, [0, 2], seed=0)
    plan = SimpleNamespace(settings=compose("stage=align").stage, data=SimpleNamespace(windows_key="the same windows",
                                                                                retrieval_mix=0.0))
    tokenizer = load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())
    splits = load_splits(compose().data)

    def key(precision):
        settings = compose("stage=align", f"trainer.precision={precision}")
        return stage1_key(SimpleNamespace(teacher=teacher, settings=settings, tokenizer=tokenizer, splits=splits),
                          student, plan)

    assert len({key("32-true"), key("bf16-mixed"), key("bf16-true")}) == 3
    assert key("32-true") == key("32-true")


# ------------------------------------------------------------------------------------- 2 processes, command line

TWO_STAGES = ("experiment=smoke", "eval.num_windows=3", "stage=align_distill", "init=zero_gate",
              "stage.align.seq_len=32", "stage.align.max_tokens=256", "stage.align.eval_every_tokens=128",
              "stage.align.batch_size=2", "stage.align.lr=1e-2", "stage.distill.seq_len=32",
              "stage.distill.max_tokens=768", "stage.distill.eval_every_tokens=128", "stage.distill.batch_size=2",
              "stage.distill.lr_mixer=1e-3", "stage.distill.lr_rest=1e-3", "trainer.accelerator=cpu",
              "trainer.devices=2", "trainer.precision=32-true")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CWD = REPO


def command(tmp_path: Path, name: str, trainer: str) -> list[str]:
    return [sys.executable, "-m", "tcal.cli.app", *TWO_STAGES, f"trainer={trainer}",
            f"paths.cache_dir={isolated_cache_dir(tmp_path / f'cache_{name}')}", f"hydra.run.dir={tmp_path / name}"]


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def finished(tmp_path: Path, name: str, trainer: str) -> dict:
    done = subprocess.run(command(tmp_path, name, trainer), cwd=CWD, env=ENV, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return results(tmp_path / name)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return finished(tmp, "ddp", "ddp"), tmp / "ddp"


def assert_same_run(ours: dict, ours_dir: Path, reference: dict, reference_dir: Path) -> None:
    for kind in ("align", "distill"):
        curve, expected = ours["stages"][kind]["curve"], reference["stages"][kind]["curve"]
        assert curve.keys() == expected.keys()
        for name, points in expected.items():
            assert [p["tokens"] for p in curve[name]] == [p["tokens"] for p in points]
            assert [p["ppl"] for p in curve[name]] == pytest.approx([p["ppl"] for p in points], rel=1e-5)
    first, last = (reference["stages"]["distill"]["curve"]["shakespeare"][i]["ppl"] for i in (0, -1))
    assert abs(last - first) / first > 1e-3  # the curve moved: a real comparison
    assert ours["metrics"]["shakespeare"]["student_ppl"] == pytest.approx(
        reference["metrics"]["shakespeare"]["student_ppl"], rel=1e-5)
    exported, expected = (load_file(d / "student" / "model.safetensors") for d in (ours_dir, reference_dir))
    assert exported.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(exported[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    digests = ours["stages"]["distill"]["rank_weight_digests"]
    assert len(digests) == 2 and len(set(digests)) == 1  # both ranks gathered the same full weights


@pytest.mark.slow
def test_fsdp_two_stages_give_the_ddp_curve_and_an_exported_student_that_loads(ddp_run, tmp_path):
    from transformers import AutoModelForCausalLM

    reference, reference_dir = ddp_run
    ours = finished(tmp_path, "fsdp", "fsdp")
    assert_same_run(ours, tmp_path / "fsdp", reference, reference_dir)
    assert (tmp_path / "fsdp" / "checkpoints" / "distill" / "last.ckpt").is_dir()  # a sharded (folder) checkpoint
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "student")
    exported = load_file(tmp_path / "fsdp" / "student" / "model.safetensors")
    state = loaded.state_dict()
    assert all(torch.equal(state[key], tensor) for key, tensor in exported.items())


@pytest.mark.slow
def test_fsdp_sigkill_and_resume_give_the_uninterrupted_curve(ddp_run, tmp_path):
    reference, reference_dir = ddp_run
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(command(tmp_path, "killed", "fsdp"), cwd=CWD, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint = run_dir / "checkpoints" / "distill" / "last.ckpt"
    deadline = time.time() + 600
    while not (checkpoint / "meta.pt").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its rank processes
    proc.wait()
    assert checkpoint.is_dir() and results(run_dir)["status"] != "complete"
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", f"resume={run_dir}",
                           f"hydra.run.dir={tmp_path / 'resume_log'}"], cwd=CWD, env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = results(run_dir)
    assert resumed["status"] == "complete" and resumed["stages"]["distill"]["resumed"]
    assert_same_run(resumed, run_dir, reference, reference_dir)
