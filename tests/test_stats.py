"""Streaming teacher statistics against attention materialized by the eager implementation."""

import math

import pytest
import torch
from conftest import FAMILIES
from conftest import make_teacher as make_tiny_teacher

from tcal.init.calibration.stats import (
    attn_implementation,
    blockwise_attention,
    collect_teacher_stats,
    register,
)

T, BLOCK, VOCAB = 37, 16, 101


def make_teacher(family, attn="eager"):
    """Three layers of the shared tiny teacher, eager attention for the materialized reference."""
    return make_tiny_teacher(family, attn_implementation=attn, num_hidden_layers=3)


def make_batch(pad=True):
    torch.manual_seed(1)
    ids = torch.randint(VOCAB, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    if pad:
        mask[1, :6] = 0  # left padding
    return ids, mask


@torch.no_grad()
def reference_stats(teacher, ids, mask):
    """Per-layer statistics and tensors from output_attentions=True (eager)."""
    out = teacher.model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    valid = mask.bool()
    pos = torch.arange(T)
    dist = (pos[:, None] - pos[None, :]).float().clamp(min=0.5)
    ref = {}
    for layer, block in enumerate(teacher.model.layers):
        attn = block.self_attn
        probs = out.attentions[layer]  # [B, Hq, T, T]
        x = block.input_layernorm(out.hidden_states[layer])
        v = attn.v_proj(x).view(2, T, -1, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)
        context = (probs @ v).transpose(1, 2)  # [B, T, Hq, dh]
        row_dist = (probs * dist).sum(-1).transpose(1, 2)[valid]  # [valid queries, Hq]
        row_ent = -torch.special.xlogy(probs, probs).sum(-1).transpose(1, 2)[valid]
        ref[layer] = dict(
            mean_distance=row_dist.mean(0).clamp(min=0.5),
            mean_entropy=row_ent.mean(0),
            inputs=x,
            context=context,
            attn_output=attn.o_proj(context.reshape(2, T, -1)),
        )
    return ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pad", [True, False], ids=["left_pad", "no_pad"])
def test_matches_materialized_attention(family, pad):
    teacher = make_teacher(family)
    ids, mask = make_batch(pad)
    ref = reference_stats(teacher, ids, mask)
    got = collect_teacher_stats(teacher, ids, mask if pad else None, block_size=BLOCK)
    valid = mask.bool()
    assert sorted(got) == [0, 1, 2]
    for layer, stats in got.items():
        r = ref[layer]
        assert stats.mean_distance.shape == (4,) and stats.mean_entropy.shape == (4,)
        torch.testing.assert_close(stats.mean_distance, r["mean_distance"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stats.mean_entropy, r["mean_entropy"], atol=1e-5, rtol=1e-5)
        for name in ("inputs", "context", "attn_output"):
            tensor = getattr(stats, name)
            assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            assert tensor.shape == r[name].shape
            torch.testing.assert_close(tensor[valid], r[name][valid], atol=1e-5, rtol=1e-5)
    # the heads must differ, or the test would not catch a head mix-up
    assert got[0].mean_entropy.std() > 1e-2


def test_padding_does_not_change_stats():
    """Averages run over valid queries only: padding a sequence must not change its statistics."""
    teacher = make_teacher("llama")
    ids, _ = make_batch()
    n_pad = 6
    padded = torch.cat([torch.zeros(1, n_pad, dtype=torch.long), ids[:1, : T - n_pad]], dim=1)
    mask = torch.ones(1, T, dtype=torch.long)
    mask[0, :n_pad] = 0
    alone = collect_teacher_stats(teacher, ids[:1, : T - n_pad], block_size=BLOCK, keep_tensors=False)
    left = collect_teacher_stats(teacher, padded, mask, block_size=BLOCK, keep_tensors=False)
    for layer, ref in alone.items():
        torch.testing.assert_close(left[layer].mean_distance, ref.mean_distance, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(left[layer].mean_entropy, ref.mean_entropy, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_unchanged(family):
    teacher = make_teacher(family, attn="sdpa")
    ids, mask = make_batch()
    with torch.no_grad():
        for m in (None, mask):
            default = teacher.model(ids, attention_mask=m).last_hidden_state
            with attn_implementation(teacher, register()):
                streamed = teacher.model(ids, attention_mask=m).last_hidden_state
            valid = torch.ones_like(mask).bool() if m is None else m.bool()
            torch.testing.assert_close(streamed[valid], default[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_restores_attn_implementation(attn):
    teacher = make_teacher("qwen3", attn=attn)
    ids, mask = make_batch()
    collect_teacher_stats(teacher, ids, mask, layers=[1], block_size=BLOCK, keep_tensors=False)
    assert teacher.config._attn_implementation == attn
    with pytest.raises(IndexError):
        collect_teacher_stats(teacher, ids + VOCAB, mask)  # out-of-vocabulary ids fail inside the forward
    assert teacher.config._attn_implementation == attn
    assert teacher.model.config._attn_implementation == attn


def test_layer_subset_and_stats_only():
    teacher = make_teacher("qwen2")
    ids, mask = make_batch()
    full = collect_teacher_stats(teacher, ids, mask, block_size=BLOCK)
    only = collect_teacher_stats(teacher, ids, mask, layers=[2], block_size=7, keep_tensors=False)
    assert list(only) == [2]
    assert only[2].inputs is None and only[2].context is None and only[2].attn_output is None
    torch.testing.assert_close(only[2].mean_distance, full[2].mean_distance, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(only[2].mean_entropy, full[2].mean_entropy, atol=1e-5, rtol=1e-5)


def test_uniform_attention_by_hand():
    """q = 0 makes every score equal: row i attends uniformly to its i + 1 causal keys."""
    n, heads, dh = 11, 2, 3
    q = torch.zeros(1, heads, n, dh)
    k = torch.randn(1, 1, n, dh)
    v = torch.randn(1, 1, n, dh)
    for i in range(n):
        rows = torch.zeros(1, n)
        rows[0, i] = 1
        out, dist_sum, ent_sum, count = blockwise_attention(q, k, v, 0.25, block_size=4, query_mask=rows)
        assert count == 1
        expected_dist = (sum(i - j for j in range(i)) + 0.5) / (i + 1)
        close = dict(atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent_sum, torch.full_like(ent_sum, math.log(i + 1)), **close)
        torch.testing.assert_close(dist_sum, torch.full_like(dist_sum, expected_dist), **close)
        torch.testing.assert_close(out[0, i], v[0, 0, : i + 1].mean(0).expand(heads, dh))


def test_bool_and_additive_masks_agree():
    """Both 4D mask kinds transformers hands to attention functions give the same result."""
    torch.manual_seed(2)
    b, hq, hkv, n, dh = 2, 4, 2, 13, 8
    q, k, v = torch.randn(b, hq, n, dh), torch.randn(b, hkv, n, dh), torch.randn(b, hkv, n, dh)
    keys = torch.ones(b, n, dtype=torch.bool)
    keys[0, :3] = False
    allowed = torch.ones(n, n).tril().bool()[None, None] & keys[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    res_bool = blockwise_attention(q, k, v, 0.3, allowed, block_size=5, query_mask=keys)
    res_add = blockwise_attention(q, k, v, 0.3, additive, block_size=5, query_mask=keys)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = (probs @ v.repeat_interleave(2, 1)).transpose(1, 2)
    for out, dist_sum, ent_sum, count in (res_bool, res_add):
        assert count == keys.sum()
        torch.testing.assert_close(out[keys], ref[keys], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dist_sum, res_bool[1])
        torch.testing.assert_close(ent_sum, res_bool[2])
        assert torch.isfinite(out).all()  # fully masked (padding) rows stay finite
