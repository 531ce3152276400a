"""Retained-layer policies (docs/method.md, section "Retained-layer policies"): the uniform rule, AR and GA-S2 on
tiny teachers, the score cache, bad input, ratio 1.0, and the rule that selection never reads the evaluation split."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose, compose_config, make_teacher, repo_cache_dir

import tcal.init.calibration.calibrate as calibrate_mod
import tcal.retention.ar as ar_mod
import tcal.retention.ga_s2 as ga_s2_mod
from tcal.context import RunContext
from tcal.data.documents import load_splits, token_stream
from tcal.init import init_student
from tcal.pipeline import run
from tcal.registry import POLICIES
from tcal.retention import select_layers
from tcal.retention.ga_s2 import probes
from tcal.retention.uniform import uniform_layers
from tcal.settings.retention import num_kept
from tcal.student.convert import build_student, naive_gdn
from tcal.teachers.load import load_tokenizer

VOCAB = 49152  # the SmolLM2 tokenizer's
L = 4
# Short scoring windows and a tiny calibration: every selection here takes about a second.
FAST = ("teacher=tiny_llama", "calibration.seq_len=32", "calibration.batch_size=2", "calibration.phase2.steps=2")
SCORING = ("retention.seq_len=64", "retention.num_windows=4", "retention.batch_size=4")


def fast(*overrides: str) -> list[str]:
    """The app's overrides plus small scoring / calibration settings (scoring ones for the scored policies)."""
    scored = any(o in ("retention=ar", "retention=ga_s2") for o in overrides)
    return [*FAST, *(SCORING if scored else ()), *overrides]


class Forbidden(Exception):
    pass


class SelectionSplits:
    """The data splits as selection may see them: reading `evaluation` fails the test."""

    def __init__(self, calibration):
        self.train, self.calibration = [], calibration

    @property
    def evaluation(self):
        raise Forbidden("retention selection read the evaluation split")


class RecordingTokenizer:
    """The real tokenizer, remembering every text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, text, **kwargs):
        self.texts.append(text)
        return self.tokenizer(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())


@pytest.fixture(scope="module")
def splits():
    return load_splits(compose().data)


@pytest.fixture(scope="module")
def teacher():
    return make_teacher("llama", vocab_size=VOCAB)


@pytest.fixture
def make_ctx(tokenizer, splits, tmp_path):
    """RunContext for a selection: calibration split only, score cache under tmp_path/cache."""

    def make(teacher, *overrides, cache_dir=None):
        cfg = compose(*fast(*overrides))
        return RunContext(cfg, teacher, RecordingTokenizer(tokenizer),
                          SelectionSplits(splits.calibration), Path(cache_dir or tmp_path / "cache"), tmp_path / "run")

    return make


def teacher_needing_layer(layer: int, splits, tokenizer):
    """A tiny teacher that predicts the calibration text's unigram distribution only through `layer`'s attention.

    That layer's o_proj bias writes a large constant along hidden direction 0, and the (untied, damped) LM head
    reads the unigram log-probabilities from that direction: with the layer, perplexity is about that of the
    unigram model (~10^3); with its attention bypassed, the head sees no signal (~5 * 10^4)."""
    model = make_teacher("llama", vocab_size=VOCAB, tie_word_embeddings=False, attention_bias=True)
    counts = torch.bincount(token_stream(splits.calibration, tokenizer), minlength=VOCAB).float() + 0.1
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.bias[0] = 100.0
        model.lm_head.weight.mul_(0.1)
        model.lm_head.weight[:, 0] += (counts / counts.sum()).log() / math.sqrt(model.config.hidden_size)
    return model


def forbid(monkeypatch, teacher):
    """Any teacher forward, perplexity evaluation or calibration from here on fails."""

    def boom(*args, **kwargs):
        raise Forbidden("scored again instead of reading the cache")

    monkeypatch.setattr(teacher, "forward", boom)
    monkeypatch.setattr(ar_mod, "perplexity", boom)
    monkeypatch.setattr(ga_s2_mod, "perplexity", boom)
    monkeypatch.setattr(calibrate_mod, "collect_teacher_stats", boom)


# ----------------------------------------------------------------------------------------------------------
# uniform


@pytest.mark.parametrize("num_layers", [28, 30, 36])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_uniform_rule(num_layers, ratio):
    k = math.floor(Fraction(str(ratio)) * num_layers + Fraction(1, 2))  # round, halves up
    expected = [math.floor(Fraction(i * num_layers, k)) for i in range(k)]  # every (L / K)-th from 0
    keep = uniform_layers(num_layers, ratio)
    assert keep == expected
    assert len(keep) == len(set(keep)) == k >= 1 and keep[0] == 0 and keep[-1] < num_layers
    ctx = SimpleNamespace(num_layers=num_layers)  # uniform reads nothing else
    assert POLICIES["uniform"].make_settings(ratio=ratio).kept(num_layers) == k
    uniform = POLICIES["uniform"]
    assert uniform.implementation(uniform.make_settings(ratio=ratio), ctx).keep_layers == expected


def test_uniform_examples_and_tiny_ratios():
    assert uniform_layers(28, 0.25) == [0, 4, 8, 12, 16, 20, 24]  # Qwen2.5-1.5B at ratio 0.25
    assert uniform_layers(30, 0.25) == [0, 3, 7, 11, 15, 18, 22, 26]  # 7.5 rounds up to 8
    assert len(uniform_layers(30, 0.75)) == 23
    for num_layers in (4, 28, 30, 36):
        for ratio in (0.01, 1e-6):
            assert uniform_layers(num_layers, ratio) == [0]
        assert uniform_layers(num_layers, 1.0) == list(range(num_layers))


# ----------------------------------------------------------------------------------------------------------
# ar


@pytest.mark.parametrize("essential", [1, 3])
def test_ar_keeps_the_layer_whose_attention_is_essential(essential, make_ctx, splits, tokenizer):
    model = teacher_needing_layer(essential, splits, tokenizer)
    ctx = make_ctx(model, "retention=ar", "retention.ratio=0.25")  # K = 1
    selection = select_layers(ctx.settings.retention, ctx)
    assert selection.keep_layers == [essential]
    assert sorted(selection.scores) == list(range(L))
    others = [s for i, s in selection.scores.items() if i != essential]
    assert selection.scores[essential] > 10 * max(others)  # bypassing it costs far more than any other
    assert all(not layer.self_attn._forward_hooks for layer in model.model.layers)  # hooks removed


# ----------------------------------------------------------------------------------------------------------
# ga_s2


def test_ga_s2_calibrates_each_layer_once(make_ctx, teacher, monkeypatch):
    calls = {"calibrate_layers": 0, "phase1": [], "phase2": [], "ppl": 0}
    real = calibrate_mod.calibrate_layers, calibrate_mod.apply_phase1, calibrate_mod.fit_stack, ga_s2_mod.perplexity

    def calibrate_layers(*args, **kwargs):
        calls["calibrate_layers"] += 1
        return real[0](*args, **kwargs)

    def phase1(gdn, *args, **kwargs):
        calls["phase1"].append(gdn.layer_idx)
        return real[1](gdn, *args, **kwargs)

    def phase2(gdns, *args, **kwargs):  # Phase 2 of a stack of layers
        calls["phase2"].extend(gdn.layer_idx for gdn in gdns)
        return real[2](gdns, *args, **kwargs)

    def perplexity(*args, **kwargs):
        calls["ppl"] += 1
        return real[3](*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "calibrate_layers", calibrate_layers)
    monkeypatch.setattr(calibrate_mod, "apply_phase1", phase1)
    monkeypatch.setattr(calibrate_mod, "fit_stack", phase2)
    monkeypatch.setattr(ga_s2_mod, "perplexity", perplexity)

    ctx = make_ctx(teacher, "retention=ga_s2", "init=full", "calibration.cache=true")
    selection = select_layers(ctx.settings.retention, ctx)
    assert calls == {"calibrate_layers": 1, "phase1": list(range(L)), "phase2": list(range(L)), "ppl": L}
    assert len(selection.keep_layers) == len(set(selection.keep_layers)) == num_kept(0.5, L) == 2
    assert set(selection.keep_layers) <= set(range(L)) and sorted(selection.scores) == list(range(L))
    lowest = sorted(range(L), key=lambda i: (selection.scores[i], i))[:2]
    assert selection.keep_layers == sorted(lowest)

    # The run's student then finds every converted layer calibrated already: no second calibration.
    student = build_student(teacher, selection.keep_layers, "whole_head", int(ctx.settings.seed))
    record = init_student(student, ctx.settings.init, ctx)
    assert calls["phase1"] == list(range(L)) and calls["phase2"] == list(range(L))
    assert all(layer["cached"] for layer in record["layers"].values())


def test_ga_s2_probes_equal_students_built_from_the_parts(teacher):
    """The cheap probes (mixers swapped in one student) are the students `build_student` makes."""
    gdns = {i: naive_gdn(teacher, i) for i in range(L)}
    torch.manual_seed(1)
    with torch.no_grad():  # stand-in for an init mode: every layer's GDN differs from its naive start
        for gdn in gdns.values():
            for p in gdn.parameters():
                p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, VOCAB, (2, 24))
    for i, probe in probes(teacher, gdns):
        reference = build_student(teacher, [i])
        for j in range(L):
            if j != i:
                reference.gdn(j).load_state_dict(gdns[j].state_dict())
        assert probe.config.keep_layers == [i] == reference.config.keep_layers
        with torch.no_grad():
            got = probe(input_ids=tokens, use_cache=False).logits
            want = reference(input_ids=tokens, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# The score cache


@pytest.mark.parametrize("policy, init", [("ar", "naive"), ("ga_s2", "naive"), ("ga_s2", "full")])
def test_second_selection_reads_the_cache(policy, init, make_ctx, teacher, monkeypatch, tmp_path):
    ctx = make_ctx(teacher, f"retention={policy}", f"init={init}", "calibration.cache=false")
    first = select_layers(ctx.settings.retention, ctx)
    files = sorted((tmp_path / "cache" / "retention").iterdir())
    assert [f.name.split("-")[0] for f in files] == [policy] and files[0].suffix == ".json"  # no temp files
    record = json.loads(files[0].read_text())
    assert {"teacher", "policy", "settings", "calibration_tokens"} <= set(record["parts"])
    keyed = record["parts"]["settings"]
    assert "retention.ratio" not in keyed and "retention.seq_len" in keyed and "data.split_seed" in keyed
    assert ("init.name" in keyed) == (policy == "ga_s2")  # its probes are initialized students

    forbid(monkeypatch, teacher)
    again = select_layers(ctx.settings.retention, make_ctx(teacher, f"retention={policy}", f"init={init}",
                                                      "calibration.cache=false"))
    assert again == first
    # One scoring serves every ratio.
    wider = make_ctx(teacher, f"retention={policy}", f"init={init}", "retention.ratio=0.75")
    assert select_layers(wider.settings.retention, wider).scores == first.scores
    # The unseen-window report changes no calibrated weight, so it is not part of the key either.
    unchecked = make_ctx(teacher, f"retention={policy}", f"init={init}", "calibration.check=false")
    assert select_layers(unchecked.settings.retention, unchecked).scores == first.scores
    # A scoring setting is part of the key: scoring again (which is forbidden here).
    other = make_ctx(teacher, f"retention={policy}", f"init={init}", "retention.num_windows=3")
    with pytest.raises(Forbidden):
        select_layers(other.settings.retention, other)


def test_the_init_is_part_of_the_key_for_ga_s2_only(make_ctx, teacher, monkeypatch):
    for policy in ("ar", "ga_s2"):
        ctx = make_ctx(teacher, f"retention={policy}", "init=naive")
        select_layers(ctx.settings.retention, ctx)
    forbid(monkeypatch, teacher)
    ar = make_ctx(teacher, "retention=ar", "init=zero_gate")
    select_layers(ar.settings.retention, ar)  # AR does not depend on the init: a hit
    ga = make_ctx(teacher, "retention=ga_s2", "init=zero_gate")
    with pytest.raises(Forbidden):
        select_layers(ga.settings.retention, ga)


def test_cache_false_scores_again_and_writes_nothing(make_ctx, teacher, tmp_path):
    ctx = make_ctx(teacher, "retention=ar", "retention.cache=false")
    select_layers(ctx.settings.retention, ctx)
    assert not (tmp_path / "cache" / "retention").exists()


# ----------------------------------------------------------------------------------------------------------
# The evaluation split


@pytest.mark.parametrize("policy, init", [("ar", "naive"), ("ga_s2", "full")])
def test_selection_reads_only_the_calibration_split(policy, init, make_ctx, teacher, splits):
    ctx = make_ctx(teacher, f"retention={policy}", f"init={init}", "calibration.cache=false")
    select_layers(ctx.settings.retention, ctx)  # ctx.splits.evaluation raises if read
    calibration = {doc.text for doc in splits.calibration}
    assert ctx.tokenizer.texts and set(ctx.tokenizer.texts) <= calibration
    assert not set(ctx.tokenizer.texts) & {doc.text for doc in splits.evaluation}


# ----------------------------------------------------------------------------------------------------------
# Bad input and ratio 1.0


@pytest.mark.parametrize("policy", ["uniform", "ar", "ga_s2"])
@pytest.mark.parametrize("ratio", [0, -0.1, 1.5])
def test_ratio_outside_unit_interval(policy, ratio):
    with pytest.raises(ValueError, match=rf"^retention.ratio={float(ratio)} must lie in \(0, 1\]"):
        compose("teacher=tiny_llama", f"retention={policy}", f"retention.ratio={ratio}")
    retention = SimpleNamespace(name=policy, ratio=ratio)  # settings built without their checks
    ctx = SimpleNamespace(num_layers=L)  # fails before touching teacher, data or cache
    with pytest.raises(ValueError, match=rf"retention.ratio={float(ratio)} must lie in \(0, 1\]"):
        POLICIES[policy].implementation(retention, ctx)


@pytest.mark.parametrize("keep, match", [
    ([0, 4], r"keep_layers \[4\] out of range for a teacher with 4 layers"),
    ([-2, 1], r"keep_layers \[-2\] out of range"),
    ([1, 3, 1], r"keep_layers repeats \[1\]"),
])
def test_explicit_bad_indices(keep, match):
    explicit = POLICIES["explicit"]
    with pytest.raises(ValueError, match=match):
        explicit.implementation(SimpleNamespace(name="explicit", keep=keep), SimpleNamespace(num_layers=L))
    kept = explicit.implementation(explicit.make_settings(keep=[3, 0]), SimpleNamespace(num_layers=L)).keep_layers
    assert kept == [0, 3]


@pytest.mark.parametrize("policy", ["uniform", "ar", "ga_s2"])
def test_ratio_one_keeps_every_layer_and_the_student_is_the_teacher(policy, make_ctx, teacher, monkeypatch):
    ctx = make_ctx(teacher, f"retention={policy}", "retention.ratio=1.0", "init=full")
    monkeypatch.setattr(ar_mod, "perplexity", None)  # nothing to score: K = L
    monkeypatch.setattr(ga_s2_mod, "perplexity", None)
    selection = select_layers(ctx.settings.retention, ctx)
    assert selection.keep_layers == list(range(L))
    student = build_student(teacher, selection.keep_layers)
    assert student.config.gdn_layers == []
    init_student(student, ctx.settings.init, ctx)
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        diff = (student(input_ids=tokens, use_cache=False).logits - teacher(input_ids=tokens, use_cache=False).logits)
    assert diff.abs().max().item() < 1e-4


# ----------------------------------------------------------------------------------------------------------
# The pipeline


@pytest.fixture
def run_cache(tmp_path):
    """A fresh cache folder that still finds the converted SmolLM2 tokenizer of the repo cache."""
    shared = Path(repo_cache_dir()) / "teachers"
    shared.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "teachers").symlink_to(shared.resolve())
    return cache


def test_pipeline_records_the_scores(run_cache, tmp_path):
    cfg = compose(*fast("experiment=smoke", "retention=ar", "init=naive", "save_student=false",
                       f"paths.cache_dir={run_cache}"))
    results = run(cfg, tmp_path / "run")
    scores = {int(k): v for k, v in results["retention_scores"].items()}
    assert sorted(scores) == list(range(L))
    assert results["keep_layers"] == sorted(sorted(scores, key=lambda i: (-scores[i], i))[:2])
    assert json.loads((tmp_path / "run" / "results.json").read_text())["retention_scores"] == results["retention_scores"]
    assert len(list((run_cache / "retention").glob("ar-*.json"))) == 1


def test_pipeline_ratio_one(run_cache, tmp_path):
    cfg = compose(*fast("experiment=smoke", "retention=ga_s2", "retention.ratio=1.0", "init=full",
                       "save_student=false", f"paths.cache_dir={run_cache}"))
    results = run(cfg, tmp_path / "run")
    assert results["keep_layers"] == list(range(L)) and results["retention_scores"] == {}
    for metrics in results["metrics"].values():
        assert math.isclose(metrics["student_ppl"], metrics["teacher_ppl"], rel_tol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# The retention-policy sweep (sweeps/retention_policies.yaml)


def test_retention_sweep_composes():
    cfg = compose_config("+sweep=retention_policies", return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == {"retention": "uniform,ar,ga_s2", "init": "naive,full"}
    assert cfg.teacher.name == "smollm2_135m" and cfg.retention.ratio == 0.5
    assert set(POLICIES.names()) >= {"uniform", "ar", "ga_s2", "explicit"}
