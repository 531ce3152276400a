"""bf16-mixed (autocast) against float32: the same Stage 1 and Stage 2 steps on every tiny teacher family give
the same losses within bfloat16's precision, and the fused KL keeps its memory to chunks of logits."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from conftest import FAMILIES, compose, make_teacher
from torch.utils.data import DataLoader

from tcal.student.convert import build_student
from tcal.training.kd import chunked_kd_loss
from tcal.training.stages import AlignStage, DistillStage

# bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); a loss is a sum over many rounded terms, and the
# KL compares two such models, so they differ by up to 0.7% on these steps (measured); float32 runs would agree to 1e-6.
LOSS_RTOL = 0.02
STEPS = 3


def stage_losses(family: str, kind: str, precision: str) -> list[float]:
    teacher = make_teacher(family, seed=3)
    student = build_student(teacher, [0, 2], seed=0)
    overrides = ["stage.lr=1e-3"] if kind == "align" else ["stage.lr_mixer=1e-3", "stage.lr_rest=1e-4"]
    cfg = compose(f"stage={kind}", *overrides).stage
    module = (AlignStage if kind == "align" else DistillStage)(student, teacher, cfg, STEPS)
    losses = []
    original_loss = module.loss

    def recording_loss(batch):
        loss, extra = original_loss(batch)
        losses.append(loss.item())
        return loss, extra

    module.loss = recording_loss
    batches = torch.randint(3, teacher.config.vocab_size, (STEPS * 2, 24), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0)
    trainer.fit(module, DataLoader(batches, batch_size=2))
    return losses


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["align", "distill"])
def test_bf16_mixed_steps_match_float32_losses(family, kind):
    full = stage_losses(family, kind, "32-true")
    mixed = stage_losses(family, kind, "bf16-mixed")
    assert len(full) == len(mixed) == STEPS
    assert all(torch.isfinite(torch.tensor(mixed)))
    assert mixed == pytest.approx(full, rel=LOSS_RTOL), (family, kind, full, mixed)
    assert mixed != full  # autocast really ran in bfloat16


def test_fused_kl_on_bfloat16_heads_matches_float32_and_keeps_their_dtype():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 96, 32, 517
    heads = [torch.nn.Linear(hidden_size, vocab, bias=False) for _ in range(2)]
    for head in heads:
        torch.nn.init.normal_(head.weight, std=0.3, generator=gen)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen)
    teacher_hidden = torch.randn(1, tokens, hidden_size, generator=gen)
    ids = torch.randint(vocab, (1, tokens), generator=gen)

    def loss_and_grads(dtype):
        student_head, teacher_head = (torch.nn.Linear(hidden_size, vocab, bias=False).to(dtype) for _ in range(2))
        student_head.weight.data.copy_(heads[0].weight)
        teacher_head.weight.data.copy_(heads[1].weight)
        h = hidden.detach().to(dtype).clone().requires_grad_(True)
        loss, _ = chunked_kd_loss(h, teacher_hidden.to(dtype), student_head, teacher_head, ids, chunk_size=32)
        loss.backward()
        return loss, h.grad, student_head.weight.grad

    full, half = loss_and_grads(torch.float32), loss_and_grads(torch.bfloat16)
    assert half[1].dtype == half[2].dtype == torch.bfloat16
    assert half[0].dtype == torch.float32  # the softmax and KL of each chunk are float32
    assert half[0].item() == pytest.approx(full[0].item(), rel=LOSS_RTOL)
    for a, b in zip(full[1:], half[1:]):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.float().flatten(), dim=0) > 0.99


def test_bfloat16_teacher_run_calibrates_and_trains_in_bf16_mixed(tmp_path):
    """The paper teachers' setting on a tiny one: teacher in bfloat16, `full` calibration on float32 copies of the
    layers, Stage 1 and Stage 2 in bf16-mixed on float32 student weights, exported in float32."""
    import json

    from conftest import isolated_cache_dir

    from tcal.pipeline import run

    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=full",
                  "teacher.dtype=bfloat16", "trainer.precision=bf16-mixed", "stage=align_distill",
                  "stage.align.batch_size=2", "stage.align.seq_len=32", "stage.align.max_tokens=128",
                  "stage.align.eval_every_tokens=128", "stage.distill.batch_size=2", "stage.distill.seq_len=32",
                  "stage.distill.max_tokens=128", "stage.distill.eval_every_tokens=128", "eval.num_windows=2")
    results = run(cfg, tmp_path / "run")
    assert results["status"] == "complete"
    for kind in ("align", "distill"):
        record = results["stages"][kind]
        assert all(math.isfinite(record[k]) for k in ("loss_first", "loss_last"))
    assert all(math.isfinite(m["student_ppl"]) for m in results["metrics"].values())
    assert all("phase2" in layer for layer in results["calibration"]["layers"].values())
    saved = json.loads((tmp_path / "run" / "student" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == "float32"


def test_teacher_in_dtype_casts_parameters_not_the_rope_buffers():
    from tcal.training.run import teacher_in_dtype

    teacher = make_teacher("qwen3")
    rope = dict(teacher.named_buffers())
    with teacher_in_dtype(teacher, "bfloat16"):
        assert next(teacher.parameters()).dtype == torch.bfloat16
        assert all(torch.equal(b, rope[n]) and b.dtype == rope[n].dtype for n, b in teacher.named_buffers())
    assert next(teacher.parameters()).dtype == torch.float32
    assert all(b.dtype == rope[n].dtype for n, b in teacher.named_buffers())
