"""`retention=recall retention.search=greedy` (docs/method.md, "Retained-layer policies": the search): on a toy whose
copy head needs a previous-token head that two layers provide, the per-layer score chooses the copy head alone and
the search keeps a previous-token head beside it; the search's decisions, budget and stopping; its candidates'
forwards against students built whole; determinism, the cache and bad settings."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose, make_teacher
from test_errors import run_fails
from test_recall import VOCAB, make_ctx, splits, tokenizer  # noqa: F401 - fixtures

import tcal.retention.search as search_mod
from tcal.errors import ConfigError
from tcal.retention import select_layers
from tcal.retention.ga_s2 import initialized_gdns
from tcal.retention.probe import probe_sequences, sequence_losses
from tcal.retention.search import Students, greedy_search
from tcal.student.convert import build_student

COPY, PREVIOUS = 3, (1, 2)
DIGIT_LOGIT = 7.0  # the copy head's weight on the copied digit: an answer digit it finds is likely (NLL ~ 1)
PAIR_WEIGHT = 200.0  # the previous-token head's score at its offset, per RoPE pair, after the 1/sqrt(head_dim) scale
MATCH = 4.0  # the copy head's query and key weights on a digit's one-hot
CONSTANT = 3.0  # a hidden dim every token holds, so that RMSNorm does not blow up small signals of plain text
SLOTS = (3, 4, 5, 6, 7, 11, 12, 13, 14, 15)  # head dims of RoPE pairs 3..7: rotation < 3e-5 rad a position
SEARCH = ("retention.num_prompts=8", "retention.ratio=0.5", "retention.fill=uniform", "init=naive")


def induction_teacher(tokenizer, seed: int = 0):
    """A tiny Llama (4 layers) whose layer 3 copies the digit that followed the current digit earlier in the
    context, using a previous-token feature that layers 1 and 2 each write: retrieval needs layer 3 and one of 1, 2.

    Hidden dims: 0 marks a digit, 1..10 its one-hot, 11..20 the copied digit (the head reads it as that digit's
    logit), 21..30 the previous token's digit one-hot, 31 a constant. Head 0 of layers 1 and 2 attends to the previous
    position (query and key biases on RoPE pairs 0 and 1, scores PAIR_WEIGHT cos((p - s - 1) theta), sharpest at
    p - s = 1) and writes the digit it reads to 21..30. Head 0 of layer 3 (pairs 3..7, practically unrotated) matches
    the current digit (query, 1..10) against the previous-token feature (key, 21..30) and writes the matched position's
    digit to 11..20. Layer 0's attention writes nothing. Every other weight that could write dims 0..31 is zero.
    A naive GDN keeps no bias, so a converted previous-token or copy head loses its pattern."""
    model = make_teacher("llama", seed=seed, vocab_size=VOCAB, tie_word_embeddings=False, attention_bias=True,
                         num_attention_heads=4, num_key_value_heads=4, rope_theta=1e12, initializer_range=0.02)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    theta = model.model.rotary_emb.inv_freq.tolist()
    scale = math.sqrt(PAIR_WEIGHT * model.config.head_dim ** 0.5)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, :32] = 0.0
        emb[:, 31] = CONSTANT
        for d, token in enumerate(digits):
            emb[token, 0] = 1.0
            emb[token, 1 + d] = 1.0
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.zero_()
            attn.o_proj.weight[:32] = 0.0
            layer.mlp.down_proj.weight[:32] = 0.0
            if i not in (*PREVIOUS, COPY):
                continue
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight[:16] = 0.0
            attn.o_proj.weight[:, :16] = 0.0
            written = 21 if i in PREVIOUS else 11
            for d in range(10):
                attn.v_proj.weight[d, 1 + d] = 1.0
                attn.o_proj.weight[written + d, d] = 1.0
            if i in PREVIOUS:
                for pair in (0, 1):
                    attn.k_proj.bias[pair] = scale
                    attn.q_proj.bias[pair] = scale * math.cos(theta[pair])
                    attn.q_proj.bias[pair + 8] = -scale * math.sin(theta[pair])
            else:
                for d in range(10):
                    attn.q_proj.weight[SLOTS[d], 1 + d] = MATCH
                    attn.k_proj.weight[SLOTS[d], 21 + d] = MATCH
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.lm_head.weight[:, 11:32] = 0.0
        for d, token in enumerate(digits):
            model.lm_head.weight[token, 11 + d] = DIGIT_LOGIT
    return model.eval()


def without_seconds(details: dict) -> dict:
    search = {k: v for k, v in details["search"].items() if k not in ("seconds", "init_seconds")}
    return {**details, "seconds": None, "search": search}


# ----------------------------------------------------------------------------------------------------------
# the toy: a copy head that needs a previous-token head


@pytest.mark.parametrize("seed", [0, 1])
def test_the_search_keeps_the_previous_token_head_the_score_misses(seed, make_ctx, tokenizer):
    """K = 2 of 4. The score chooses the copy layer alone (bypassing either previous-token layer costs the teacher
    nothing: the other writes the same feature), and the uniform fill keeps layer 0, so the rule's student converts
    both previous-token layers and does not retrieve. The search's add pass finds that either restores retrieval
    and swaps one in for the fill's layer."""
    model = induction_teacher(tokenizer, seed)
    rule = make_ctx(model, *SEARCH, "retention.cache=false")
    by_rule = select_layers(rule.settings.retention, rule)
    assert by_rule.details["scored_layers"] == [COPY] and by_rule.keep_layers == [0, COPY]
    assert by_rule.details["answer_rise"][str(COPY)] > 2.0
    assert all(by_rule.scores[i] < 0 for i in PREVIOUS)  # either alone is dispensable to the teacher
    ctx = make_ctx(model, *SEARCH, "retention.search=greedy", "retention.cache=false")
    selection = select_layers(ctx.settings.retention, ctx)
    search = selection.details["search"]
    assert selection.keep_layers in ([1, COPY], [2, COPY]) and selection.keep_layers == search["keep"]
    assert selection.details["scored_layers"] == [COPY] and selection.scores == by_rule.scores
    start, *adds, swap = search["path"]
    assert start["move"] == "start" and start["keep"] == by_rule.keep_layers
    assert sorted(e["move"] for e in adds) == ["add 1", "add 2"] and all(e["candidate"] for e in adds)
    assert swap["accepted"] and swap["keep"] == selection.keep_layers and search["swaps"] == [swap["move"][5:]
                                                                                              .replace(" ", "")]
    assert start["answer"] - swap["answer"] > 3.0  # the student retrieves once a previous-token head is kept
    assert abs(swap["text"] - start["text"]) < 0.01
    assert search["forwards"] == 4 and search["stopped"] == "no candidate left" and search["init"] == "naive"


def test_the_search_is_deterministic_for_a_seed(make_ctx, tokenizer):
    model = induction_teacher(tokenizer)
    runs = [select_layers(c.settings.retention, c) for c in
            (make_ctx(model, *SEARCH, "retention.search=greedy", "retention.cache=false") for _ in range(2))]
    assert without_seconds(runs[0].details) == without_seconds(runs[1].details)
    other = make_ctx(model, *SEARCH, "retention.search=greedy", "retention.cache=false", "retention.probe_seed=1")
    moved = select_layers(other.settings.retention, other).details["search"]
    assert [e["losses"] for e in moved["path"]] != [e["losses"] for e in runs[0].details["search"]["path"]]


@pytest.mark.parametrize("budget, forwards, stopped", [(1, 1, "budget"), (3, 3, "budget"),
                                                       (4, 4, "no candidate left"), (9, 4, "no candidate left")])
def test_the_budget_counts_every_student_forward(budget, forwards, stopped, make_ctx, tokenizer, monkeypatch):
    """The students' forwards are counted where they run (each candidate: one forward per batch of the probe's
    sequences); the search never runs more candidates than `search_budget`, the start's included."""
    calls = []
    real = search_mod.sequence_losses
    monkeypatch.setattr(search_mod, "sequence_losses", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = make_ctx(induction_teacher(tokenizer), *SEARCH, "retention.search=greedy", "retention.cache=false",
                   f"retention.search_budget={budget}", "retention.batch_size=4")
    search = select_layers(ctx.settings.retention, ctx).details["search"]
    assert len(calls) == 2 * forwards  # 8 sequences in batches of 4
    assert search["forwards"] == len(search["path"]) == forwards and search["stopped"] == stopped
    assert search["keep"] == ([0, COPY] if budget < 4 else search["path"][-1]["keep"])


# ----------------------------------------------------------------------------------------------------------
# the candidates' forwards


def test_a_candidate_replaying_the_start_gives_the_losses_of_a_student_built_whole(make_ctx, tokenizer):
    """Students: the start records its layers' outputs, a later candidate replays those below its first difference;
    every candidate's losses equal those of `build_student` with that keep list and the same initialized layers."""
    model = induction_teacher(tokenizer)
    ctx = make_ctx(model, *SEARCH, "retention.search=greedy")
    ids, labels = probe_sequences(ctx.settings.retention, ctx)
    gdns = initialized_gdns(ctx)
    students = Students(model, gdns, ids, labels, batch_size=4)
    for keep in ([0, 3], [0, 2, 3], [1, 3], [0, 1], [2]):
        whole = build_student(model, keep)
        for i in whole.config.gdn_layers:
            whole.gdn(i).load_state_dict(gdns[i].state_dict())
        expected = sequence_losses(whole.eval(), ids[:4], labels[:4]) + sequence_losses(whole, ids[4:], labels[4:])
        assert students.losses(keep) == expected
    assert students.forwards == 5


# ----------------------------------------------------------------------------------------------------------
# the decisions, on made-up losses


def fake_losses(table: dict[tuple, tuple[list[float], float]]):
    """measure(keep) -> [[A_p, T]] from {keep: (answers per sequence, text)}; records the sets asked."""
    asked = []

    def measure(keep):
        asked.append(tuple(keep))
        answers, text = table[tuple(keep)]
        return [[a, text] for a in answers]

    return measure, asked


HIGH, LOW = [5.0, 5.2, 4.8, 5.1], [1.0, 1.1, 0.9, 1.05]


def test_a_swap_that_costs_the_text_beyond_the_margin_is_refused():
    """Start [0, 3] (3 chosen by the score, 0 removable); adding 1 or 2 lowers the answer loss; swapping 1 for 0
    costs the text 0.05 (> 0.03), swapping 2 for 0 costs 0.01: the first is refused, the second accepted."""
    measure, asked = fake_losses({(0, 3): (HIGH, 3.0), (0, 1, 3): (LOW, 3.0), (0, 2, 3): ([1.5, 1.4, 1.6, 1.5], 3.0),
                                  (1, 3): (LOW, 3.05), (2, 3): ([1.5, 1.4, 1.6, 1.5], 3.01)})
    result = greedy_search(measure, [0, 3], [0], [2, 1], budget=10, text_margin=0.03, noise_z=3.0)
    assert asked == [(0, 3), (0, 2, 3), (0, 1, 3), (1, 3), (2, 3)]  # add pass in the given order, then by gain
    assert result["keep"] == [2, 3] and result["swaps"] == ["+2-0"] and result["stopped"] == "no candidate left"
    assert [e.get("accepted") for e in result["path"][3:]] == [False, True]
    assert math.isclose(result["path"][3]["text_rise"], 0.05, abs_tol=1e-9)


def test_an_answer_gain_inside_the_noise_is_no_candidate():
    """Adding 1 lowers the answer loss on average (0.5) but not in every sequence: g - 3 se <= 0, no swap tried."""
    measure, asked = fake_losses({(0, 3): (HIGH, 3.0), (0, 1, 3): ([3.0, 6.2, 3.3, 5.6], 3.0)})
    result = greedy_search(measure, [0, 3], [0], [1], budget=10, text_margin=0.03, noise_z=3.0)
    assert asked == [(0, 3), (0, 1, 3)] and result["keep"] == [0, 3]
    assert result["stopped"] == "no layer's gain above the noise" and not result["path"][1]["candidate"]


def test_swaps_take_candidates_by_gain_and_removable_layers_cheapest_first():
    """Two candidates (1 gains more than 4), two removable layers (5 before 0): 1 replaces 5, then 4 replaces 0 if
    it lowers the answer loss of [0, 1, 3] beyond the noise; the accepted layer 1 is never removed."""
    table = {(0, 3, 5): (HIGH, 3.0), (0, 1, 3, 5): (LOW, 3.0), (0, 3, 4, 5): ([2.0, 2.1, 1.9, 2.05], 3.0),
             (0, 1, 3): (LOW, 3.0), (1, 3, 4): ([0.5, 0.6, 0.4, 0.55], 3.0)}
    measure, asked = fake_losses(table)
    result = greedy_search(measure, [0, 3, 5], [5, 0], [4, 1], budget=10, text_margin=0.03, noise_z=3.0)
    assert asked == [(0, 3, 5), (0, 3, 4, 5), (0, 1, 3, 5), (0, 1, 3), (1, 3, 4)]
    assert result["swaps"] == ["+1-5", "+4-0"] and result["keep"] == [1, 3, 4]


def test_nothing_removable_measures_nothing():
    result = greedy_search(None, [3, 7], [], [0, 1], budget=10, text_margin=0.03, noise_z=3.0)
    assert result["keep"] == [3, 7] and result["path"] == [] and result["stopped"].startswith("nothing removable")


# ----------------------------------------------------------------------------------------------------------
# the cache, the settings, the report


def test_a_second_selection_reads_the_search_from_the_cache(make_ctx, tokenizer, monkeypatch, tmp_path):
    model = induction_teacher(tokenizer)
    cache = tmp_path / "shared"
    first = make_ctx(model, *SEARCH, "retention.search=greedy", cache_dir=cache)
    searched = select_layers(first.settings.retention, first)
    assert len(list((cache / "retention").glob("recall-search-*.json"))) == 1

    def boom(*args, **kwargs):
        raise AssertionError("searched again instead of reading the cache")

    monkeypatch.setattr(search_mod, "Students", boom)
    again = make_ctx(model, *SEARCH, "retention.search=greedy", cache_dir=cache)
    assert select_layers(again.settings.retention, again).details == searched.details
    other_budget = make_ctx(model, *SEARCH, "retention.search=greedy", "retention.search_budget=2", cache_dir=cache)
    with pytest.raises(AssertionError, match="searched again"):  # a keep setting of the search is in its key
        select_layers(other_budget.settings.retention, other_budget)


def test_the_search_needs_the_calibration_split_as_an_initializing_policy():
    assert compose("retention=recall", "retention.search=greedy").retention.initializes_layers()
    assert not compose("retention=recall").retention.initializes_layers()


@pytest.mark.parametrize("overrides, match", [
    (["retention.search=beam"], r"^retention.search='beam'; expected one of none, greedy, prune$"),
    (["retention.search_budget=0"], r"^retention.search_budget=0; expected a positive integer$"),
    (["retention.text_margin=-0.1"], r"^retention.text_margin=-0.1; expected a number >= 0"),
])
def test_bad_search_setting_fails_before_work_on_one_line(overrides, match, compose_cfg, tmp_path):
    err = run_fails(compose_cfg, tmp_path, ConfigError, match, "retention=recall", *overrides)
    assert "\n" not in str(err)


def test_the_report_names_the_search_and_its_swaps():
    from tcal.tools.figures import retention_variant

    rule = {"probe": "bypass", "seq_len": 1024, "scored_layers": [16, 18, 19], "fill": "text",
            "rule": "score - 3.0 * se > 0", "scored": None, "noise_z": 3.0}
    search = {"swaps": ["+8-24", "+3-20"], "forwards": 32, "budget": 32, "init": "phase2"}
    assert retention_variant({**rule, "search": search}) == (
        "bypass/1024 rule z=3 (16 18 19) fill=text search=+8-24 +3-20 (32/32 forwards, phase2)")
    assert retention_variant({**rule, "search": {**search, "swaps": [], "forwards": 23}}).endswith(
        "search=no swap (23/32 forwards, phase2)")


def test_a_teacher_without_a_retriever_keeps_the_rules_list(make_ctx):
    """Small random layers: nothing is scored, so every kept layer is removable, and no converted layer lowers the
    student's answer loss beyond the noise: the search ends after its add pass with the rule's list."""
    model = make_teacher("llama", vocab_size=VOCAB)
    ctx = make_ctx(model, *SEARCH, "retention.search=greedy", "retention.cache=false")
    selection = select_layers(ctx.settings.retention, ctx)
    search = selection.details["search"]
    assert selection.details["scored_layers"] == [] and selection.keep_layers == search["start"]
    assert search["stopped"] == "no layer's gain above the noise" and search["forwards"] == 3
