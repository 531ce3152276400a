"""Phase 2 as one fit of a stack of layers (`tcal.init.calibration.phase2`): the stacked forward is each layer's
forward, the clipping is torch's on each layer alone, the fit is the one torch's own pieces make of each layer alone,
a pool source that draws every window each step is the full batch, and on a tiny teacher the batched fits of phase2,
full and full_plus equal the one-layer-at-a-time ones (`calibration.fit=sequential`: stacks of one; weights,
losses, best steps, held-out curves) within float tolerance; a NaN loss stops both naming the same layer and step.

Everything is tiny (hidden 64, 2 x 24 tokens, a dozen steps): the file runs in seconds."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import compose, make_teacher

from tcal.errors import Divergence
from tcal.init.calibration import phase2 as phase2_module
from tcal.init.calibration.calibrate import ArtifactStore, calibrate_layers
from tcal.init.calibration.phase2 import (
    DYNAMICS,
    PROJECTIONS,
    FullBatch,
    LayerBest,
    LayerStack,
    clip_each_layer,
    fit_stack,
)
from tcal.init.calibration.pool import PoolDraws, calibrate_on_pool
from tcal.init.calibration.stats import collect_teacher_stats
from tcal.student.convert import naive_gdn
from tcal.student.gdn import GatedDeltaNet

LAYERS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def teacher():
    return make_teacher("llama", seed=3)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(101, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def pool():
    return SimpleNamespace(fit=torch.randint(101, (6, 16), generator=torch.Generator().manual_seed(0)),
                           held_out=torch.randint(101, (2, 16), generator=torch.Generator().manual_seed(1)))


def calibration_cfg(fit: str, layers_per_fit=None, **phase2):
    """The shipped calibration settings, Phase 2 short and fast-moving: 12 steps (more than one read of the
    losses), learning rates that move the layers, and a gradient clip that every step's gradient exceeds, so each
    layer's own clipping factor shapes its steps."""
    settings = compose("init=full", "calibration.block_size=16").calibration
    phase2 = {"steps": 12, "lr_projections": 1e-2, "lr_dynamics": 3e-2, "grad_clip": 0.05, **phase2}
    return dataclasses.replace(settings, fit=fit, layers_per_fit=layers_per_fit,
                               phase2=dataclasses.replace(settings.phase2, **phase2))


def pool_cfg(**changes):
    return SimpleNamespace(**{"steps": 12, "batch_size": 2, "select_every": 2, "lr_projections": 1e-2,
                              "lr_dynamics": 3e-2, "weight_decay": 0.01, "grad_clip": 0.05, "schedule": "cosine",
                              **changes})


def calibrated(teacher, tokens, cfg, phases, check=None):
    gdns = {i: naive_gdn(teacher, i) for i in LAYERS}
    return gdns, calibrate_layers(teacher, gdns, tokens, cfg, phases, ArtifactStore(None), check)


def on_pool(teacher, pool, phase2, fit: str, fit_size=None, store=None):
    gdns = {i: naive_gdn(teacher, i) for i in LAYERS}
    phase1 = compose("teacher=tiny_llama").calibration.phase1
    records = calibrate_on_pool(teacher, gdns, pool, ["value_scale"], phase1, phase2, {}, store or ArtifactStore(None),
                                0, block_size=8, fit=fit, fit_size=fit_size)
    return gdns, records


def assert_same_layers(first: dict, second: dict, atol: float) -> None:
    for i in first:
        for key, value in first[i].state_dict().items():
            torch.testing.assert_close(second[i].state_dict()[key], value, rtol=0, atol=atol, msg=f"layer {i} {key}")


def assert_close_records(reference, batched, rtol: float = 1e-4) -> None:
    """Records with the same keys, the same integers (steps, token counts) and floats within `rtol`."""
    if isinstance(reference, dict):
        assert reference.keys() == batched.keys()
        for key in reference:
            assert_close_records(reference[key], batched[key], rtol)
    elif isinstance(reference, list):
        assert len(reference) == len(batched)
        for a, b in zip(reference, batched):
            assert_close_records(a, b, rtol)
    elif isinstance(reference, float):
        assert batched == pytest.approx(reference, rel=rtol, abs=1e-7)
    else:
        assert batched == reference


# ------------------------------------------------------------------ the pieces


def test_stack_forward_is_each_layers_forward(teacher):
    gdns = [naive_gdn(teacher, i) for i in LAYERS]
    x = torch.randn(len(gdns), 2, 24, teacher.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = LayerStack(gdns).forward(x)
        for l, gdn in enumerate(gdns):
            torch.testing.assert_close(y[l], gdn(x[l])[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="GDN layers of one shape"):
        LayerStack([gdns[0], GatedDeltaNet(teacher.config.hidden_size, 2, 8)])


def test_a_stack_runs_its_layers_own_kernel(teacher, monkeypatch):
    """The kernel the run chose for its layers (`use_gdn_kernel`) is the one the stacked fit's delta rule runs; layers
    of two runs' kernels are not stacked together."""
    from tcal.student.gdn import use_gdn_kernel

    gdns = [use_gdn_kernel(naive_gdn(teacher, i), "torch") for i in LAYERS]
    asked = []
    real = phase2_module.gated_delta_rule

    def recorded(*args, kernel=None, **kwargs):
        asked.append(kernel)
        return real(*args, kernel=kernel, **kwargs)

    monkeypatch.setattr(phase2_module, "gated_delta_rule", recorded)
    with torch.no_grad():
        LayerStack(gdns).forward(torch.randn(len(gdns), 1, 8, teacher.config.hidden_size))
    assert asked == ["torch"]
    with pytest.raises(ValueError, match="one shape and kernel"):
        LayerStack([gdns[0], use_gdn_kernel(naive_gdn(teacher, LAYERS[1]), "fla")])


def test_clip_each_layer_is_torch_clip_of_each_layer_alone():
    """Three layers' gradients at scales 10, 1e-3 and 0.3 against a clip of 1: each is clipped by its own norm
    (the first scaled down, the second untouched), as `clip_grad_norm_` on that layer's tensors alone."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5, 4), (3, 2), (3, 7)]
    scales = torch.tensor([10.0, 1e-3, 0.3])
    params = []
    for shape in shapes:
        p = torch.zeros(shape, requires_grad=True)
        p.grad = torch.randn(shape, generator=gen) * scales.view(-1, *[1] * (len(shape) - 1))
        params.append(p)
    alone = [[p.grad[l].clone().requires_grad_() for p in params] for l in range(3)]
    for tensors in alone:
        for t in tensors:
            t.grad = t.detach().clone()
        torch.nn.utils.clip_grad_norm_(tensors, 1.0)
    before = [p.grad.clone() for p in params]
    clip_each_layer(params, 1.0)
    for l in range(3):
        for p, t in zip(params, alone[l]):
            torch.testing.assert_close(p.grad[l], t.grad, rtol=1e-6, atol=0)
    assert not torch.allclose(params[0].grad[0], before[0][0])  # clipped
    assert all(torch.equal(p.grad[1], b[1]) for p, b in zip(params, before))  # under the clip: untouched


def teacher_io(teacher, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher-forced inputs and targets of `LAYERS`, stacked [L, B, T, D]."""
    stats = collect_teacher_stats(teacher, tokens, layers=list(LAYERS), block_size=16)
    return tuple(torch.stack([getattr(stats[i], name) for i in LAYERS]) for name in ("inputs", "attn_output"))


def module_fit(gdn: GatedDeltaNet, x: torch.Tensor, target: torch.Tensor, phase2) -> int:
    """Phase 2 of one layer written with torch's own pieces (the GDN module's forward, AdamW unfused,
    `clip_grad_norm_`), the state of its lowest loss kept (offered before each step and after the last); its best
    step."""
    own = dict(gdn.named_parameters())
    params = [own.get(f"{name}.weight", own.get(name)) for name in (*PROJECTIONS, *DYNAMICS)]
    optimizer = torch.optim.AdamW([{"params": params[:3], "lr": phase2.lr_projections},
                                   {"params": params[3:], "lr": phase2.lr_dynamics}], weight_decay=phase2.weight_decay)
    best_loss, best_step, best_state = math.inf, None, None
    for step in range(int(phase2.steps) + 1):
        loss = (gdn(x)[0] - target).pow(2).mean()
        if loss.item() < best_loss:
            best_loss, best_step = loss.item(), step
            best_state = {k: v.detach().clone() for k, v in gdn.state_dict().items()}
        if step < int(phase2.steps):
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, phase2.grad_clip)
            optimizer.step()
    gdn.load_state_dict(best_state)
    return best_step


@pytest.mark.parametrize("lr", [3e-2, 1.0], ids=["falling", "climbing"])
def test_stack_fit_is_each_layers_own_fit(teacher, tokens, lr):
    """Four layers fitted in one stack against each fitted alone by `module_fit`: the same best steps, and the same
    weights within float tolerance while the fit is stable (a learning rate of 1 makes the losses climb, so some
    layer keeps an early state; its chaotic later steps amplify rounding)."""
    x, target = teacher_io(teacher, tokens)
    changes = dict(lr_projections=1e-2, lr_dynamics=3e-2) if lr < 1 else dict(lr_projections=1.0, lr_dynamics=1.0,
                                                                                grad_clip=1.0)
    phase2 = calibration_cfg("batched", steps=8, **changes).phase2
    stacked = [naive_gdn(teacher, i) for i in LAYERS]
    records = fit_stack(stacked, FullBatch(x, target), phase2)
    alone = [naive_gdn(teacher, i) for i in LAYERS]
    best_steps = [module_fit(gdn, x[l], target[l], phase2) for l, gdn in enumerate(alone)]
    assert [r["best_step"] for r in records] == best_steps
    if lr < 1:
        assert_same_layers(dict(enumerate(alone)), dict(enumerate(stacked)), atol=1e-4)
        assert best_steps == [8] * len(LAYERS)  # the losses fell to the end
    else:
        assert min(best_steps) < 8  # the planted climb happened


def test_a_pool_drawing_every_window_each_step_is_the_full_batch(teacher, tokens):
    """A pool source whose minibatch is the whole pool (its windows shuffled), whose held-out windows are the fit
    windows, judged every step, at a constant learning rate, is the full batch: the same layers and best steps
    (the window order changes only the loss's rounding), and its held-out curve is the full batch's fitted losses."""
    x, target = teacher_io(teacher, tokens)
    phase2 = calibration_cfg("batched").phase2
    pool_phase2 = SimpleNamespace(**{k: getattr(phase2, k) for k in ("steps", "lr_projections", "lr_dynamics",
                                                                     "weight_decay", "grad_clip")},
                                  batch_size=x.shape[1], select_every=1, schedule="constant")
    batch = [naive_gdn(teacher, i) for i in LAYERS]
    batch_records = fit_stack(batch, FullBatch(x, target), phase2)
    pool = [naive_gdn(teacher, i) for i in LAYERS]
    generators = [torch.Generator().manual_seed(i) for i in LAYERS]
    pool_records = fit_stack(pool, PoolDraws((x, target), (x, target), pool_phase2, generators), pool_phase2)
    assert_same_layers(dict(enumerate(batch)), dict(enumerate(pool)), atol=1e-5)
    for full, drawn in zip(batch_records, pool_records):
        assert drawn["best_step"] == full["best_step"]
        assert [c[1] for c in drawn["held_out_curve"][:-1]] == pytest.approx(full["losses"], rel=1e-5)
        assert drawn["held_out_loss_after"] == pytest.approx(full["loss_after"], rel=1e-5)


# ------------------------------------------------------------------ batched against one layer at a time


@pytest.mark.parametrize("phases", [("phase2",), ("phase1", "phase2")], ids=["phase2", "full"])
def test_batched_fit_equals_sequential_fit(teacher, tokens, phases):
    check = torch.randint(101, (1, 24), generator=torch.Generator().manual_seed(6))
    reference, reference_records = calibrated(teacher, tokens, calibration_cfg("sequential"), phases, check)
    together, records = calibrated(teacher, tokens, calibration_cfg("batched", len(LAYERS)), phases, check)
    assert_same_layers(reference, together, atol=1e-4)
    assert_close_records(reference_records, records)
    for i in LAYERS:
        losses = records[i]["phase2"]["losses"]
        assert len(losses) == 12 and losses[-1] < losses[0]  # the fit moved every layer


def test_layer_best_keeps_each_layers_lowest_loss():
    """Planted losses for 3 layers over 4 offers and a last one: `LayerBest` keeps for each layer the step and the
    weights of its own lowest loss, the first of equal ones, a NaN never (layer 0: step 1; layer 1: its last offer,
    step 3; layer 2: the settled state)."""
    losses = torch.tensor([[5.0, 3.0, 4.0], [2.0, 2.5, 3.5], [4.0, 2.4, float("nan")], [3.0, 1.0, 3.2]])
    last = torch.tensor([2.5, 1.5, 1.0])
    weights = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(0))  # the weights at each offer
    stacked = weights[0].clone()
    best = LayerBest([stacked])
    for step in range(5):
        stacked.copy_(weights[step])
        if step < 4:
            best.offer(losses[step], step)
        else:
            best.settle(last, step)
    offered = torch.cat([losses, last[None]]).nan_to_num(nan=math.inf)
    expected = [min(range(5), key=lambda step: (offered[step, l].item(), step)) for l in range(3)]
    assert best.step.tolist() == expected == [1, 3, 4]
    for l, step in enumerate(expected):
        assert torch.equal(stacked[l], weights[step, l])


def test_best_step_is_chosen_per_layer(teacher, tokens):
    """A learning rate of 1 makes the losses climb after a few steps: each layer keeps its own lowest-loss state,
    at the same step on both paths (some layer stops before the last step)."""
    cfg = dict(steps=8, lr_projections=1.0, lr_dynamics=1.0, grad_clip=1.0)
    _, reference_records = calibrated(teacher, tokens, calibration_cfg("sequential", **cfg), ("phase2",))
    together, records = calibrated(teacher, tokens, calibration_cfg("batched", len(LAYERS), **cfg), ("phase2",))
    best = {i: records[i]["phase2"]["best_step"] for i in LAYERS}
    assert best == {i: reference_records[i]["phase2"]["best_step"] for i in LAYERS}
    assert min(best.values()) < 8  # the planted climb happened
    for i in LAYERS:
        p2 = records[i]["phase2"]
        assert p2["loss_after"] <= min(p2["losses"]) * (1 + 1e-6)
        if best[i] < 8:
            assert p2["loss_after"] == pytest.approx(p2["losses"][best[i]], rel=1e-5)


def test_batched_pool_fit_equals_sequential(teacher, pool):
    """full_plus: each layer's own minibatches, the cosine schedule, held-out selection every 2 steps."""
    reference, reference_records = on_pool(teacher, pool, pool_cfg(), "sequential")
    together, records = on_pool(teacher, pool, pool_cfg(), "batched", fit_size=len(LAYERS))
    assert_same_layers(reference, together, atol=1e-4)
    assert_close_records(reference_records, records)
    curve = records[0]["phase2"]["held_out_curve"]
    assert [c[0] for c in curve] == [0, 2, 4, 6, 8, 10, 12]
    assert len({records[i]["phase2"]["best_step"] for i in LAYERS}) > 1  # each layer chose its own


def test_which_layers_share_a_stack_changes_only_rounding(teacher, tokens, pool):
    """`calibration.layers_per_fit`: all four layers in one stack, two stacks of two, or one layer at a time give
    the same fits up to float rounding (a layer's tensors sit at other offsets of the stacked ones, so SIMD tails
    round them differently; hence the setting is in the cache key)."""
    runs = [calibrated(teacher, tokens, calibration_cfg("batched", size), ("phase1", "phase2")) for size in (4, 2, 1)]
    pools = [on_pool(teacher, pool, pool_cfg(), "batched", fit_size=size) for size in (4, 1)]
    for (first, first_records), others in ((runs[0], runs[1:]), (pools[0], pools[1:])):
        for gdns, records in others:
            assert_same_layers(first, gdns, atol=1e-6)
            assert_close_records(first_records, records, rtol=1e-6)


# ------------------------------------------------------------------ divergence


def nan_for_layer(real, layer: int, from_call: int, of_layers):
    """`real` (a loss function), except that layer `layer`'s loss is NaN from its `from_call`-th call on;
    `of_layers(args)` names the layers a call computes, in the order of its losses."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        losses = real(*args, **kwargs)
        layers = of_layers(args)
        if layer in layers:
            calls["n"] += 1
            if calls["n"] >= from_call:
                poison = torch.tensor([float("nan") if i == layer else 0.0 for i in layers], dtype=losses.dtype)
                return losses + poison.reshape(losses.shape)
        return losses

    return wrapped


@pytest.mark.parametrize("fit", ["batched", "sequential"])
@pytest.mark.parametrize("mode", ["full", "full_plus"])
def test_nan_loss_names_the_layer_and_its_first_bad_step(fit, mode, teacher, tokens, pool, tmp_path, monkeypatch):
    """Layer 2's loss is NaN from its 4th step (step 3) on. The fit reads its losses every 10 steps and still names
    step 3; the other layers (fitted beside it) are not named. Nothing of a failed stack of all four is cached; one
    layer after another, the layers done before layer 2 (0 and 1) are."""
    of_layers = lambda args: [g.layer_idx for g in args[0].gdns]  # noqa: E731
    monkeypatch.setattr(phase2_module, "stack_losses", nan_for_layer(phase2_module.stack_losses, 2, 4, of_layers))
    store = ArtifactStore(tmp_path / "cache")
    tokens_per_step = 2 * 24 if mode == "full" else 2 * 16
    with pytest.raises(Divergence, match=rf"^phase 2: alignment loss of layer 2 is nan at step 3 "
                                         rf"\({tokens_per_step} calibration tokens\); stopping$"):
        if mode == "full":
            gdns = {i: naive_gdn(teacher, i) for i in LAYERS}
            calibrate_layers(teacher, gdns, tokens, calibration_cfg(fit, len(LAYERS)), ("phase1", "phase2"), store)
        else:
            on_pool(teacher, pool, pool_cfg(), fit, fit_size=len(LAYERS), store=store)
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == (0 if fit == "batched" else 2)
