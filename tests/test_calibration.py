"""Taylor-Calibrate (docs/method.md, section "Init modes"): each Phase 1 rule against hand-computed values,
Phase 2's alignment and best-state restore, the init modes against each other, the artifact cache, and padding.

Everything is tiny (hidden 16-64, a few dozen tokens, a handful of Phase 2 steps), so the file runs in seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import compose, isolated_cache_dir, make_teacher

from tcal.data.documents import token_stream
from tcal.init import apply_init, init_student
from tcal.init.calibration import calibrate as calibrate_module
from tcal.init.calibration.phase2 import DYNAMICS, PROJECTIONS, FullBatch, LayerStack, fit_stack
from tcal.init.calibration.calibrate import (
    ArtifactStore,
    artifact_key,
    calibrate_layers,
    calibration_batch,
    check_batch,
)
from tcal.init.calibration.phase1 import (
    apply_phase1,
    decay_rates,
    inverse_softplus,
    ols_value_scale,
    output_gate_alpha,
    rescale_write_gate,
    write_targets,
)
from tcal.init.calibration.stats import LayerStats, blockwise_attention, collect_teacher_stats
from tcal.store.fingerprint import plain
from tcal.student.alignment import alignment_loss_value
from tcal.student.convert import build_student, naive_gdn
from tcal.student.gdn import GatedDeltaNet

LN2 = math.log(2.0)
PHASE1_PARAMS = ("A_log", "dt_bias", "b_proj.weight", "v_proj.weight", "g_proj.weight")


def calibration_cfg(**phase2):
    """The shipped calibration settings (`tcal init=full`), with small Phase 2 / block settings for tests."""
    settings = compose("init=full", "calibration.block_size=16").calibration
    return dataclasses.replace(settings, phase2=dataclasses.replace(settings.phase2, **{"steps": 4, **phase2}))


def init_cfg(mode: str):
    """The shipped init settings of `tcal init=<mode>`."""
    return compose(f"init={mode}").init


def uniform_closed_form(t_len: int) -> tuple[float, float]:
    """Row i attends uniformly to its i+1 causal keys: distance (sum_{j<i}(i-j) + 0.5)/(i+1) = i/2 + 0.5/(i+1),
    entropy log(i+1). Averaged over i = 0..T-1: (T-1)/4 + harmonic(T)/(2T) and log(T!)/T."""
    harmonic = sum(1.0 / n for n in range(1, t_len + 1))
    return (t_len - 1) / 4 + harmonic / (2 * t_len), math.lgamma(t_len + 1) / t_len


def tiny_gdn(seed=0, hidden=16, heads=2, head_dim=8) -> GatedDeltaNet:
    torch.manual_seed(seed)
    return GatedDeltaNet(hidden, heads, head_dim)


@pytest.fixture(scope="module")
def teacher():
    """A private tiny llama (the calibration code memoizes a fingerprint on it); vocab 101."""
    return make_teacher("llama", seed=3)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(101, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A RunContext like `pipeline.prepare` builds: tiny llama with the SmolLM2 vocabulary, Shakespeare splits."""
    from tcal.data.documents import load_splits
    from tcal.context import RunContext
    from tcal.teachers.load import load_tokenizer

    root = tmp_path_factory.mktemp("calib_ctx")
    cache = isolated_cache_dir(root / "cache")
    cfg = compose("teacher=tiny_llama", f"paths.cache_dir={cache}", "calibration.seq_len=32",
                  "calibration.batch_size=2", "calibration.phase2.steps=5", "calibration.block_size=16")
    tokenizer = load_tokenizer(cfg.teacher, cfg.paths.cache_dir)
    return RunContext(cfg, make_teacher("llama", seed=1, vocab_size=49152), tokenizer,
                      load_splits(cfg.data), Path(cache), root / "run")


# ------------------------------------------------------------------ 1. statistics of uniform attention


@pytest.mark.parametrize("t_len,block", [(1, 4), (9, 4), (16, 16), (23, 5)])
def test_uniform_attention_distance_and_entropy(t_len, block):
    """q = 0 makes every score 0: row i is uniform over its i+1 keys (GQA and query blocks included)."""
    torch.manual_seed(0)
    q = torch.zeros(2, 4, t_len, 8)
    k, v = torch.randn(2, 2, t_len, 8), torch.randn(2, 2, t_len, 8)
    out, dist_sum, ent_sum, count = blockwise_attention(q, k, v, 8**-0.5, block_size=block)
    distance, entropy = uniform_closed_form(t_len)
    assert float(count) == 2 * t_len
    torch.testing.assert_close(dist_sum / count, torch.full((4,), distance, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_sum / count, torch.full((4,), entropy, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    # the output is the running mean of the (KV-head expanded) values
    v_q = v.repeat_interleave(2, dim=1)
    running_mean = v_q.cumsum(2) / torch.arange(1, t_len + 1)[:, None]
    torch.testing.assert_close(out, running_mean.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_uniform_attention_layer_stats_from_teacher():
    """LayerStats level: zeroing Wq of one teacher layer makes its attention uniform; collect_teacher_stats
    reports the closed-form d_h and H_h for every head of that layer, and not for the others."""
    t_len = 13
    teacher = make_teacher("llama", seed=2)
    with torch.no_grad():
        teacher.model.layers[1].self_attn.q_proj.weight.zero_()
    ids = torch.randint(101, (2, t_len), generator=torch.Generator().manual_seed(0))
    stats = collect_teacher_stats(teacher, ids, layers=[0, 1], block_size=4)
    distance, entropy = uniform_closed_form(t_len)
    torch.testing.assert_close(stats[1].mean_distance, torch.full((4,), distance), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[1].mean_entropy, torch.full((4,), entropy), rtol=1e-5, atol=1e-5)
    # layer 0 is peaked (initializer_range 0.2): less entropy than uniform on every head
    assert (stats[0].mean_entropy < entropy - 1e-3).all()


# ------------------------------------------------------------------ 2. write targets from entropy


def test_one_hot_head_gets_concentration_one():
    """A real one-hot head (each query attends only to itself) has entropy 0 and distance 0.5; next to a
    uniform head it gets c = 1, beta* = 0.7, the uniform head c = 0, beta* = 0.3."""
    t_len = 8
    eye = 30.0 * torch.eye(t_len)  # key j = query j, orthogonal to the others: scores 900 * scaling on the diagonal
    q = torch.stack([eye, torch.zeros(t_len, t_len)])[None]  # head 0 one-hot, head 1 uniform
    k = torch.stack([eye, torch.randn(t_len, t_len)])[None]
    v = torch.randn(1, 2, t_len, t_len)
    _, dist_sum, ent_sum, count = blockwise_attention(q, k, v, t_len**-0.5, block_size=3)
    distance, entropy = uniform_closed_form(t_len)
    torch.testing.assert_close(ent_sum / count, torch.tensor([0.0, entropy], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(dist_sum / count, torch.tensor([0.5, distance], dtype=torch.float64), atol=1e-6, rtol=0)
    concentration, beta = write_targets((ent_sum / count).float())
    torch.testing.assert_close(concentration, torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(beta, torch.tensor([0.7, 0.3]), atol=1e-6, rtol=0)


def test_write_targets_linear_in_entropy():
    entropy = torch.tensor([0.0, 2.0, 0.5, 1.5])
    concentration, beta = write_targets(entropy, beta_low=0.3, beta_span=0.4)
    torch.testing.assert_close(concentration, torch.tensor([1.0, 0.0, 0.75, 0.25]))
    torch.testing.assert_close(beta, torch.tensor([0.7, 0.3, 0.6, 0.4]))
    # the minimum need not be zero: only the spread within the layer matters
    c_shift, _ = write_targets(entropy + 3.0)
    torch.testing.assert_close(c_shift, concentration)


def test_write_targets_equal_entropies_no_nan():
    concentration, beta = write_targets(torch.full((3,), 1.2))
    assert torch.isfinite(concentration).all() and torch.isfinite(beta).all()
    torch.testing.assert_close(concentration, torch.ones(3))
    torch.testing.assert_close(beta, torch.full((3,), 0.7))
    # a spread below min_spread = 1e-3 is divided by 1e-3, not by itself
    concentration, beta = write_targets(torch.tensor([1.0, 1.0005]), min_spread=1e-3)
    torch.testing.assert_close(concentration, torch.tensor([1.0, 0.5]), atol=1e-4, rtol=0)
    torch.testing.assert_close(beta, torch.tensor([0.7, 0.5]), atol=1e-4, rtol=0)


# ------------------------------------------------------------------ 3. decay from d_h


def test_decay_rates_and_inverse_softplus():
    distance = torch.tensor([0.5, 1.0, 7.0, 100.0, 0.1, 1e4])
    gamma = decay_rates(distance, 1e-3, 5.0)
    expected = torch.tensor([2 * LN2, LN2, LN2 / 7, LN2 / 100, 5.0, 1e-3])  # the last two clipped
    torch.testing.assert_close(gamma, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(F.softplus(inverse_softplus(gamma.double())), gamma.double(), rtol=1e-9, atol=1e-12)
    # stable for tiny rates (log(expm1) form): softplus^-1(1e-6) = log(expm1(1e-6)) ~ log(1e-6)
    tiny = inverse_softplus(torch.tensor([1e-6], dtype=torch.float64))
    torch.testing.assert_close(tiny, torch.tensor([math.log(math.expm1(1e-6))], dtype=torch.float64))


def synthetic_stats(gdn, distance, entropy, batch=2, t_len=10, seed=0) -> LayerStats:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, t_len, gdn.hidden_size, generator=gen)
    context = torch.randn(batch, t_len, gdn.num_heads, gdn.head_dim, generator=gen)
    return LayerStats(torch.tensor(distance), torch.tensor(entropy), x, context, None)


def test_apply_phase1_half_life_is_d_h():
    """A_log = 0, softplus(dt_bias) = ln2/d_h, so with a_proj x = 0 a state decays by half in d_h tokens;
    heads with tiny / huge d_h sit at the gamma bounds."""
    gdn = tiny_gdn(heads=4, head_dim=4)
    distance = [1.5, 6.0, 0.1, 1e5]
    stats = synthetic_stats(gdn, distance, [0.2, 1.0, 0.6, 0.4])
    apply_phase1(gdn, stats, calibration_cfg().phase1)
    assert torch.equal(gdn.A_log.detach(), torch.zeros(4))
    torch.testing.assert_close(F.softplus(gdn.dt_bias.detach().double()),
                               torch.tensor([LN2 / 1.5, LN2 / 6.0, 5.0, 1e-3], dtype=torch.float64), rtol=1e-6, atol=0)
    with torch.no_grad():
        gdn.a_proj.weight.zero_()
        g, _ = gdn.gates(stats.inputs)  # [B, T, H]
    per_token = g.exp()
    torch.testing.assert_close(per_token[..., :2] ** torch.tensor(distance[:2]), torch.full_like(per_token[..., :2], 0.5),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(per_token[..., 2], torch.full_like(per_token[..., 2], math.exp(-5.0)), rtol=1e-5, atol=0)
    torch.testing.assert_close(per_token[..., 3], torch.full_like(per_token[..., 3], math.exp(-1e-3)), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ 4. write gate rescale


def test_rescale_write_gate_hand_matrix():
    weight = torch.tensor([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, -0.5, 0.5], [2.0, 0.0, 0.0, -2.0]])
    beta = torch.tensor([0.7, 0.5, 0.3])
    out = rescale_write_gate(weight, beta)
    logit = math.log(0.7 / 0.3)  # = -logit(0.3); logit(0.5) = 0
    # row h: (logit_h / sqrt(4)) / mean|W_h| * W_h with mean|W| = 2.5, 0.5, 1.0
    expected = torch.tensor([
        [1.0, -2.0, 3.0, -4.0],
        [0.0, 0.0, 0.0, 0.0],
        [-2.0, 0.0, 0.0, 2.0],
    ]) * torch.tensor([logit / 2 / 2.5, 0.0, logit / 2 / 1.0])[:, None]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.abs().mean(1), torch.tensor([logit / 2, 0.0, logit / 2]), rtol=1e-6, atol=1e-7)
    # sign of the logit applied: the beta* < 0.5 row is flipped
    assert torch.equal(torch.sign(out[2]), -torch.sign(weight[2]))


def test_apply_phase1_write_gate_rows():
    """Through apply_phase1: row h of Wb has mean |.| = |logit(beta*_h)| / sqrt(D), same or flipped sign."""
    gdn = tiny_gdn(heads=4, head_dim=4)
    before = gdn.b_proj.weight.detach().clone()
    record = apply_phase1(gdn, synthetic_stats(gdn, [3.0] * 4, [0.0, 2.0, 0.5, 1.5]), calibration_cfg().phase1)
    beta = torch.tensor([0.7, 0.3, 0.6, 0.4])
    torch.testing.assert_close(torch.tensor(record["beta_target"]), beta)
    logit = torch.log(beta / (1 - beta))
    after = gdn.b_proj.weight.detach()
    torch.testing.assert_close(after.abs().mean(1), logit.abs() / math.sqrt(16), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.sign(after), torch.sign(before) * torch.sign(logit)[:, None])


# ------------------------------------------------------------------ 5. OLS value scale


def test_ols_recovers_planted_sigma():
    gen = torch.Generator().manual_seed(0)
    output = torch.randn(3, 20, 4, 8, generator=gen)
    sigma = torch.tensor([0.5, 2.0, 3.0, 7.0])
    context = sigma[:, None] * output
    torch.testing.assert_close(ols_value_scale(context, output), sigma, rtol=1e-6, atol=0)  # exact without noise
    noisy = context + 1e-2 * torch.randn(context.shape, generator=gen)
    torch.testing.assert_close(ols_value_scale(noisy, output), sigma, rtol=0, atol=2e-3)
    # the extremes are clipped to [0.1, 10]; an anti-correlated head goes to the floor
    extreme = torch.tensor([0.01, 50.0, -3.0, 1.0])[:, None] * output
    torch.testing.assert_close(ols_value_scale(extreme, output, 0.1, 10.0), torch.tensor([0.1, 10.0, 0.1, 1.0]))


@pytest.mark.parametrize("query_scale, expected", [(True, [2.0, 8.0]), (False, [0.5, 2.0])])
def test_apply_phase1_value_fit_recurrence(query_scale, expected):
    """The context is planted as [2, 8] x the calibrated layer's real output (1/sqrt(dk) = 1/4 included).
    The real recurrence recovers [2, 8]; the reference's hand loop, without 1/sqrt(dk), sees a 4x larger
    output and fits a 4x smaller sigma."""
    naive = tiny_gdn(head_dim=16)
    stats = synthetic_stats(naive, [2.0, 4.0], [0.3, 0.9])
    probe, cfg = copy.deepcopy(naive), calibration_cfg().phase1
    cfg.sigma_min = cfg.sigma_max = 1.0
    apply_phase1(probe, stats, cfg)  # the decay and write gate of Phase 1, Wv untouched
    with torch.no_grad():
        real_output = probe.mix(stats.inputs)[0]
    planted = LayerStats(stats.mean_distance, stats.mean_entropy, stats.inputs,
                         torch.tensor([2.0, 8.0])[:, None] * real_output, None)
    cfg = calibration_cfg().phase1
    cfg.value_fit_query_scale = query_scale
    record = apply_phase1(copy.deepcopy(naive), planted, cfg)
    torch.testing.assert_close(torch.tensor(record["sigma"]), torch.tensor(expected), rtol=1e-5, atol=0)


# ------------------------------------------------------------------ 6. output gate alpha


def test_output_gate_alpha_formula():
    # RMS of a constant tensor is |constant|: 0.01 * 3 / 0.5
    assert output_gate_alpha(torch.full((2, 5, 3, 4), 3.0), torch.full((2, 5, 3, 4), -0.5)) == pytest.approx(0.06, rel=1e-12)
    # RMS([3, 4]) = sqrt(12.5); RMS([1, -1, 1, -1]) = 1; damping 0.1
    alpha = output_gate_alpha(torch.tensor([3.0, 4.0]), torch.tensor([1.0, -1.0, 1.0, -1.0]), damping=0.1)
    assert alpha == pytest.approx(0.1 * math.sqrt(12.5), rel=1e-12)
    assert math.isfinite(output_gate_alpha(torch.ones(4), torch.zeros(4)))


def test_apply_phase1_output_gate_is_alpha_times_scaled_wv():
    gdn = tiny_gdn()
    stats = synthetic_stats(gdn, [2.0, 4.0], [0.3, 0.9])
    record = apply_phase1(gdn, stats, calibration_cfg().phase1)
    act = F.silu(gdn.v_proj(stats.inputs)).detach()  # Wv after the OLS scale
    rms = lambda t: t.double().pow(2).mean().sqrt().item()  # noqa: E731
    assert record["alpha"] == pytest.approx(0.01 * rms(stats.context) / rms(act), rel=1e-5)
    torch.testing.assert_close(gdn.g_proj.weight.detach(), record["alpha"] * gdn.v_proj.weight.detach())


# ------------------------------------------------------------------ 7. Phase 2


def test_parameter_groups_freeze_wo_and_norm():
    """q/k/v at the small learning rate, the dynamics at the large one, each the layer's own weights; Wo and the
    output norm in no group."""
    gdn = tiny_gdn()
    stack = LayerStack([gdn])
    groups = stack.groups(1e-4, 1e-3)
    assert [g["lr"] for g in groups] == [1e-4, 1e-3]
    own = dict(gdn.named_parameters())
    for group, names in zip(groups, (PROJECTIONS, DYNAMICS)):
        assert len(group["params"]) == len(names)
        for p, name in zip(group["params"], names):
            torch.testing.assert_close(p[0], own.get(f"{name}.weight", own.get(name)).detach(), rtol=0, atol=0)
    trained = {id(p) for g in groups for p in g["params"]}
    assert id(stack.o_proj) not in trained and id(stack.o_norm) not in trained
    assert set(DYNAMICS) == {"a_proj", "b_proj", "g_proj", "A_log", "dt_bias"}


def layer_data(teacher, tokens, layer):
    stats = collect_teacher_stats(teacher, tokens, layers=[layer], block_size=16)[layer]
    return stats.inputs, stats.attn_output


def fit_one(gdn, x, target, phase2) -> dict:
    """Phase 2 of one layer on the full batch: a stack of one."""
    return fit_stack([gdn], FullBatch(x[None], target[None]), phase2)[0]


def test_phase2_restores_lowest_loss_state(teacher, tokens, monkeypatch):
    """Planted: an AdamW that wrecks the parameters from its 4th step on. The loss falls for 3 steps, then
    jumps; the fit must return the state after step 3 (exactly the weights after 3 optimizer steps), never worse
    than before. Also: AdamW's settings, the gradient clip, Wo / o_norm frozen, requires_grad as it was."""
    x, target = layer_data(teacher, tokens, 2)
    gdn = naive_gdn(teacher, 2)
    frozen_before = {k: v.clone() for k, v in gdn.state_dict().items() if k.startswith(("o_proj", "o_norm"))}
    gdn.o_proj.weight.requires_grad_(False)  # an unusual pattern that must come back as it was
    gdn.A_log.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in gdn.named_parameters()}

    seen = {"weights": []}

    class Sabotaged(torch.optim.AdamW):
        def __init__(self, groups, **kwargs):
            super().__init__(groups, **kwargs)
            seen["kwargs"], seen["lrs"], seen["norms"], self.calls = kwargs, [g["lr"] for g in groups], [], 0

        @torch.no_grad()
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            seen["norms"].append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item())
            super().step(closure)
            self.calls += 1
            if self.calls >= 4:
                for p in params:
                    p.add_(torch.randn_like(p))
            seen["weights"].append([p.detach().clone() for p in params])

    monkeypatch.setattr(torch.optim, "AdamW", Sabotaged)
    cfg = calibration_cfg(steps=6, lr_projections=1e-3, lr_dynamics=1e-2).phase2
    record = fit_one(gdn, x, target, cfg)

    losses = record["losses"]
    assert len(losses) == 6
    assert losses[1] < losses[0] and losses[2] < losses[1] and losses[3] < losses[2]  # real progress first
    assert min(losses[4:]) > losses[3]  # then the planted damage
    assert record["best_step"] == 3
    assert record["loss_after"] == pytest.approx(losses[3], rel=1e-6)
    assert record["loss_after"] <= record["loss_before"]
    assert record["loss_before"] == pytest.approx(losses[0], rel=1e-6)
    assert alignment_loss_value(gdn, x, target) == pytest.approx(min(losses), rel=1e-6)
    kept = dict(zip((*PROJECTIONS, *DYNAMICS), seen["weights"][2]))  # the weights after 3 steps
    own = dict(gdn.named_parameters())
    for name, value in kept.items():
        assert torch.equal(own.get(f"{name}.weight", own.get(name)).detach(), value[0]), name
    assert seen["kwargs"] == {"weight_decay": 0.01, "fused": True} and seen["lrs"] == [1e-3, 1e-2]
    assert max(seen["norms"]) <= cfg.grad_clip * (1 + 1e-5)
    assert all(torch.equal(gdn.state_dict()[k], v) for k, v in frozen_before.items())
    assert {n: p.requires_grad for n, p in gdn.named_parameters()} == flags


def test_phase2_huge_learning_rate_never_worse(teacher, tokens):
    """A learning rate of 1 makes AdamW diverge: the result is the best recorded state, never worse than the start."""
    x, target = layer_data(teacher, tokens, 1)
    gdn = naive_gdn(teacher, 1)
    record = fit_one(gdn, x, target, calibration_cfg(steps=5, lr_projections=1.0, lr_dynamics=1.0).phase2)
    assert max(record["losses"]) > record["losses"][0]  # the planted divergence happened
    assert record["loss_after"] == pytest.approx(min(record["losses"]), rel=1e-6)
    assert record["losses"][record["best_step"]] == min(record["losses"])
    assert record["loss_after"] <= record["loss_before"] * (1 + 1e-6)
    assert all(p.requires_grad for p in gdn.parameters())


def test_phase2_lowers_every_layer_loss(teacher, tokens):
    gdns = {i: naive_gdn(teacher, i) for i in range(4)}
    frozen = {i: {k: v.clone() for k, v in g.state_dict().items() if k.startswith(("o_proj", "o_norm"))}
              for i, g in gdns.items()}
    records = calibrate_layers(teacher, gdns, tokens, calibration_cfg(steps=4), ("phase2",), ArtifactStore(None))
    assert sorted(records) == [0, 1, 2, 3]
    for i, record in records.items():
        p2 = record["phase2"]
        assert p2["loss_after"] < p2["loss_before"], (i, p2)
        assert p2["cosine_after"] > p2["cosine_before"], (i, p2)
        assert "phase1" not in record and record["cached"] is False
        assert all(torch.equal(gdns[i].state_dict()[k], v) for k, v in frozen[i].items())


# ------------------------------------------------------------------ 8-9. init modes against each other


def test_phase1_changes_only_its_parameters(ctx):
    naive = build_student(ctx.teacher, [0])
    student = build_student(ctx.teacher, [0])
    result = init_student(student, init_cfg("phase1"), ctx)
    assert result["phases"] == ["phase1"] and sorted(result["layers"]) == ["1", "2", "3"]
    allowed = {f"model.layers.{i}.self_attn.{name}" for i in (1, 2, 3) for name in PHASE1_PARAMS}
    reference, calibrated = naive.state_dict(), student.state_dict()
    assert reference.keys() == calibrated.keys()
    assert allowed <= reference.keys()
    for key, value in reference.items():
        if key in allowed:
            assert not torch.equal(value, calibrated[key]), f"phase1 did not set {key}"
        else:
            assert torch.equal(value, calibrated[key]), f"phase1 changed {key}"
    for i in (1, 2, 3):
        assert torch.equal(student.gdn(i).A_log.detach(), torch.zeros(4))


def test_full_equals_phase2_after_phase1(ctx):
    full = build_student(ctx.teacher, [0])
    result = init_student(full, init_cfg("full"), ctx)
    assert result["phases"] == ["phase1", "phase2"]
    assert all(not r["cached"] for r in result["layers"].values())

    stepwise = build_student(ctx.teacher, [0])
    gdns = {i: stepwise.gdn(i) for i in (1, 2, 3)}
    cfg = ctx.settings.calibration
    batch = calibration_batch(ctx, cfg)
    assert result["calibration_tokens"] == batch.numel() == 64
    p1 = calibrate_layers(ctx.teacher, gdns, batch, cfg, ("phase1",), ArtifactStore(None))
    p2 = calibrate_layers(ctx.teacher, gdns, batch, cfg, ("phase2",), ArtifactStore(None))

    for key, value in full.state_dict().items():
        torch.testing.assert_close(stepwise.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)
    for i in (1, 2, 3):
        record = result["layers"][str(i)]
        assert record["phase1"] == p1[i]["phase1"]
        torch.testing.assert_close(torch.tensor(record["phase2"]["losses"]), torch.tensor(p2[i]["phase2"]["losses"]))
        assert record["phase2"]["loss_after"] < record["phase2"]["loss_before"]
    # and Phase 2 really moved the phase1 parameters (the comparison is not trivial)
    phase1_only = build_student(ctx.teacher, [0])
    init_student(phase1_only, init_cfg("phase1"), ctx)
    assert not torch.equal(phase1_only.gdn(1).q_proj.weight, full.gdn(1).q_proj.weight)


# ------------------------------------------------------------------ 10. artifact cache


def test_artifact_cache_reuses_layers(teacher, tokens, tmp_path, monkeypatch):
    cfg = calibration_cfg(steps=3)
    store = ArtifactStore(tmp_path / "artifacts")
    first = {i: naive_gdn(teacher, i) for i in (1, 2)}
    computed = calibrate_layers(teacher, first, tokens, cfg, ("phase1", "phase2"), store)
    assert all(r["cached"] is False for r in computed.values())
    assert len(list((tmp_path / "artifacts").glob("*.safetensors"))) == 2

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran although every layer is cached")

    monkeypatch.setattr(calibrate_module, "collect_teacher_stats", no_teacher)
    second = {i: naive_gdn(teacher, i) for i in (1, 2)}
    loaded = calibrate_layers(teacher, second, tokens, cfg, ("phase1", "phase2"), store)
    for i in (1, 2):
        assert loaded[i]["cached"] is True
        assert {k: v for k, v in loaded[i].items() if k != "cached"} == {k: v for k, v in computed[i].items() if k != "cached"}
        for key, value in first[i].state_dict().items():
            assert torch.equal(second[i].state_dict()[key], value), key

    # a layer missing from the store is the only one computed
    asked = []
    real = collect_teacher_stats
    monkeypatch.setattr(calibrate_module, "collect_teacher_stats",
                        lambda t, b, layers, block_size: asked.append(list(layers)) or real(t, b, layers=layers, block_size=block_size))
    third = {i: naive_gdn(teacher, i) for i in (1, 2, 3)}
    mixed = calibrate_layers(teacher, third, tokens, cfg, ("phase1", "phase2"), store)
    assert asked == [[3]]
    assert [mixed[i]["cached"] for i in (1, 2, 3)] == [True, True, False]


def test_artifact_key_depends_on_every_input(teacher, tokens):
    settings = plain(calibration_cfg(steps=3))
    naive = naive_gdn(teacher, 1)
    key = artifact_key(teacher, 1, ("phase1", "phase2"), tokens, settings, naive)
    assert key == artifact_key(teacher, 1, ("phase1", "phase2"), tokens.clone(), copy.deepcopy(settings), naive_gdn(teacher, 1))
    other_tokens = tokens.clone()
    other_tokens[0, 0] = (other_tokens[0, 0] + 1) % 101
    more_steps = copy.deepcopy(settings)
    more_steps["phase2"]["steps"] = 4
    other_sigma = copy.deepcopy(settings)
    other_sigma["phase1"]["sigma_max"] = 5.0
    variants = [
        artifact_key(teacher, 1, ("phase1", "phase2"), other_tokens, settings, naive),
        artifact_key(teacher, 1, ("phase1", "phase2"), tokens, more_steps, naive),
        artifact_key(teacher, 1, ("phase1", "phase2"), tokens, other_sigma, naive),
        artifact_key(teacher, 2, ("phase1", "phase2"), tokens, settings, naive),
        artifact_key(teacher, 1, ("phase2",), tokens, settings, naive),
        artifact_key(teacher, 1, ("phase1", "phase2"), tokens, settings, naive_gdn(teacher, 1, seed=1)),
        artifact_key(teacher, 1, ("phase1", "phase2"), tokens, settings, naive_gdn(teacher, 1, gqa_expansion="row_repeat")),
        artifact_key(make_teacher("llama", seed=4), 1, ("phase1", "phase2"), tokens, settings, naive),
        artifact_key(teacher, 1, ("phase1", "phase2"), tokens, settings, naive, check=other_tokens),
    ]
    assert len({key, *variants}) == len(variants) + 1


def test_check_tokens_measure_every_layer_on_unseen_windows(teacher, tokens):
    """With check tokens, each record holds the layer's alignment loss and cosine on them before the init
    (the naive layer) and after it, equal to a direct computation; calibration itself is unchanged."""
    check = torch.randint(101, (1, 24), generator=torch.Generator().manual_seed(6))
    cfg = calibration_cfg(steps=3)
    with_check = {i: naive_gdn(teacher, i) for i in (1, 2)}
    records = calibrate_layers(teacher, with_check, tokens, cfg, ("phase1", "phase2"), ArtifactStore(None), check)
    plain_run = {i: naive_gdn(teacher, i) for i in (1, 2)}
    plain_records = calibrate_layers(teacher, plain_run, tokens, cfg, ("phase1", "phase2"), ArtifactStore(None))
    stats = collect_teacher_stats(teacher, check, layers=[1, 2], block_size=16)
    for i in (1, 2):
        assert "check" not in plain_records[i]
        assert records[i]["phase2"]["losses"] == plain_records[i]["phase2"]["losses"]
        y_before = naive_gdn(teacher, i)(stats[i].inputs)[0]
        y_after = with_check[i](stats[i].inputs)[0]
        target = stats[i].attn_output
        got = records[i]["check"]
        assert got["tokens"] == 24
        assert got["loss_before"] == pytest.approx(F.mse_loss(y_before, target).item(), rel=1e-5)
        assert got["loss_after"] == pytest.approx(F.mse_loss(y_after, target).item(), rel=1e-5)
        assert got["cosine_after"] == pytest.approx(F.cosine_similarity(y_after, target, dim=-1).mean().item(), rel=1e-5)
        assert got["loss_after"] != pytest.approx(got["loss_before"], rel=1e-3)


def test_run_records_check_on_windows_between_calibration_windows(ctx):
    cfg = ctx.settings.calibration
    batch, check = calibration_batch(ctx, cfg), check_batch(ctx, cfg)
    assert check.shape == (1, 32)  # batch_size - 1 windows
    assert not any(torch.equal(check[0], row) for row in batch)
    student = build_student(ctx.teacher, [0])
    result = init_student(student, init_cfg("phase1"), ctx)
    assert all(r["check"]["tokens"] == 32 for r in result["layers"].values())
    off = copy.deepcopy(cfg)
    off.check = False
    assert check_batch(ctx, off) is None
    tight = copy.deepcopy(cfg)
    tight.seq_len = int(0.4 * token_stream(ctx.splits.calibration, ctx.tokenizer).numel())  # 2 fit, 3 do not
    with pytest.raises(ValueError, match=r"calibration.check: no room between 2 windows .* set calibration.check=false"):
        check_batch(ctx, tight)


# ------------------------------------------------------------------ 11. gate baselines


def test_zero_and_small_gate(teacher):
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0))
    naive = naive_gdn(teacher, 1)
    gdns = {1: naive_gdn(teacher, 1)}
    assert apply_init(gdns, init_cfg("zero_gate"), None) == {}
    assert torch.equal(gdns[1].g_proj.weight.detach(), torch.zeros(64, 64))
    with torch.no_grad():
        assert torch.equal(gdns[1](x)[0], torch.zeros(2, 7, 64))
        assert naive(x)[0].abs().max() > 0

    gdns = {1: naive_gdn(teacher, 1), 2: naive_gdn(teacher, 2)}
    assert apply_init(gdns, init_cfg("small_gate"), None) == {"gate_scale": 0.02}
    for i, gdn in gdns.items():
        reference = naive_gdn(teacher, i)
        for key, value in reference.state_dict().items():
            expected = value * 0.02 if key == "g_proj.weight" else value
            assert torch.equal(gdn.state_dict()[key], expected), key


# ------------------------------------------------------------------ 12. padding


def test_apply_phase1_ignores_padding():
    """Sequence 0 right-padded by 3 tokens, sequence 1 left-padded by 4, padding filled with garbage: sigma,
    alpha, Wv and Wg equal a reference computed on the valid tokens alone (each sequence's valid tokens run
    unpadded through the calibrated recurrence)."""
    t_len, right, left = 12, 3, 4
    naive = tiny_gdn(seed=1)
    cfg = calibration_cfg().phase1
    cfg.value_fit_query_scale = True  # the planted sigma is on the recurrence with fla's 1/sqrt(dk)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, t_len, 16, generator=gen)
    distance, entropy = torch.tensor([2.0, 5.0]), torch.tensor([0.4, 1.1])
    mask = torch.ones(2, t_len, dtype=torch.long)
    mask[0, t_len - right:] = 0
    mask[1, :left] = 0
    x[~mask.bool()] = 1e3  # garbage at the padded positions

    ref = copy.deepcopy(naive)
    with torch.no_grad():
        ref.A_log.zero_()
        ref.dt_bias.copy_(inverse_softplus(decay_rates(distance).double()).float())
        ref.b_proj.weight.copy_(rescale_write_gate(ref.b_proj.weight, write_targets(entropy)[1]))
        # [valid tokens, H, dh], in the order of x[mask.bool()]
        o_valid = torch.cat([ref.mix(x[0:1, :t_len - right])[0][0], ref.mix(x[1:2, left:])[0][0]])
    if not cfg.value_fit_query_scale:
        o_valid = o_valid * math.sqrt(8)  # the reference's recurrence, without fla's 1/sqrt(dk)
    planted = torch.tensor([2.0, 0.5])
    ctx_valid = planted[:, None] * o_valid + 1e-3 * o_valid.std() * torch.randn(o_valid.shape, generator=gen)
    context = torch.full((2, t_len, 2, 8), 1e3)
    context[mask.bool()] = ctx_valid

    gdn = copy.deepcopy(naive)
    record = apply_phase1(gdn, LayerStats(distance, entropy, x, context, None), cfg, mask=mask)

    x_valid = x[mask.bool()]
    sigma = ((ctx_valid * o_valid).sum((0, 2)) / (o_valid * o_valid).sum((0, 2))).clamp(0.1, 10.0)
    torch.testing.assert_close(torch.tensor(record["sigma"]), sigma, rtol=1e-5, atol=0)
    torch.testing.assert_close(sigma, planted, rtol=0, atol=1e-2)  # the planted scale is recovered
    with torch.no_grad():
        ref.v_proj.weight.mul_(sigma.repeat_interleave(8)[:, None])
        act = F.silu(ref.v_proj(x_valid))
    alpha = 0.01 * ctx_valid.pow(2).mean().sqrt() / act.pow(2).mean().sqrt()
    assert record["alpha"] == pytest.approx(alpha.item(), rel=1e-5)
    torch.testing.assert_close(gdn.v_proj.weight, ref.v_proj.weight, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gdn.g_proj.weight, alpha * ref.v_proj.weight, rtol=1e-5, atol=1e-9)
    for name in ("A_log", "dt_bias", "b_proj.weight"):
        assert torch.equal(gdn.state_dict()[name], ref.state_dict()[name]), name

    # without the mask the garbage leaks in: the mask is what makes the difference
    unmasked = apply_phase1(copy.deepcopy(naive), LayerStats(distance, entropy, x, context, None), cfg)
    assert unmasked["sigma"] != pytest.approx(record["sigma"], rel=1e-2)
    assert unmasked["alpha"] != pytest.approx(record["alpha"], rel=1e-2)
