"""Nothing of a stage outlives it: when a stage ends, its optimizer state and the student's gradients are freed
before the stage-end gather, and its optimizer and LightningModule are freed by reference counting (no reference
cycle through Lightning's Trainer, strategy, data module or callbacks keeps them until a full garbage collection).
Garbage collection is disabled around each run here, so an object kept only by a cycle stays alive and fails.
The final evaluation's harness holds one continuation's logits at a time, not the batch's."""

from __future__ import annotations

import contextlib
import gc
import weakref

import lightning as L
import pytest
import torch
from conftest import compose, isolated_cache_dir, repo_cache_dir
from torch.utils._python_dispatch import TorchDispatchMode

from tcal import api
from tcal.settings import DataSettings, EvalSettings, TrainerSettings, tiny_teacher

SMALL_EVAL = EvalSettings(seq_len=64, num_windows=2)  # the curve's windows (the default: 16 of 512 tokens)
BUDGET = ["stage=align_distill", *(f"stage.{kind}.{key}={value}" for kind in ("align", "distill")
                                    for key, value in (("batch_size", 2), ("seq_len", 32), ("max_tokens", 128),
                                                       ("eval_every_tokens", 64)))]


@pytest.fixture(scope="module")
def tiny():
    teacher = api.load_teacher(tiny_teacher(), repo_cache_dir())
    return teacher, api.load_data(DataSettings())


@contextlib.contextmanager
def no_garbage_collection():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StageObjects(L.Callback):
    """Weak references to each stage's LightningModule and optimizers, taken when its training ends; it holds
    nothing of a stage itself."""

    def __init__(self):
        self.refs: dict[str, dict[str, weakref.ref]] = {}

    def on_train_end(self, trainer, module) -> None:
        self.refs[module.kind] = {"module": weakref.ref(module),
                                  **{f"optimizer {i}": weakref.ref(o) for i, o in enumerate(trainer.optimizers)}}
        if trainer.strategy.model is not module:  # the strategy's wrapper (DDP's, with its gradient buckets)
            self.refs[module.kind]["wrapped module"] = weakref.ref(trainer.strategy.model)

    def alive(self) -> dict[str, list[str]]:
        return {kind: [name for name, ref in refs.items() if ref() is not None] for kind, refs in self.refs.items()}


def distill_watched(tiny, tmp_path, monkeypatch, trainer: TrainerSettings):
    """`api.distill` of Stage 1 then Stage 2 with garbage collection off; returns (what is still alive of each stage
    when it returns, what each stage-end gather saw: {kind: (optimizers still alive, parameters still holding a
    gradient)}, the stages whose end collected garbage)."""
    import tcal.training.run as training

    teacher, splits = tiny
    watch = StageObjects()
    at_gather = {}
    gather = training.unsharded_student

    def watched_gather(stage_trainer, student, ctx, kind):
        alive = [name for name, ref in watch.refs[kind].items() if name.startswith("optimizer") and ref() is not None]
        at_gather[kind] = (alive, [n for n, p in student.named_parameters() if p.grad is not None])
        return gather(stage_trainer, student, ctx, kind)

    monkeypatch.setattr(training, "unsharded_student", watched_gather)
    import lightning.pytorch.strategies.strategy as lightning_strategy

    to_device = lightning_strategy._optimizers_to_device
    moved = []  # the optimizer states Lightning's teardown copies to the host (one device and DDP)
    monkeypatch.setattr(lightning_strategy, "_optimizers_to_device", lambda optimizers, device: (
        moved.append(sum(len(o.state) for o in optimizers)), to_device(optimizers, device)))
    collect = training.collect_checkpoint_cycles
    collections = []
    monkeypatch.setattr(training, "collect_checkpoint_cycles", lambda kind: (collections.append(kind), collect(kind)))
    stage = compose(*BUDGET).stage
    with no_garbage_collection():
        student, records = api.distill(api.build_student(teacher, [0, 2]), teacher, splits, stage, eval=SMALL_EVAL,
                                       trainer=trainer, run_dir=tmp_path / "run",
                                       cache_dir=isolated_cache_dir(tmp_path / "cache"), callbacks=[watch])
        alive = watch.alive()
    assert set(records) == {"align", "distill"} and all(records[k]["steps"] == 2 for k in records)
    assert not any(moved)  # cleared at the end of training, before the teardown
    assert not any(p.grad is not None for p in student.parameters())
    return alive, at_gather, collections


def test_a_finished_stage_s_optimizer_and_module_are_freed_without_garbage_collection(tiny, tmp_path, monkeypatch):
    alive, at_gather, collections = distill_watched(tiny, tmp_path, monkeypatch, TrainerSettings())
    assert set(alive) == {"align", "distill"} and collections == []  # reference counting alone freed them
    assert alive == {"align": [], "distill": []}
    assert at_gather == {"align": ([], []), "distill": ([], [])}  # freed before each stage-end gather



def test_a_sharded_stage_frees_its_optimizer_shards_and_module_too(tiny, tmp_path, monkeypatch, one_rank_group):
    """One FSDP rank in this process: the sharded optimizer states and gradients are gone at the gather, and the
    stage's optimizer and module (which holds the sharded student) are freed when `distill` returns: the optimizer
    by reference counting, the module by the one collection each sharded stage makes of the cycles that
    torch.distributed.checkpoint's state-dict walk leaves (`collect_checkpoint_cycles`)."""
    alive, at_gather, collections = distill_watched(tiny, tmp_path, monkeypatch,
                                       TrainerSettings(strategy="fsdp", accelerator="cpu", devices=1))
    assert alive == {"align": [], "distill": []} and collections == ["align", "distill"]
    assert at_gather == {"align": ([], []), "distill": ([], [])}


class LargestVocabTensor(TorchDispatchMode):
    """The most elements of any new tensor with a last dimension of `vocab` that an op of the block produced (a
    view of an input, such as the head weight's transpose, is not new)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab
                    and tensor.untyped_storage().data_ptr() not in inputs):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_the_harness_scores_one_continuation_s_logits_at_a_time_with_lm_eval_s_figures(tiny):
    """The final harness's scoring (`RankedHFLM`) against lm-eval's own `HFLM` on the same model and requests
    (multi-token continuations of different lengths in one batch, and one-token continuations of a shared context,
    which lm-eval answers from one row): the same log-likelihoods and greedy flags, while no tensor larger than
    the longest continuation's [positions, vocab] is made (lm-eval makes the batch's [batch, length, vocab])."""
    from lm_eval.models.huggingface import HFLM

    from tcal.evaluate.ranked_lm import RankedHFLM
    from tcal.runtime.distributed import Ranks

    teacher, _ = tiny
    model, vocab = teacher.model, teacher.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = ids(20)
    requests = [((f"context {i}", f"continuation {i}"), ids(length), ids(cont))
                for i, (length, cont) in enumerate([(30, 5), (12, 9), (40, 1), (7, 3), (25, 12)])]
    requests += [(("shared", f"choice {i}"), shared, ids(1)) for i in range(3)]
    settings = {"pretrained": model, "tokenizer": teacher.tokenizer, "batch_size": 4, "max_length": 64,
                "device": "cpu"}
    lm_eval_own = HFLM(**settings)
    with LargestVocabTensor(vocab) as theirs:
        expected = lm_eval_own._loglikelihood_tokens(requests, disable_tqdm=True)
    ours = RankedHFLM(Ranks(), **settings)
    with LargestVocabTensor(vocab) as bounded:
        scored = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [greedy for _, greedy in scored] == [greedy for _, greedy in expected]
    assert [value for value, _ in scored] == pytest.approx([value for value, _ in expected], rel=1e-5, abs=1e-5)
    assert bounded.largest == max(len(cont) for _, _, cont in requests) * vocab
    assert theirs.largest >= 4 * 40 * vocab  # a batch of four of the longest requests


def test_a_ddp_stage_frees_its_wrapped_module_too(tiny, tmp_path, monkeypatch, one_rank_group):
    """One DDP rank in this process: the DistributedDataParallel wrapper (its gradient buckets as large as the
    gradients) goes with the stage's module and optimizer, by reference counting."""
    watch_alive, at_gather, collections = distill_watched(tiny, tmp_path, monkeypatch,
                                                          TrainerSettings(strategy="ddp", accelerator="cpu", devices=1))
    assert watch_alive == {"align": [], "distill": []} and collections == []
    assert at_gather == {"align": ([], []), "distill": ([], [])}
