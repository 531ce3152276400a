"""The retrieval mix (`data.retrieval_mix`): a stated fraction of training samples replaced by synthetic retrieval
sequences from the training split; batches a pure function of (seed, step, rank); off by default; part of the
Stage 1 cache key and of the recorded settings; bad values fail before work on one line."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, repo_cache_dir
from test_errors import run_fails

from tcal.data.documents import load_splits, token_stream
from tcal.data.needles import key_words
from tcal.errors import ConfigError
from tcal.teachers.load import load_tokenizer
from tcal.training.data import PackedTextDataModule, StepSampler, is_retrieval

SEQ_LEN, BATCH, STEPS = 192, 4, 6


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())


@pytest.fixture(scope="module")
def train_docs():
    return load_splits(compose().data).train[:3]


def batches(module: PackedTextDataModule, world: int = 1) -> dict[tuple[int, int], torch.Tensor]:
    """{(step, rank): [batch, seq_len]} read as the stage's loader reads them."""
    dataset = module.dataset()
    out = {}
    for rank in range(world):
        indices = list(StepSampler(BATCH, STEPS, rank, world))
        for step in range(STEPS):
            out[step, rank] = torch.stack([dataset[i] for i in indices[step * BATCH:(step + 1) * BATCH]])
    return out


def module(train_docs, tokenizer, seed=0, mix=0.25):
    return PackedTextDataModule(train_docs, tokenizer, SEQ_LEN, BATCH, STEPS, seed, retrieval_mix=mix)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_an_exact_fraction_of_every_run_of_samples(fraction):
    for start in (0, 7, 1000):
        for length in (20, 40):
            count = sum(is_retrieval(g, fraction) for g in range(start, start + length))
            assert abs(count - fraction * length) < 1
    assert not any(is_retrieval(g, 0.0) for g in range(100))


def test_batches_are_a_function_of_seed_step_and_rank(train_docs, tokenizer):
    first = batches(module(train_docs, tokenizer), world=2)
    again = batches(module(train_docs, tokenizer), world=2)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = batches(module(train_docs, tokenizer, seed=1), world=2)
    assert any(not torch.equal(first[k], other[k]) for k in first)
    # a resumed loader (starting at step 3) reads what the uninterrupted one read at steps 3..5
    dataset = module(train_docs, tokenizer).dataset()
    resumed = list(StepSampler(BATCH, STEPS, 1, 2, start_step=lambda: 3))
    assert torch.equal(torch.stack([dataset[i] for i in resumed[:BATCH]]), first[3, 1])


def test_mixed_samples_are_retrieval_sequences_of_the_training_split(train_docs, tokenizer):
    plain = batches(module(train_docs, tokenizer, mix=0.0))
    mixed = batches(module(train_docs, tokenizer, mix=0.25))
    words = set(key_words("\n".join(d.text for d in train_docs)))
    replaced = 0
    for (step, rank), batch in mixed.items():
        assert batch.shape == (BATCH, SEQ_LEN)
        for j in range(BATCH):
            g = step * BATCH + j
            if is_retrieval(g, 0.25):
                replaced += 1
                text = tokenizer.decode(batch[j])
                assert not torch.equal(batch[j], plain[step, rank][j])
                key = text.rsplit("\n", 1)[-1]  # the question, then its answer
                assert key.split()[-1].isdigit() and key.split()[-1] in text[:-len(key)]
                assert any(w in key.lower() for w in words)
            else:
                assert torch.equal(batch[j], plain[step, rank][j])
    assert replaced == STEPS  # one in four of 24 samples


def test_off_by_default_and_recorded_in_the_settings():
    assert compose().data.retrieval_mix == 0.0
    assert (compose("data.retrieval_mix=0.25")).data.retrieval_mix == 0.25


def test_the_mix_keys_the_stage1_cache(train_docs, tokenizer):
    from types import SimpleNamespace

    from tcal.training.run import stage1_key

    class Student:
        config = SimpleNamespace(keep_layers=[0], gdn_layers=[])

    from conftest import make_teacher

    from tcal.data.documents import load_splits
    teacher = make_teacher("llama")
    splits = load_splits(compose().data)
    keys = []
    for mix in (0.0, 0.25, 0.5):
        ctx = SimpleNamespace(teacher=teacher, settings=compose("stage=align", f"data.retrieval_mix={mix}"),
                              tokenizer=tokenizer, splits=splits)
        plan = SimpleNamespace(settings=ctx.settings.stage, data=module(train_docs, tokenizer, mix=mix))
        keys.append(stage1_key(ctx, Student(), plan))
    assert len(set(keys)) == 3


@pytest.mark.parametrize("overrides, match", [
    (["data.retrieval_mix=1.0"], r"^data.retrieval_mix=1.0; expected a fraction in \[0, 1\)"),
    (["data.retrieval_mix=-0.1"], r"^data.retrieval_mix=-0.1; expected a fraction in \[0, 1\)"),
    (["data.retrieval_mix=0.25", "stage=distill", "stage.seq_len=64"],
     r"^stage.seq_len=64 is too short for data.retrieval_mix=0.25; expected at least 128 tokens"),
])
def test_bad_mix_fails_before_work_on_one_line(overrides, match, compose_cfg, tmp_path):
    err = run_fails(compose_cfg, tmp_path, ConfigError, match, *overrides)
    assert "\n" not in str(err)
