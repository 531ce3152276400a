"""The `recall` retention policy (docs/method.md, section "Retained-layer policies"): a layer built to copy a token
is ranked first; the score comes from the teacher alone, is deterministic for a probe seed and is cached; the probe
sequences come from the calibration split and never from evaluation text; the keep list's score/fill split; bad
settings fail before work with one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import compose, make_teacher, repo_cache_dir
from test_errors import run_fails

import tcal.data.documents as data_mod
import tcal.init.calibration.calibrate as calibrate_mod
import tcal.student.convert as convert_mod
from tcal.context import RunContext
from tcal.data.documents import load_splits, token_stream
from tcal.data.needles import ANSWER, NEEDLE, QUESTION, TEXT, RetrievalSequences, key_words
from tcal.errors import ConfigError
from tcal.retention import select_layers
from tcal.retention.ar import attention_bypassed
from tcal.retention.probe import earlier_layers_replayed, layer_outputs_recorded, probe_sequences, sequence_losses
from tcal.retention.recall import above_noise, chosen_by_score, keep_list, recall_scores, uniform_fill
from tcal.retention.uniform import uniform_layers
from tcal.teachers.load import load_tokenizer

VOCAB = 49152  # the SmolLM2 tokenizer's
L = 4
DIGIT_LOGIT = 1.0  # the head's weight on the copied digit: a clear signal that leaves the text loss alone
PROBE = ("teacher=tiny_llama", "retention=recall", "retention.seq_len=128", "retention.num_prompts=4",
         "retention.batch_size=4")


class Forbidden(Exception):
    pass


class CalibrationOnly:
    """The splits as selection may see them: reading `evaluation` or `train` fails the test."""

    def __init__(self, calibration):
        self.calibration = calibration

    @property
    def evaluation(self):
        raise Forbidden("the recall probe read the evaluation split")

    @property
    def train(self):
        raise Forbidden("the recall probe read the training split")


class RecordingTokenizer:
    """The real tokenizer, remembering every text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, []
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, text, **kwargs):
        self.texts.extend([text] if isinstance(text, str) else text)
        return self.tokenizer(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self.tokenizer.decode(ids, **kwargs)

    def get_vocab(self):
        return self.tokenizer.get_vocab()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())


@pytest.fixture(scope="module")
def splits():
    return load_splits(compose().data)


@pytest.fixture
def make_ctx(tokenizer, splits, tmp_path):
    def make(teacher, *overrides, cache_dir=None):
        cfg = compose(*PROBE, *overrides)
        return RunContext(cfg, teacher, RecordingTokenizer(tokenizer), CalibrationOnly(splits.calibration),
                          Path(cache_dir or tmp_path / "cache"), tmp_path / "run")

    return make


def copying_teacher(copy_layer: int, tokenizer, seed: int = 0):
    """A tiny Llama whose layer `copy_layer` copies digits out of its context and whose other layers are small random.

    Hidden dims 0..10 of the embeddings are cleared; a digit d gets dim 0 = 1 (a digit marker) and dim 1 + d = 1.
    In the copy layer, head 0's query is a constant (bias) and its key reads the marker, on the head's last
    dimension pair, whose RoPE frequency is negligible under rope_theta = 1e12: every query attends to the digits
    before it, whatever their distance. Its values read the digit one-hot and o_proj writes it to dims 11 + d,
    which the (untied) head reads as digit d's logit. With the layer, an answer digit that appeared in a needle is
    more likely than any other token; without it, it is one token among 49,152. The other layers, and the copy layer
    on ordinary text, change little of either loss."""
    model = make_teacher("llama", seed=seed, vocab_size=VOCAB, tie_word_embeddings=False, attention_bias=True,
                         num_attention_heads=4, num_key_value_heads=4, rope_theta=1e12, initializer_range=0.02)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    head_dim, last = model.config.head_dim, model.config.head_dim // 2 - 1
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, :21] = 0.0
        for d, token in enumerate(digits):
            emb[token, 0] = 1.0
            emb[token, 1 + d] = 1.0
        attn = model.model.layers[copy_layer].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.weight.zero_()
        attn.q_proj.bias[last] = 10.0
        attn.k_proj.weight[last, 0] = 10.0
        for d in range(10):
            attn.v_proj.weight[d, 1 + d] = 1.0
            attn.o_proj.weight[11 + d, d] = 1.0
        model.lm_head.weight[:, 11:21] = 0.0
        for d, token in enumerate(digits):
            model.lm_head.weight[token, 11 + d] = DIGIT_LOGIT
        for i, layer in enumerate(model.model.layers):  # nothing but the copy layer writes the digit dims
            layer.mlp.down_proj.weight[:21] = 0.0
            if i != copy_layer:
                layer.self_attn.o_proj.weight[:21] = 0.0
    assert head_dim == 16
    return model.eval()


# ----------------------------------------------------------------------------------------------------------
# the score


@pytest.mark.parametrize("copy_layer", [1, 2])
def test_the_layer_that_copies_is_ranked_first(copy_layer, make_ctx, tokenizer):
    model = copying_teacher(copy_layer, tokenizer)
    ctx = make_ctx(model, "retention.ratio=0.25", "retention.cache=false")  # K = 1
    selection = select_layers(ctx.settings.retention, ctx)
    assert selection.keep_layers == [copy_layer]
    assert sorted(selection.scores) == list(range(L))
    ranked = sorted(selection.scores, key=lambda i: -selection.scores[i])
    assert ranked[0] == copy_layer and selection.details["rank"][str(copy_layer)] == 1
    details = selection.details
    # without the copy, an answer digit is one token among 49,152 (NLL ~ ln 49152 = 10.8); with it, nats less
    assert details["base_answer_nll"] < math.log(VOCAB) - 2.0
    assert details["answer_rise"][str(copy_layer)] > 2.0
    assert abs(details["text_rise"][str(copy_layer)]) < 0.1
    others = [details["answer_rise"][str(i)] for i in range(L) if i != copy_layer]
    assert max(abs(v) for v in others) < 0.1
    assert all(not layer.self_attn._forward_hooks for layer in model.model.layers)  # hooks removed


def test_the_score_subtracts_the_rise_on_text(make_ctx, tokenizer):
    """The score is the answer-loss rise minus the text-loss rise of the same forward, per layer."""
    model = copying_teacher(2, tokenizer)
    ctx = make_ctx(model, "retention.ratio=0.5", "retention.cache=false")
    selection = select_layers(ctx.settings.retention, ctx)
    d = selection.details
    for i in range(L):
        assert math.isclose(selection.scores[i], d["answer_rise"][str(i)] - d["text_rise"][str(i)], abs_tol=1e-12)
    assert 0 < d["answer_tokens"] < d["text_tokens"]
    assert d["tokens"] == 4 * 128 * (L + 1) and d["seconds"] > 0


def test_the_score_comes_from_the_teacher_alone_and_is_deterministic(make_ctx, tokenizer, monkeypatch):
    """No student is built, no layer calibrated; the same probe seed gives the same scores and sequences, another
    seed other sequences."""
    def boom(*args, **kwargs):
        raise Forbidden("the bypass probe built or calibrated a student")

    monkeypatch.setattr(convert_mod, "build_student", boom)
    monkeypatch.setattr(convert_mod, "naive_gdn", boom)
    monkeypatch.setattr(calibrate_mod, "collect_teacher_stats", boom)
    model = copying_teacher(1, tokenizer)
    first = make_ctx(model, "retention.cache=false", "init=full")
    again = make_ctx(model, "retention.cache=false", "init=naive")
    a, b = (select_layers(c.settings.retention, c) for c in (first, again))
    assert a.scores == b.scores and a.keep_layers == b.keep_layers
    other = make_ctx(model, "retention.cache=false", "retention.probe_seed=1")
    ids0, _ = probe_sequences(first.settings.retention, first)
    ids1, _ = probe_sequences(other.settings.retention, other)
    assert torch.equal(ids0, probe_sequences(again.settings.retention, again)[0])
    assert not torch.equal(ids0, ids1)


def test_probe_sequences_come_from_the_calibration_split_only(make_ctx, tokenizer, splits, monkeypatch, tmp_path):
    """The probe reads the calibration split (its token stream and words), never evaluation documents or eval
    files; every TEXT token is a calibration token in order, and the answer is a value stated in a needle."""
    def boom(*args, **kwargs):
        raise Forbidden("the recall probe read an eval file")

    monkeypatch.setattr(data_mod, "file_documents", boom)
    eval_file = tmp_path / "held_out.txt"
    eval_file.write_text("An evaluation text the probe must never read. " * 40)
    ctx = make_ctx(make_teacher("llama", vocab_size=VOCAB), f"data.eval_files=[{eval_file}]", "retention.cache=false")
    select_layers(ctx.settings.retention, ctx)
    assert not any("evaluation text the probe" in t for t in ctx.tokenizer.texts)
    assert not any(d.text in ctx.tokenizer.texts for d in splits.evaluation)
    ids, labels = probe_sequences(ctx.settings.retention, ctx)
    stream = token_stream(splits.calibration, tokenizer)
    windows = stream.unfold(0, 16, 1)
    words = set(key_words("\n".join(d.text for d in splits.calibration)))
    for row, lab in zip(ids, labels):
        text = row[lab == TEXT]
        assert (windows == text[:16]).all(-1).any()  # a slice of the calibration stream
        needles = tokenizer.decode(row[lab == NEEDLE])
        answer = tokenizer.decode(row[lab == ANSWER])
        assert answer.isdigit() and answer in needles
        question = tokenizer.decode(row[lab == QUESTION])
        present = [w for w in words if w in question]
        assert any(f"{a} {b}" in question for a in present for b in present)  # a key made of the split's words


def test_a_second_selection_reads_the_cache_for_any_ratio_and_fill(make_ctx, tokenizer, monkeypatch, tmp_path):
    model = copying_teacher(1, tokenizer)
    cache = tmp_path / "shared"
    first = make_ctx(model, "retention.ratio=0.5", cache_dir=cache)
    scores = select_layers(first.settings.retention, first).scores
    assert len(list((cache / "retention").glob("recall-*.json"))) == 1

    def boom(*args, **kwargs):
        raise Forbidden("scored again instead of reading the cache")

    monkeypatch.setattr(model, "forward", boom)
    monkeypatch.setattr(model.model, "forward", boom)
    for overrides in (("retention.ratio=0.75",), ("retention.fill=uniform", "retention.scored=1")):
        ctx = make_ctx(model, *overrides, cache_dir=cache)
        assert select_layers(ctx.settings.retention, ctx).scores == scores


# ----------------------------------------------------------------------------------------------------------
# the keep list


@pytest.mark.parametrize("num_layers, k", [(30, 15), (30, 23), (28, 7), (4, 2)])
def test_uniform_fill_without_scored_layers_is_the_uniform_policy(num_layers, k):
    assert uniform_fill([], k, num_layers) == uniform_layers(num_layers, k / num_layers)


@pytest.mark.parametrize("chosen", [[7, 18], [18, 7], [0, 1, 2], [29], [13, 14, 15, 16]])
def test_uniform_fill_keeps_the_chosen_layers_and_k_in_all(chosen):
    keep = uniform_fill(chosen, 15, 30)
    assert len(keep) == len(set(keep)) == 15 and set(chosen) <= set(keep) and keep == sorted(keep)
    untouched = set(uniform_layers(30, 0.5)) - set(keep)
    assert len(untouched) <= len(chosen)  # each chosen layer displaces at most one uniform slot


def test_keep_list_by_score_then_by_text_rise():
    scores = {0: -1.0, 1: -0.5, 2: 3.0, 3: 0.2, 4: 2.0, 5: 0.1}
    se = {i: 0.1 for i in scores}
    text = {0: 2.0, 1: 1.5, 2: 0.0, 3: 0.01, 4: 0.02, 5: 0.03}
    assert chosen_by_score(scores, se, 3, None, 3.0) == [2, 4]  # 0.2 - 3 x 0.1 is not above 0
    assert keep_list([2, 4], text, 3, "text", 6) == [0, 2, 4]
    assert chosen_by_score(scores, se, 3, 3, 3.0) == [2, 4, 3]  # an override ranks, whatever the noise
    assert chosen_by_score(scores, se, 1, None, 3.0) == [2]  # at most K
    assert keep_list([2], text, 3, "text", 6) == [0, 1, 2]
    assert keep_list([], text, 3, "text", 6) == [0, 1, 5]
    assert keep_list([2], text, 3, "uniform", 6) == uniform_fill([2], 3, 6)


# ----------------------------------------------------------------------------------------------------------
# the rule: the layers above the probe's noise


def test_the_rule_chooses_the_copying_layer_alone(make_ctx, tokenizer):
    """K = 2 of 4: the rule scores the layer built to copy and no other; the second kept layer comes from the fill."""
    model = copying_teacher(2, tokenizer)
    ctx = make_ctx(model, "retention.ratio=0.5", "retention.cache=false")
    selection = select_layers(ctx.settings.retention, ctx)
    d = selection.details
    assert d["scored_layers"] == d["above_noise"] == [2] and d["rule"] == "score - 3.0 * se > 0"
    assert 2 in selection.keep_layers and len(selection.keep_layers) == 2
    assert d["sequences"] == 4 and all(d["se"][str(i)] > 0 for i in range(L))
    for i in range(L):
        assert (selection.scores[i] - 3.0 * d["se"][str(i)] > 0) == (i == 2)


def test_the_rule_on_a_teacher_without_a_copying_layer_scores_none_and_is_deterministic(make_ctx, tokenizer):
    """Small random layers: no layer's rise stands out of the spread over the sequences; the same probe seed gives
    the same figures and keep list twice."""
    model = make_teacher("llama", vocab_size=VOCAB)
    runs = [select_layers(c.settings.retention, c)
            for c in (make_ctx(model, "retention.ratio=0.5", "retention.cache=false") for _ in range(2))]
    assert runs[0].details["scored_layers"] == []
    assert runs[0].details == {**runs[1].details, "seconds": runs[0].details["seconds"]}
    assert runs[0].keep_layers == runs[1].keep_layers


@pytest.mark.parametrize("rises, z, chosen", [
    ([2.0, -1.0, 2.0, -1.0], 3.0, False),  # the highest mean (0.5), but inside its spread
    ([2.0, -1.0, 2.0, -1.0], 0.0, True),  # noise_z = 0: any positive mean
    ([0.30, 0.32, 0.28, 0.31], 3.0, True),  # small, but the same in every sequence
    ([0.0, 0.0, 0.0, 0.0], 3.0, False),  # exactly 0 is not above 0
])
def test_a_layer_inside_the_noise_is_never_scored(rises, z, chosen):
    """The rule reads the spread of the layer's own per-sequence rises, not the other layers' scores."""
    base = [[1.0, 3.0]] * 4
    losses = {"base": base, "layers": {"0": [[1.0 + r, 3.0] for r in rises], "1": [[1.1, 3.0]] * 4}}
    figures = recall_scores(losses)
    assert (0 in above_noise(figures["score"], figures["se"], z)) == chosen
    assert 1 in above_noise(figures["score"], figures["se"], z)  # 0.1 in every sequence: no spread, above 0


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_replaying_the_earlier_layers_gives_the_losses_of_a_full_forward(layer, tokenizer, make_ctx):
    """The probe's saving: layers before the changed one return the base forward's outputs instead of computing;
    the losses equal a forward that computes every layer."""
    model = copying_teacher(1, tokenizer)
    ctx = make_ctx(model)
    ids, labels = probe_sequences(ctx.settings.retention, ctx)
    with layer_outputs_recorded(model) as outputs:
        base = sequence_losses(model, ids, labels)
    assert len(outputs) == L and base == sequence_losses(model, ids, labels)
    with attention_bypassed(model, layer):
        full = sequence_losses(model, ids, labels)
        with earlier_layers_replayed(model, outputs, layer):
            replayed = sequence_losses(model, ids, labels)
    assert replayed == full and full != base
    assert all(type(m).__name__ == "LlamaDecoderLayer" for m in model.model.layers)  # restored


# ----------------------------------------------------------------------------------------------------------
# bad settings


@pytest.mark.parametrize("overrides, match", [
    (["retention.probe=attention"], r"^retention.probe='attention'; expected one of bypass, gdn$"),
    (["retention.fill=random"], r"^retention.fill='random'; expected one of text, uniform$"),
    (["retention.scored=-1"], r"^retention.scored=-1; expected null \(the layers above the probe's noise\)"),
    (["retention.scored=3", "retention.ratio=0.5"], r"^retention.scored=3 is more than the 2 layers "
                                                    r"retention.ratio=0.5 keeps of 4$"),
    (["retention.num_prompts=0"], r"^retention.num_prompts=0; expected a positive integer$"),
    (["retention.seq_len=64"], r"^retention.seq_len=64; expected an integer >= 128"),
    (["retention.probe_seed=-2"], r"^retention.probe_seed=-2; expected an integer >= 0$"),
    (["retention.noise_z=-1"], r"^retention.noise_z=-1.0; expected a number >= 0"),
    (["retention.num_prompts=1"], r"^retention.num_prompts=1; expected at least 2 with scored=null"),
    (["retention.seq_len=8192"], r"^retention.seq_len=8192 is beyond the teacher's context of 4096 tokens$"),
])
def test_bad_recall_setting_fails_before_work_on_one_line(overrides, match, compose_cfg, tmp_path):
    err = run_fails(compose_cfg, tmp_path, ConfigError, match, "retention=recall", *overrides)
    assert "\n" not in str(err)


def test_a_wrong_type_fails_while_composing():
    with pytest.raises(Exception, match="scored"):
        compose("retention=recall", "retention.scored=many")


def test_recall_composes_with_its_defaults():
    cfg = compose("retention=recall")
    assert cfg.retention.name == "recall" and cfg.retention.scored is None and cfg.retention.fill == "text"
    assert cfg.retention.num_prompts == 8


def test_the_report_names_each_recall_variant():
    """tcal-report's retrieval table tells the rule from an override and the probe's form, older records included."""
    from tcal.tools.figures import retention_variant

    rule = {"probe": "bypass", "seq_len": 1024, "scored_layers": [16, 18], "fill": "text",
            "rule": "score - 3.0 * se > 0", "scored": None, "noise_z": 3.0}
    assert retention_variant(rule) == "bypass/1024 rule z=3 (16 18) fill=text"
    override = {**rule, "probe": "gdn", "scored": 3, "scored_layers": [4, 16, 18], "rule": "override"}
    assert retention_variant(override) == "gdn/1024 scored=3 (4 16 18) fill=text"
    before_the_rule = {"probe": "bypass", "scored_layers": [16, 18, 19], "fill": "uniform"}
    assert retention_variant(before_the_rule) == "bypass scored=3 (16 18 19) fill=uniform"
    assert retention_variant({"rank": {"0": 1}}) == retention_variant(None) == "-"
