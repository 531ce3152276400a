"""bf16-mixed (autocast) against float32: the same Stage 1 and Stage 2 steps on every tiny teacher family give
the same losses within bfloat16's precision, and the fused KL keeps its memory to chunks of logits. The dtypes
are traced: the fused KL's head GEMMs in bfloat16 with a float32 head gradient under autocast, FSDP2's gathered
parameters in bfloat16 and its reduced gradients in float32 under bf16-mixed (float32 runs untouched), and no
mixer recomputed twice when both checkpointings are on."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from conftest import FAMILIES, compose, make_teacher
from torch.utils._python_dispatch import TorchDispatchMode
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


class MatmulDtypes(TorchDispatchMode):
    """The operand dtypes of every matrix product (mm, addmm, addmm_, bmm) dispatched inside the block, in order."""

    PRODUCTS = ("mm", "addmm", "addmm_", "bmm")

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.PRODUCTS:
            self.calls.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def kl_heads(dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden_size, vocab = 96, 32, 517
    heads = [torch.nn.Linear(hidden_size, vocab, bias=False) for _ in range(2)]
    for head in heads:
        torch.nn.init.normal_(head.weight, std=0.3, generator=gen)
        head.to(dtype)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen).requires_grad_(True)
    teacher_hidden = torch.randn(1, tokens, hidden_size, generator=gen)
    return heads, hidden, teacher_hidden, torch.randint(vocab, (1, tokens), generator=gen)


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_fused_kl_head_gemms_run_in_bfloat16_and_accumulate_in_float32_under_autocast(ce_weight):
    """Under bf16 autocast every head GEMM of the fused KL (the student's and the teacher's logits, the hidden-state
    gradient and the head-gradient GEMM, all in its forward) takes bfloat16 operands, and the float32 head's
    gradient comes back in float32, close to the float32 run's. Without autocast every GEMM stays float32."""
    (student_head, teacher_head), hidden, teacher_hidden, ids = kl_heads()

    def run(autocast: bool):
        hidden.grad = student_head.weight.grad = None
        with MatmulDtypes() as products, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = chunked_kd_loss(hidden, teacher_hidden, student_head, teacher_head, ids, chunk_size=32,
                                      ce_weight=ce_weight)
        with MatmulDtypes() as backward:
            loss.backward()
        return loss, products.calls, backward.calls, hidden.grad.clone(), student_head.weight.grad.clone()

    full, mixed = run(False), run(True)
    chunks = 3  # 96 rows in chunks of 32: student logits, teacher logits, hidden gradient, head gradient per chunk
    assert len(full[1]) == len(mixed[1]) == 4 * chunks
    assert all(set(dtypes) == {torch.float32} for _, dtypes in full[1])
    assert all(set(dtypes) == {torch.bfloat16} for _, dtypes in mixed[1]), mixed[1]
    assert full[2] == mixed[2] == []  # the backward only scales the gradients computed in the forward
    assert mixed[4].dtype == torch.float32 and mixed[0].dtype == torch.float32
    assert mixed[0].item() == pytest.approx(full[0].item(), rel=LOSS_RTOL)
    for a, b in zip(full[3:], mixed[3:]):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999


def test_fused_kl_head_gradient_path_is_named_per_device_and_accumulates_in_float32():
    """Each accumulation path adds a bfloat16 product into a float32 accumulator in place. CUDA's (addmm with
    out_dtype) has no CPU kernel: its call is checked on the meta device (dtypes, shapes, in place)."""
    from tcal.training.kd import add_head_grad, head_grad_path

    assert head_grad_path(torch.float32, torch.float32, "cpu") == "same_dtype"
    assert head_grad_path(torch.float32, torch.bfloat16, "cuda") == "out_dtype"  # addmm(out_dtype=float32)
    assert head_grad_path(torch.float32, torch.bfloat16, "cpu") == "chunk_product"  # no out_dtype kernel there
    gen = torch.Generator().manual_seed(0)
    grad_t, h = (torch.randn(shape, generator=gen).bfloat16() for shape in ((12, 5), (5, 7)))
    for path, device in (("chunk_product", "cpu"), ("out_dtype", "meta")):
        accumulator = torch.ones(12, 7, device=device)
        add_head_grad(accumulator, grad_t.to(device), h.to(device), path)
        assert accumulator.dtype == torch.float32 and accumulator.shape == (12, 7)
        if device == "cpu":
            expected = 1 + grad_t.double() @ h.double()
            torch.testing.assert_close(accumulator.double(), expected, rtol=1e-2, atol=1e-2)


def test_both_checkpointings_run_each_mixer_forward_twice_per_step_not_three_times(monkeypatch):
    """`stage.checkpoint_mixers` and `stage.activation_checkpointing` together: the checkpointed layer recomputes its
    mixer once in backward and the mixer's own checkpoint is skipped inside it; the losses are those of either
    checkpointing alone (a recompute changes no value), and the trained weights those of the former nesting (the
    mixers' checkpoints forced on inside the layers', three mixer forwards each): float32 is unchanged."""
    from tcal.store.fingerprint import weights_digest
    from tcal.student.gdn import GatedDeltaNet

    calls: list[int] = []
    mix = GatedDeltaNet.mix

    def counted(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return mix(self, *args, **kwargs)

    monkeypatch.setattr(GatedDeltaNet, "mix", counted)

    def one_step(mixers: bool, layers: bool, nested: bool = False):
        teacher = make_teacher("llama", seed=3)
        student = build_student(teacher, [0, 2], seed=0)
        cfg = compose("stage=distill", "stage.lr_mixer=1e-3", "stage.lr_rest=1e-4",
                      f"stage.checkpoint_mixers={str(mixers).lower()}",
                      f"stage.activation_checkpointing={str(layers).lower()}").stage
        module = DistillStage(student, teacher, cfg, 1)
        if nested:
            checkpointing = module.set_checkpointing

            def former(mixers: bool, layers: bool) -> None:
                checkpointing(mixers, layers)
                for i in student.config.gdn_layers:
                    student.gdn(i).checkpoint_training = mixers

            module.set_checkpointing = former
        losses = []
        loss_of = module.loss
        module.loss = lambda batch: (lambda out: (losses.append(out[0].item()), out)[1])(loss_of(batch))
        batches = torch.randint(3, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0)
        calls.clear()
        trainer.fit(module, DataLoader(batches, batch_size=2))
        return sorted(calls), losses, weights_digest(student)

    both, both_losses, both_weights = one_step(True, True)
    assert both == [1, 1, 3, 3]  # GDN layers 1 and 3: the forward and the layer's recompute
    layers, layer_losses, _ = one_step(False, True)
    mixers, mixer_losses, _ = one_step(True, False)
    assert layers == mixers == both
    assert one_step(False, False)[0] == [1, 3]
    assert both_losses == layer_losses == mixer_losses
    nested, nested_losses, nested_weights = one_step(True, True, nested=True)
    assert nested == [1, 1, 1, 3, 3, 3] and (nested_losses, nested_weights) == (both_losses, both_weights)


def sharded_dtypes(precision: str):
    """(the dtype of a decoder layer's gathered weight in its forward, the dtypes of the reduce-scatter and the
    all-gather of the gradients and parameters, the sharded parameters' dtypes) over one Stage 2 training step of
    one FSDP rank in this process."""
    from tcal.training.run import ShardedStrategy

    teacher = make_teacher("llama", seed=3)
    student = build_student(teacher, [0, 2], seed=0)
    module = DistillStage(student, teacher, compose("stage=distill").stage, 1)
    gathered = []
    student.model.layers[1].register_forward_pre_hook(lambda layer, args: gathered.append(
        layer.mlp.down_proj.weight.dtype))
    batches = torch.randint(3, teacher.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ShardedStrategy(1), precision=precision, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        use_distributed_sampler=False)
    trainer.fit(module, DataLoader(batches, batch_size=2))
    return set(gathered), {p.dtype for p in student.parameters()}



@pytest.mark.parametrize("precision,gathered", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_fsdp_gathers_parameters_in_bfloat16_only_under_bf16_mixed(precision, gathered, one_rank_group):
    """One FSDP rank: under bf16-mixed a unit's weights are bfloat16 while it runs and the shards AdamW updates stay
    float32; under 32-true everything stays float32 (no policy: the float32 path is what it was)."""
    from tcal.training.stages import fsdp_policy

    seen, shards = sharded_dtypes(precision)
    assert seen == {gathered} and shards == {torch.float32}
    policy = fsdp_policy(precision)
    assert (policy is None) == (precision == "32-true")
    if policy is not None:
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


class Collectives(TorchDispatchMode):
    """The dtypes of the tensors each collective (all-gather, reduce-scatter) of the block moves."""

    def __init__(self):
        super().__init__()
        self.moved: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        for kind in ("reduce_scatter", "all_gather"):
            if kind in name:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                self.moved.setdefault(kind, set()).update(t.dtype for t in tensors)
        return func(*args, **(kwargs or {}))


def two_rank_step(rank: int, world: int, port: int, folder: str, precision: str) -> None:
    """One rank of `test_fsdp_collectives_move_bfloat16_parameters_and_float32_gradients`: one forward and backward
    of the sharded tiny student under autocast, the dtypes each collective moved written to `folder`."""
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tcal.training.stages import shard_student

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        student = build_student(make_teacher("llama", seed=3), [0, 2], seed=0).train()
        shard_student(student, init_device_mesh("cpu", (world,)), precision)
        batch = torch.randint(3, student.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
        with Collectives() as collectives:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = student(input_ids=batch, use_cache=False).logits.float().square().mean()
            loss.backward()
        grads = {str(p.grad.dtype) for p in student.parameters() if p.grad is not None}
        moved = {kind: sorted(str(d) for d in dtypes) for kind, dtypes in collectives.moved.items()}
        with open(os.path.join(folder, f"rank_{rank}.json"), "w") as out:
            json.dump({"moved": moved, "grads": sorted(grads)}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_fsdp_collectives_move_bfloat16_parameters_and_float32_gradients(precision, tmp_path):
    """2 gloo ranks: under bf16-mixed the all-gathers move bfloat16 parameters and the reduce-scatters float32
    gradients into float32 shards; under 32-true both move float32."""
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.start_processes(two_rank_step, args=(2, port, str(tmp_path), precision), nprocs=2,
                                          start_method="spawn")
    params = "torch.bfloat16" if precision == "bf16-mixed" else "torch.float32"
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert seen["moved"] == {"all_gather": [params], "reduce_scatter": ["torch.float32"]}, seen
        assert seen["grads"] == ["torch.float32"]
