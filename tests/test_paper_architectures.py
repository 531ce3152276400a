"""(slow) Each paper teacher's shipped architecture at its real width and vocabulary, with a few layers and random
weights: the all-kept student is the teacher, half the layers convert, every init mode runs (a few Phase 2 steps, in
float32), and two Stage 2 steps run under Lightning's bf16-mixed precision on the CPU (weights in bfloat16) where the
machine has the memory `tcal-plan` says they need."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose, isolated_cache_dir
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from tcal.cli.app import group_options
from tcal.context import RunContext
from tcal.data.documents import load_splits
from tcal.init import apply_init
from tcal.retention.uniform import uniform_layers
from tcal.student.convert import build_student, naive_gdn
from tcal.teachers.load import load_tokenizer, teacher_architecture
from tcal.tools.plan import make_plan
from tcal.training.stages import DistillStage

pytestmark = pytest.mark.slow

# Decoder layers per teacher: four, or two for Qwen3-8B, whose embeddings alone are 1.2B parameters.
LAYERS = {"qwen2_5_1_5b": 4, "qwen2_5_3b": 4, "llama3_2_3b": 4, "qwen3_8b": 2}
SMALL_CALIBRATION = ["experiment=smoke", "calibration.phase2.steps=3", "calibration.check=false",
                     "calibration.cache=false", "init.pool.tokens=512",
                     "init.pool.held_out_every=4", "init.phase2.steps=3", "init.phase2.batch_size=2",
                     "init.phase2.select_every=2"]
# Lightning's MixedPrecision refuses gradient clipping with a fused optimizer ("does not allow for gradient clipping
# because it performs unscaling of gradients internally"), so under bf16-mixed Stage 2 runs the unfused AdamW.
STAGE2 = ["stage=distill", "stage.batch_size=1", "stage.seq_len=64", "stage.max_tokens=128",
          "stage.eval_every_tokens=64", "stage.kl_chunk_size=64", "stage.fused_optimizer=false"]


def overrides(teacher: str, *extra: str) -> list[str]:
    return [f"teacher={teacher}", f"teacher.architecture.num_hidden_layers={LAYERS[teacher]}", *extra]


def random_teacher(cfg) -> torch.nn.Module:
    """The shipped architecture (layers cut) with seeded random weights, bfloat16, eval mode."""
    config = teacher_architecture(cfg.teacher, cfg.paths.cache_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def cast_weights(model, dtype: torch.dtype) -> None:
    """The parameters only: `.to(dtype)` would also round the RoPE frequencies transformers keeps in float32."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def init_overrides(mode: str) -> list[str]:
    """Overrides for `init=mode`: the `init.*` keys above only where that mode has them."""
    keys = compose(f"init={mode}").init
    return [f"init={mode}", *(o for o in SMALL_CALIBRATION if not o.startswith("init.")
                             or o.split("=")[0].split(".")[1] in keys)]


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


@pytest.fixture(scope="module")
def tokenizer_and_splits(tmp_path_factory):
    cache = isolated_cache_dir(tmp_path_factory.mktemp("paper_cache"))
    cfg = compose("experiment=smoke", f"paths.cache_dir={cache}")
    return load_tokenizer(cfg.teacher, cache), load_splits(cfg.data), cache


@pytest.mark.parametrize("teacher_name", LAYERS)
def test_paper_architecture_converts_calibrates_and_distills(teacher_name, tokenizer_and_splits, tmp_path):
    """One model in memory at a time where it can be (Qwen3-8B's two layers are 6.5 GB in float32): the teacher in
    bfloat16 against its all-kept student, in float32 for the inits (they fit in float32), in bfloat16 for Stage 2."""
    tokenizer, splits, cache = tokenizer_and_splits
    cfg = compose(*overrides(teacher_name, f"paths.cache_dir={cache}"))
    teacher = random_teacher(cfg)
    config = teacher.config
    ids = torch.randint(0, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))

    all_kept = build_student(teacher, list(range(config.num_hidden_layers)))
    with torch.no_grad():
        assert torch.equal(all_kept(input_ids=ids, use_cache=False).logits, teacher(input_ids=ids).logits)
    del all_kept

    cast_weights(teacher, torch.float32)
    gdn_layers = [i for i in range(config.num_hidden_layers) if i not in uniform_layers(config.num_hidden_layers, 0.5)]
    assert len(gdn_layers) == config.num_hidden_layers // 2
    calibrated = {}
    for mode in group_options("init"):
        mode_cfg = compose(*overrides(teacher_name, f"paths.cache_dir={cache}", *init_overrides(mode)))
        ctx = RunContext(mode_cfg, teacher, tokenizer, splits, Path(cache), tmp_path / mode)
        gdns = {i: naive_gdn(teacher, i) for i in gdn_layers}
        record = apply_init(gdns, mode_cfg.init, ctx)
        assert all(torch.isfinite(p).all() for g in gdns.values() for p in g.parameters()), mode
        for layer in record.get("layers", {}).values():
            phase2 = layer.get("phase2", {})
            before, after = (phase2.get(k, phase2.get(f"held_out_{k}")) for k in ("loss_before", "loss_after"))
            assert before is None or after <= before, (mode, phase2)
        calibrated = {f"model.layers.{i}.self_attn.{k}": v for i, g in gdns.items() for k, v in g.state_dict().items()}

    cast_weights(teacher, torch.bfloat16)
    student = build_student(teacher, uniform_layers(config.num_hidden_layers, 0.5))
    student.load_state_dict(calibrated, strict=False)  # the last init mode's layers
    del calibrated
    plan = make_plan(compose(*overrides(teacher_name, *STAGE2, "trainer.precision=bf16-true",
                                              "stage.teacher_dtype=bfloat16")))["stages"]["distill"]
    more = plan["peak_gb"] - plan["weights_gb"] - plan["teacher_gb"]  # beyond the two models, now in memory
    if more > 0.9 * available_gb():
        pytest.skip(f"Stage 2 of {teacher_name} at {LAYERS[teacher_name]} layers needs {plan['peak_gb']} GB by "
                    f"tcal-plan, {more:.1f} GB beyond its two models (bfloat16 gradients and AdamW moments, the KL's "
                    f"float32 heads); {available_gb():.1f} GB available")
    before = {k: v.clone() for k, v in student.state_dict().items() if ".self_attn." in k}
    stage = DistillStage(student, teacher, compose(*overrides(teacher_name, *STAGE2)).stage, 2)
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0)
    batches = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    trainer.fit(stage, DataLoader(batches, batch_size=1))
    assert stage.tokens_seen == 2 * 64 and torch.isfinite(torch.tensor([stage.loss_first, stage.loss_last])).all()
    after = student.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
