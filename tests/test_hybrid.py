"""The hybrid student: equality with its teacher when nothing is converted, cached generation, the HF round trip,
and the naive conversion's weights (GQA head mapping, dropped parameters, seeded new parameters)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, TINY_VOCAB, make_teacher
from transformers import AutoConfig, AutoModelForCausalLM

from tcal.student.convert import build_student, expand_kv, layer_generator
from tcal.student.gdn import GatedDeltaNet
from tcal.student.hybrid import KV_RESERVE, LINEAR, GrowingKVLayer, HybridConfig, HybridForCausalLM

TOL = 1e-4
PAD, EOS = 0, 2
# Prompts are padded with an ordinary token: the teachers' pad id 0 has a zero embedding (padding_idx), which
# would let a model that ignores the mask pass; a real token at masked positions must be ignored through the mask.
FILL = 57
GDN_PARAMS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "a_proj.weight", "b_proj.weight",
              "A_log", "dt_bias", "o_norm.weight", "o_proj.weight"}


def tokens(batch, length, seed=0):
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, use_cache=False, **kwargs).logits


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------------------
# Student vs teacher


def test_all_layers_kept_equals_teacher(tiny_teachers, family):
    teacher = tiny_teachers[family]
    student = build_student(teacher, list(range(4)))
    assert isinstance(student, HybridForCausalLM)
    assert student.config.gdn_layers == [] and student.config.keep_layers == [0, 1, 2, 3]
    ids = tokens(2, 40)
    diff = max_diff(logits(student, ids), logits(teacher, ids))
    assert diff < TOL, f"{family}: student with every layer kept differs from the teacher by {diff:.3g}"


def test_some_layers_converted(tiny_teachers, family):
    teacher = tiny_teachers[family]
    student = build_student(teacher, [0, 2])
    assert student.config.layer_types == ["full_attention", LINEAR, "full_attention", LINEAR]
    assert isinstance(student.gdn(1), GatedDeltaNet) and isinstance(student.gdn(3), GatedDeltaNet)
    assert not isinstance(student.model.layers[0].self_attn, GatedDeltaNet)
    ids = tokens(2, 40)
    out, ref = logits(student, ids), logits(teacher, ids)
    assert torch.isfinite(out).all()
    assert max_diff(out, ref) > 1e-2
    # Everything outside the converted attention modules is the teacher's, unchanged.
    teacher_state = teacher.state_dict()
    for name, value in student.state_dict().items():
        if ".self_attn." in name and int(name.split(".")[2]) in (1, 3):
            continue
        assert torch.equal(value, teacher_state[name]), name
    # The teacher itself is untouched by the conversion.
    assert torch.equal(logits(teacher, ids), ref)


def test_student_runs_with_padding_mask(tiny_teachers):
    """A left-padded row gives the same logits at its valid positions as the row alone."""
    student = build_student(tiny_teachers["llama"], [1])
    short, long = tokens(1, 6, seed=1), tokens(1, 11, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 5), FILL), short], 1), long])
    mask = (torch.arange(11) >= torch.tensor([[5], [0]])).long()
    out = logits(student, batch, attention_mask=mask)
    assert max_diff(out[0, 5:], logits(student, short)[0]) < TOL
    assert max_diff(out[1], logits(student, long)[0]) < TOL


# ----------------------------------------------------------------------------------------------------------
# Cache and generation


def greedy_reference(model, ids, steps):
    """Greedy decoding by full forwards without a cache; stops after EOS like generate()."""
    ids = ids.clone()
    new = []
    for _ in range(steps):
        nxt = logits(model, ids)[:, -1].argmax(-1)
        new.append(int(nxt))
        ids = torch.cat([ids, nxt[:, None]], 1)
        if new[-1] == EOS:
            break
    return new


def generated(model, ids, steps=8, with_scores=False, **kwargs):
    """Greedy new tokens from generate() (with the cache), and optionally the logits of each step [B, n, V]."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=PAD,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    new = out.sequences[:, ids.shape[1]:]
    return (new, torch.stack(out.logits, 1)) if with_scores else new


def assert_same_tokens(new, reference):
    new = new.tolist()
    assert new[:len(reference)] == reference
    assert all(t == PAD for t in new[len(reference):]), "tokens after EOS must be padding"


@pytest.fixture(scope="module")
def hybrid_student():
    return build_student(make_teacher("llama"), [0, 2])


def test_generate_with_cache_matches_full_forwards(hybrid_student):
    ids = tokens(1, 9, seed=3)
    lengths = []
    hook = hybrid_student.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        new = generated(hybrid_student, ids)
    finally:
        hook.remove()
    assert lengths[0] == 9 and set(lengths[1:]) == {1}, f"generate did not decode from the cache: {lengths}"
    assert_same_tokens(new[0], greedy_reference(hybrid_student, ids, 8))


def test_generate_left_padded_batch(hybrid_student):
    prompts = [tokens(1, 5, seed=4), tokens(1, 9, seed=5)]
    T = max(p.shape[1] for p in prompts)
    batch = torch.cat([F.pad(p, (T - p.shape[1], 0), value=FILL) for p in prompts])
    mask = torch.cat([F.pad(torch.ones_like(p), (T - p.shape[1], 0)) for p in prompts])
    new, scores = generated(hybrid_student, batch, with_scores=True, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        alone, alone_scores = generated(hybrid_student, prompt, with_scores=True)
        assert_same_tokens(new[row], alone[0].tolist())
        steps = alone_scores.shape[1]
        assert max_diff(scores[row, :steps], alone_scores[0]) < TOL, f"prompt {row}: batched logits differ"
        assert_same_tokens(alone[0], greedy_reference(hybrid_student, prompt, 8))


@pytest.mark.parametrize("prefill", [1, 20, 70])
def test_cached_step_logits_equal_full_forward(tiny_teachers, family, prefill):
    student = build_student(tiny_teachers[family], [1])
    ids = tokens(2, prefill + 4, seed=6)
    full = logits(student, ids)
    with torch.no_grad():
        out = student(ids[:, :prefill], use_cache=True)
        cache = out.cache
        assert cache is not None
        pieces = [out.logits]
        for t in range(prefill, prefill + 2):  # two single-token steps
            pieces.append(student(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
        pieces.append(student(ids[:, prefill + 2:], cache=cache, use_cache=True).logits)  # a two-token chunk
    diff = max_diff(torch.cat(pieces, 1), full)
    assert diff < TOL, f"{family}: cached logits differ from the full forward by {diff:.3g}"


def test_kept_layers_append_in_place_past_a_reallocation(tiny_teachers):
    """Decoding writes each position into the kept layers' buffers (one buffer until it is full, then one more),
    with the full forward's logits."""
    student = build_student(tiny_teachers["llama"], [0, 2])
    prefill, total = 10, 10 + KV_RESERVE + 12
    ids = tokens(2, total, seed=7)
    full = logits(student, ids)
    buffers = set()
    with torch.no_grad():
        out = student(ids[:, :prefill], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        assert [type(layer) for layer in cache.layers][::2] == [GrowingKVLayer, GrowingKVLayer]
        for t in range(prefill, total):
            pieces.append(student(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
            buffers.add(cache.layers[0].keys.data_ptr())
    assert len(buffers) == 2
    assert cache.get_seq_length() == total
    assert max_diff(torch.cat(pieces, 1), full) < TOL


def test_reordered_cache_keeps_decoding_like_the_full_forward(tiny_teachers):
    """Beam search's reorder replaces the cached tensors: the next step notices and writes into a new buffer."""
    student = build_student(tiny_teachers["llama"], [0, 2])
    ids = tokens(2, 13, seed=8)
    with torch.no_grad():
        cache = student(ids[:, :12], use_cache=True).cache
        cache.reorder_cache(torch.tensor([1, 0]))
        step = student(ids[[1, 0], 12:], cache=cache, use_cache=True).logits
    assert max_diff(step, logits(student, ids[[1, 0]])[:, -1:]) < TOL


def test_cache_with_autograd_concatenates(tiny_teachers):
    """With gradients recorded, the kept layers concatenate (no buffer written after its views were saved for
    backward). All layers kept: a GDN state in transformers' cache is itself overwritten in place."""
    student = build_student(tiny_teachers["llama"], [0, 1, 2, 3]).train()
    ids = tokens(1, 9, seed=9)
    out = student(ids[:, :8], use_cache=True)
    step = student(ids[:, 8:], cache=out.cache, use_cache=True)
    (out.logits.square().mean() + step.logits.square().mean()).backward()
    assert student.model.layers[0].self_attn.q_proj.weight.grad is not None


# ----------------------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_round_trip(family, tied, tmp_path):
    teacher = make_teacher(family, tie_word_embeddings=tied)
    student = build_student(teacher, [0, 3])
    ids = tokens(2, 30)
    before = logits(student, ids)
    student.save_pretrained(tmp_path / "student")
    config = AutoConfig.from_pretrained(tmp_path / "student")
    assert isinstance(config, HybridConfig) and config.layer_types == student.config.layer_types
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert type(loaded) is HybridForCausalLM
    assert loaded.config.keep_layers == [0, 3] and loaded.config.gdn_layers == [1, 2]
    assert loaded.config.teacher_config.model_type == family
    assert torch.equal(logits(loaded.eval(), ids), before)
    for model in (student, loaded):
        same = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert same == tied, f"tie_word_embeddings={tied} but lm_head and embeddings shared={same}"
    if not tied:
        assert torch.equal(loaded.lm_head.weight, teacher.lm_head.weight)


# ----------------------------------------------------------------------------------------------------------
# Conversion weights


@pytest.mark.parametrize("query_heads", [4, 6])
def test_query_head_reads_kv_head_i_div_g(query_heads):
    kv_heads, dh = 2, 16
    group = query_heads // kv_heads
    teacher = make_teacher("llama", hidden_size=16 * query_heads, num_attention_heads=query_heads,
                           num_key_value_heads=kv_heads, head_dim=dh)
    student = build_student(teacher, [0])
    for layer in (1, 2, 3):
        attn, gdn = teacher.model.layers[layer].self_attn, student.gdn(layer)
        assert torch.equal(gdn.q_proj.weight, attn.q_proj.weight)
        assert torch.equal(gdn.o_proj.weight, attn.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            src = getattr(attn, name).weight.view(kv_heads, dh, -1)
            dst = getattr(gdn, name).weight.view(query_heads, dh, -1)
            for head in range(query_heads):
                assert torch.equal(dst[head], src[head // group]), f"layer {layer} {name} head {head}"

    row = build_student(teacher, [0], gqa_expansion="row_repeat")
    k = teacher.model.layers[1].self_attn.k_proj.weight
    assert torch.equal(row.gdn(1).k_proj.weight, k.repeat_interleave(group, 0))
    assert not torch.equal(row.gdn(1).k_proj.weight, student.gdn(1).k_proj.weight)
    assert torch.equal(expand_kv(k, kv_heads, query_heads, dh, "row_repeat"), k.repeat_interleave(group, 0))
    with pytest.raises(ValueError, match="bogus"):
        build_student(teacher, [0], gqa_expansion="bogus")


def test_whole_head_expansion_is_a_gqa_attention():
    """Query head i of the GDN sees the same keys as the teacher's query head i (attention scores agree)."""
    teacher = make_teacher("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    attn = teacher.model.layers[1].self_attn
    gdn = build_student(teacher, [0]).gdn(1)
    x = torch.randn(5, 96)
    with torch.no_grad():
        k_teacher = attn.k_proj(x).view(5, 2, 16).repeat_interleave(3, dim=1)  # transformers' repeat_kv
        k_student = gdn.k_proj(x).view(5, 6, 16)
    assert torch.equal(k_student, k_teacher)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_dropped_teacher_parameters(family):
    teacher = make_teacher(family)
    student = build_student(teacher, [0])
    teacher_attn = {name for name, _ in teacher.model.layers[1].self_attn.named_parameters()}
    dropped = {"qwen2": {"q_proj.bias", "k_proj.bias", "v_proj.bias"},
               "qwen3": {"q_norm.weight", "k_norm.weight"}}[family]
    assert dropped <= teacher_attn
    for layer in (1, 2, 3):
        assert {name for name, _ in student.gdn(layer).named_parameters()} == GDN_PARAMS
    kept = {name for name, _ in student.model.layers[0].self_attn.named_parameters()}
    assert dropped <= kept  # the kept layer keeps them
    out = logits(student, tokens(1, 20))
    assert torch.isfinite(out).all()


def test_new_parameters_at_fla_defaults(tiny_teachers, family):
    student = build_student(tiny_teachers[family], [0])
    for layer in (1, 2, 3):
        gdn = student.gdn(layer)
        A = gdn.A_log.exp()
        assert ((A > 0) & (A <= 16)).all()
        dt = F.softplus(gdn.dt_bias)
        assert ((dt >= 1e-4 - 1e-9) & (dt <= 0.1 + 1e-6)).all(), dt
        assert torch.equal(gdn.o_norm.weight, torch.ones_like(gdn.o_norm.weight))
        bound = 1 / math.sqrt(64)
        for proj in (gdn.a_proj, gdn.b_proj, gdn.g_proj):
            assert proj.weight.abs().max() <= bound and proj.weight.std() > bound / 4
    # Heads get different dynamics.
    assert student.gdn(1).A_log.unique().numel() == 4


def test_seeded_and_layer_independent(tiny_teachers):
    teacher = tiny_teachers["llama"]

    def gdn_state(student, layer):
        return {k: v.clone() for k, v in student.gdn(layer).state_dict().items()}

    a, b = build_student(teacher, [0], seed=0), build_student(teacher, [0], seed=0)
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    other_seed = build_student(teacher, [0], seed=1)
    assert not torch.equal(other_seed.gdn(1).A_log, a.gdn(1).A_log)
    assert not torch.equal(other_seed.gdn(1).g_proj.weight, a.gdn(1).g_proj.weight)

    # Layer 1's naive init does not depend on which other layers are converted, nor on the global RNG.
    torch.manual_seed(123)
    fewer = build_student(teacher, [0, 2, 3], seed=0)
    torch.manual_seed(456)
    more = build_student(teacher, [3], seed=0)
    for name, value in gdn_state(a, 1).items():
        assert torch.equal(value, gdn_state(fewer, 1)[name]), name
        assert torch.equal(value, gdn_state(more, 1)[name]), name
    assert not torch.equal(a.gdn(1).A_log, a.gdn(2).A_log)  # but layers differ from each other
    g1, g2 = layer_generator(0, 1), layer_generator(0, 1)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_student_dtype_follows_teacher():
    teacher = make_teacher("llama").to(torch.bfloat16)
    student = build_student(teacher, [0, 2])
    assert {p.dtype for p in student.parameters()} == {torch.bfloat16}
    out = logits(student, tokens(1, 20))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def _student_built_at_random_then_overwritten(teacher, keep_layers, seed=0):
    """The construction the meta-device build replaced: a randomly initialized float32 student cast to the
    teacher's dtype, the teacher's state loaded into it by copy, the converted layers filled in place."""
    from tcal.student.convert import convert_layer, hybrid_config, take_buffers
    from tcal.teachers import adapter_for

    adapter = adapter_for(teacher.config)
    config = hybrid_config(teacher.config, keep_layers)
    student = HybridForCausalLM(config).to(next(teacher.parameters()).dtype)
    take_buffers(student, teacher)
    converted = tuple(f"model.layers.{i}.self_attn." for i in config.gdn_layers)
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if not k.startswith(converted)},
                            strict=False)
    for i in config.gdn_layers:
        convert_layer(student.gdn(i), adapter.attention(teacher, i), adapter, teacher.config, "whole_head",
                      layer_generator(seed, i))
    student.tie_weights()
    return student.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_meta_build_equals_random_init_then_copy_and_owns_its_weights(family, tied, dtype):
    teacher = make_teacher(family, tie_word_embeddings=tied).to(dtype)
    reference = _student_built_at_random_then_overwritten(teacher, [0, 2], seed=3)
    rng = torch.get_rng_state()
    student = build_student(teacher, [0, 2], seed=3)
    assert torch.equal(torch.get_rng_state(), rng), "building the student drew from the global RNG"
    ours, theirs = student.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype and torch.equal(value, theirs[name]), name
    reference_buffers = dict(reference.named_buffers())
    for name, value in student.named_buffers():
        assert value.dtype == reference_buffers[name].dtype and torch.equal(value, reference_buffers[name]), name
    same = student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()
    assert same == tied
    teacher_storages = {t.untyped_storage().data_ptr() for t in teacher.state_dict().values()}
    shared = [n for n, t in student.state_dict().items() if t.untyped_storage().data_ptr() in teacher_storages]
    assert not shared, f"student tensors share the teacher's storage: {shared[:3]}"
    assert all(p.requires_grad for p in student.parameters())
    ids = tokens(2, 24)
    assert torch.equal(logits(student, ids), logits(reference, ids))


def test_bfloat16_student_keeps_the_teachers_float32_rope_and_equals_it():
    """A teacher loaded in bfloat16 keeps its RoPE frequencies in float32 (transformers does); the student's
    `.to(bfloat16)` must not round them, or an all-kept student would not be its teacher."""
    config = make_teacher("llama", rope_theta=500000.0).config
    teacher = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    assert teacher.model.rotary_emb.inv_freq.dtype == torch.float32
    student = build_student(teacher, list(range(4)))
    assert torch.equal(student.model.rotary_emb.inv_freq, teacher.model.rotary_emb.inv_freq)
    ids = tokens(1, 40)
    assert torch.equal(logits(student, ids), logits(teacher, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_flow_through_the_student(tiny_teachers, family):
    student = build_student(tiny_teachers[family], [0, 2]).train()
    ids = tokens(2, 30)
    out = student(ids, labels=ids, use_cache=False)
    out.loss.backward()
    for layer in (1, 3):
        for name, p in student.gdn(layer).named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"layer {layer} {name}"
