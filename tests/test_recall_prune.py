"""`retention=recall retention.search=prune` (docs/method.md, "Retained-layer policies": the elimination): on the toy
whose copy head needs one of two previous-token heads, elimination from every layer kept ends with the copy head and
a previous-token head; its decisions, budget and stopping; candidates replayed from a re-recorded set against
students built whole; the searched list as an ordinary keep list; determinism, the cache, bad settings, the report."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import compose
from test_errors import run_fails
from test_recall import make_ctx, splits, tokenizer  # noqa: F401 - fixtures
from test_recall_search import COPY, PREVIOUS, SEARCH, induction_teacher

import tcal.retention.search as search_mod
from tcal.errors import ConfigError
from tcal.retention import select_layers
from tcal.retention.ga_s2 import initialized_gdns
from tcal.retention.probe import probe_sequences, sequence_losses
from tcal.retention.search import Students, prune_search
from tcal.student.convert import build_student

PRUNE = (*SEARCH, "retention.search=prune", "retention.cache=false")
FROM_ALL = (*PRUNE, "retention.prune_from_ratio=1.0")  # the rule's list at ratio 1: all 4 layers


def without_seconds(details: dict) -> dict:
    search = dict(details["search"])
    for key in ("seconds", "init_seconds"):
        search.pop(key)
    timing = ("seconds", "cpu_seconds")
    search["path"] = [{k: v for k, v in e.items() if k not in timing} for e in search["path"]]
    search["steps"] = [{k: v for k, v in s.items() if k not in timing} for s in search["steps"]]
    return {**details, "seconds": None, "search": search}


def whole_student_losses(model, keep, ids, labels, gdns=None):
    """The losses of `build_student(keep)` over the probe's sequences in batches of 4 (`gdns`: its converted
    layers' weights; none: the naive student's own)."""
    whole = build_student(model, keep).eval()
    for i in whole.config.gdn_layers if gdns is not None else ():
        whole.gdn(i).load_state_dict(gdns[i].state_dict())
    rows = []
    for s in range(0, ids.shape[0], 4):
        rows += sequence_losses(whole, ids[s:s + 4], labels[s:s + 4])
    return rows


# ----------------------------------------------------------------------------------------------------------
# the toy: a copy head that needs a previous-token head


@pytest.mark.parametrize("seed", [0, 1])
def test_elimination_from_every_layer_ends_with_the_copy_and_a_previous_token_head(seed, make_ctx, tokenizer):
    """K = 2 of 4, from all 4 kept. The first step may remove any of 0, 1, 2 (either previous-token head alone is
    enough); the second must keep layer 3 and the remaining previous-token head: removing either makes the student
    lose the answers. The rule's own list at 0.5 ([0, 3]: the score misses both previous-token heads) does not
    retrieve; the pruned one does."""
    model = induction_teacher(tokenizer, seed)
    ctx = make_ctx(model, *FROM_ALL)
    selection = select_layers(ctx.settings.retention, ctx)
    search = selection.details["search"]
    assert search["method"] == "prune" and search["start"] == [0, 1, 2, 3] and search["stopped"] == "target reached"
    assert selection.keep_layers == search["keep"] and selection.keep_layers in ([1, COPY], [2, COPY])
    assert selection.details["scored_layers"] == [COPY]  # the rule's details stay beside the search's
    moves = [e["move"] for e in search["path"]]
    assert moves == ["start", "remove 0", "remove 1", "remove 2", "remove 3", "record",
                     *[f"remove {i}" for i in search["steps"][1]["keep"]]]
    assert search["forwards"] == len(search["path"]) == 9 and [s["forwards"] for s in search["steps"]] == [4, 4]
    assert search["removed"] == [s["removed"] for s in search["steps"]] and len(search["removed"]) == 2
    last = {e["layer"]: e for e in search["path"] if e["step"] == 2 and e["move"] != "record"}
    kept_previous = next(i for i in PREVIOUS if i in selection.keep_layers)
    for lost in (COPY, kept_previous):  # removing the copy head or the last previous-token head loses retrieval
        assert last[lost]["answer_rise"] - 3 * last[lost]["answer_se"] > 2.0
    final = last[search["removed"][1]]
    assert final["keep"] == selection.keep_layers and abs(final["answer_rise"]) < 0.1
    assert final["answer"] < search["path"][0]["answer"] + 0.1  # no worse than all four kept
    by_rule = select_layers(make_ctx(model, *SEARCH, "retention.cache=false").settings.retention,
                            make_ctx(model, *SEARCH, "retention.cache=false"))
    assert by_rule.keep_layers == [0, COPY]
    rule_student = [e for e in search["path"] if e["keep"] == [0, COPY]]
    if rule_student:  # measured on the way when step 1 removed 1 or 2
        assert rule_student[0]["answer"] - final["answer"] > 2.0


def test_elimination_is_deterministic_for_a_seed(make_ctx, tokenizer):
    model = induction_teacher(tokenizer)
    runs = [select_layers(c.settings.retention, c) for c in (make_ctx(model, *FROM_ALL) for _ in range(2))]
    assert without_seconds(runs[0].details) == without_seconds(runs[1].details)
    other = make_ctx(model, *FROM_ALL, "retention.probe_seed=1")
    moved = select_layers(other.settings.retention, other).details["search"]
    assert [e["losses"] for e in moved["path"]] != [e["losses"] for e in runs[0].details["search"]["path"]]


@pytest.mark.parametrize("budget, forwards, stopped", [(1, 1, "budget"), (4, 4, "budget"), (5, 5, "budget"),
                                                       (8, 8, "budget"), (9, 9, "target reached"),
                                                       (32, 9, "target reached")])
def test_the_budget_counts_every_student_forward(budget, forwards, stopped, make_ctx, tokenizer, monkeypatch):
    """Every forward is counted where it runs (one per batch of the probe's sequences): the start, each candidate
    and each re-recording of a step's set; the elimination never runs more than `search_budget`, and a budget
    that runs out mid-step keeps the last complete step's set."""
    calls = []
    real = search_mod.sequence_losses
    monkeypatch.setattr(search_mod, "sequence_losses", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx = make_ctx(induction_teacher(tokenizer), *FROM_ALL, f"retention.search_budget={budget}",
                   "retention.batch_size=4")
    search = select_layers(ctx.settings.retention, ctx).details["search"]
    assert len(calls) == 2 * forwards  # 8 sequences in batches of 4
    assert search["forwards"] == len(search["path"]) == forwards and search["stopped"] == stopped
    assert len(search["keep"]) == 4 - len(search["removed"]) == 4 - (forwards >= 5) - (forwards >= 9)


def test_a_given_start_skips_the_rules_probe(make_ctx, tokenizer, monkeypatch):
    """`prune_from=[...]`: the elimination starts from that list, and the rule's probe (teacher forwards) is not
    run; the report names the given start and the path."""
    import tcal.retention.recall as recall_mod
    from tcal.tools.figures import retention_variant

    monkeypatch.setattr(recall_mod, "probe_losses", lambda *a, **k: pytest.fail("the rule's probe ran"))
    ctx = make_ctx(induction_teacher(tokenizer), *PRUNE, "retention.prune_from=[1,2,3]")
    selection = select_layers(ctx.settings.retention, ctx)
    search = selection.details["search"]
    assert search["start"] == [1, 2, 3] and search["prune_from"] == "given" and search["forwards"] == 4
    assert selection.keep_layers in ([1, COPY], [2, COPY]) and selection.scores == {}
    assert retention_variant(selection.details) == (
        f"prune_from=1 2 3 search=prune 3->2: -{search['removed'][0]} (4/32 forwards, target reached, naive)")


# ----------------------------------------------------------------------------------------------------------
# the candidates' forwards


def test_candidates_replayed_from_a_rerecorded_set_give_the_losses_of_students_built_whole(make_ctx, tokenizer):
    """Students: `record=True` makes a candidate the set later candidates replay from (below their first
    difference from it); every candidate's losses, the recording's included, equal those of `build_student` with
    that keep list and the same initialized layers."""
    model = induction_teacher(tokenizer)
    ctx = make_ctx(model, *SEARCH, "retention.search=prune")
    ids, labels = probe_sequences(ctx.settings.retention, ctx)
    gdns = initialized_gdns(ctx)
    students = Students(model, gdns, ids, labels, batch_size=4)
    for keep, record in (([0, 1, 2, 3], False), ([1, 2, 3], False), ([0, 2, 3], False), ([0, 1, 3], True),
                         ([1, 3], False), ([0, 3], False), ([0, 1], False), ([0, 1, 3], True), ([3], False)):
        assert students.losses(keep, record) == whole_student_losses(model, keep, ids, labels, gdns), keep
        assert students.reference == ({0, 1, 2, 3} if keep == [1, 2, 3] else students.reference)
    assert students.reference == {0, 1, 3} and students.forwards == 9


def test_the_searched_list_is_an_ordinary_keep_list(make_ctx, tokenizer):
    """`retention=explicit retention.keep=<the searched list>` keeps the same layers, and its student (naive init:
    the converted layers as built) gives the losses the elimination recorded for that set."""
    model = induction_teacher(tokenizer)
    ctx = make_ctx(model, *FROM_ALL)
    search = select_layers(ctx.settings.retention, ctx).details["search"]
    keep = search["keep"]
    explicit = compose("teacher=tiny_llama", "retention=explicit", f"retention.keep=[{','.join(map(str, keep))}]")
    assert select_layers(explicit.retention, SimpleNamespace(num_layers=4)).keep_layers == keep
    ids, labels = probe_sequences(ctx.settings.retention, ctx)
    recorded = next(e for e in reversed(search["path"]) if e["keep"] == keep)
    assert whole_student_losses(model, keep, ids, labels) == recorded["losses"]


# ----------------------------------------------------------------------------------------------------------
# the decisions, on made-up losses


def fake_losses(table: dict[tuple, tuple[list[float], float]]):
    """measure(keep, record) -> [[A_p, T]] from {keep: (answers per sequence, text)}; records the sets asked."""
    asked = []

    def measure(keep, record=False):
        asked.append((tuple(keep), record))
        answers, text = table[tuple(keep)]
        return [[a, text] for a in answers]

    return measure, asked


def test_each_step_removes_the_least_answer_cost_within_the_text_margin():
    """From [0, 3, 5] to 1: removing 5 costs the answer least but the text 0.05 more than removing 0 (> 0.03), so 0
    goes; then removing 3 costs the answer least among [3, 5] and its text is within the margin."""
    table = {(0, 3, 5): ([1.0, 1.1, 0.9, 1.0], 3.0), (3, 5): ([1.5, 1.6, 1.4, 1.5], 3.00),
             (0, 5): ([4.0, 4.1, 3.9, 4.0], 3.01), (0, 3): ([1.2, 1.3, 1.1, 1.2], 3.05),
             (5,): ([2.0, 2.1, 1.9, 2.0], 3.02), (3,): ([3.0, 3.1, 2.9, 3.0], 3.00)}
    measure, asked = fake_losses(table)
    result = prune_search(measure, [5, 0, 3], target=1, budget=20, text_margin=0.03)
    assert asked == [((0, 3, 5), True), ((3, 5), False), ((0, 5), False), ((0, 3), False),
                     ((3, 5), True), ((5,), False), ((3,), False)]
    assert result["removed"] == [0, 3] and result["keep"] == [5] and result["stopped"] == "target reached"
    first = {e["layer"]: e for e in result["path"] if e["step"] == 1}
    assert not first[5]["within_text_margin"] and first[0]["within_text_margin"] and first[3]["within_text_margin"]
    drops = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    assert math.isclose(first[0]["answer_rise"], float(drops.mean()), abs_tol=1e-12) and first[0]["answer_se"] < 1e-12
    assert math.isclose(first[5]["text_rise"], 0.05, abs_tol=1e-12)
    assert [s["keep"] for s in result["steps"]] == [[0, 3, 5], [3, 5]]


def test_equal_answer_losses_remove_the_lower_layer():
    table = {(2, 4): ([1.0, 1.0], 3.0), (4,): ([2.0, 2.0], 3.0), (2,): ([2.0, 2.0], 3.0)}
    measure, _ = fake_losses(table)
    assert prune_search(measure, [2, 4], target=1, budget=5, text_margin=0.03)["removed"] == [2]


def test_a_start_no_larger_than_the_target_measures_nothing():
    result = prune_search(None, [3, 7], target=2, budget=10, text_margin=0.03)
    assert result["keep"] == [3, 7] and result["path"] == [] and result["stopped"].startswith("the start keeps 2")


# ----------------------------------------------------------------------------------------------------------
# the cache, the settings, the report


def test_a_second_selection_reads_the_elimination_from_the_cache(make_ctx, tokenizer, monkeypatch, tmp_path):
    model = induction_teacher(tokenizer)
    cache = tmp_path / "shared"
    settings = (*SEARCH, "retention.search=prune", "retention.prune_from_ratio=1.0")
    first = select_layers(make_ctx(model, *settings, cache_dir=cache).settings.retention,
                          make_ctx(model, *settings, cache_dir=cache))
    monkeypatch.setattr(search_mod, "Students", lambda *a, **k: pytest.fail("searched again instead of the cache"))
    again = make_ctx(model, *settings, cache_dir=cache)
    assert select_layers(again.settings.retention, again).details == first.details
    greedy = make_ctx(model, *SEARCH, "retention.search=greedy", "retention.prune_from_ratio=1.0", cache_dir=cache)
    with pytest.raises(pytest.fail.Exception, match="searched again"):  # the search's kind is in its key
        select_layers(greedy.settings.retention, greedy)


@pytest.mark.parametrize("overrides, match", [
    (["retention.prune_from_ratio=0"], r"^retention.prune_from_ratio=0.0; expected a number in \(0, 1\]$"),
    (["retention.prune_from=[0,-1]"], r"^retention.prune_from=\[0, -1\]; expected null"),
    (["retention.search=prune", "retention.ratio=0.5", "retention.prune_from_ratio=0.25"],
     r"^retention.prune_from_ratio=0.25 keeps 1 of 4 layers, fewer than the 2 that retention.ratio=0.5 keeps$"),
    (["retention.search=prune", "retention.ratio=0.5", "retention.prune_from=[0]"],
     r"^retention.prune_from=\[0\] keeps 1 layers, fewer than the 2 that retention.ratio=0.5 keeps of 4$"),
    (["retention.search=prune", "retention.prune_from=[0,9]"], r"^retention.prune_from=\[0, 9\]: \[9\] out of range"),
])
def test_bad_prune_setting_fails_before_work_on_one_line(overrides, match, compose_cfg, tmp_path):
    err = run_fails(compose_cfg, tmp_path, ConfigError, match, "retention=recall", *overrides)
    assert "\n" not in str(err)


def test_the_report_prints_the_elimination_path():
    from tcal.tools.figures import retention_variant

    rule = {"probe": "bypass", "seq_len": 1024, "scored_layers": [16, 18, 19], "fill": "text",
            "rule": "score - 3.0 * se > 0", "scored": None, "noise_z": 3.0}
    search = {"method": "prune", "start": list(range(15)), "keep": list(range(8)),
              "removed": [14, 13, 12, 11, 10, 9, 8],
              "forwards": 91, "budget": 91, "stopped": "target reached", "init": "phase2"}
    assert retention_variant({**rule, "search": search}) == (
        "bypass/1024 rule z=3 (16 18 19) fill=text search=prune 15->8: -14 -13 -12 -11 -10 -9 -8 "
        "(91/91 forwards, target reached, phase2)")


def test_the_report_tables_every_step_of_the_elimination(make_ctx, tokenizer):
    """`tcal-report`'s elimination table: a row per step of a run's path, with the removed layer's student figures
    as the path recorded them; runs without an elimination give no row."""
    from pathlib import Path

    from tcal.tools.figures import Run, elimination_table

    ctx = make_ctx(induction_teacher(tokenizer), *FROM_ALL)
    details = select_layers(ctx.settings.retention, ctx).details
    fields = dict(path=Path("run"), teacher="toy", policy="recall", ratio=0.5, init_mode="naive",
                  gqa_expansion="whole_head", teacher_ppl={}, student_ppl={}, nlu={}, ruler={}, curve=[])
    header, rows = elimination_table([Run(**fields, retention_details=details),
                                      Run(**fields, retention_details={"scored_layers": [3]})])
    search = details["search"]
    assert [r[header.index("removed")] for r in rows] == [str(i) for i in search["removed"]]
    assert [r[header.index("kept")] for r in rows] == ["4", "3"]
    assert rows[-1][header.index("kept after")] == " ".join(map(str, search["keep"]))
    last = next(e for e in search["path"] if e.get("layer") == search["removed"][-1] and e["step"] == 2)
    assert rows[-1][header.index("answer NLL")] == f"{last['answer']:.3f}"
