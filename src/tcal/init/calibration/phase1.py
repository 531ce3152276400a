"""Phase 1 of Taylor-Calibrate: closed-form GDN dynamics from teacher attention statistics (docs/method.md,
section "Phase 1").

Each rule is a small function on tensors, so tests can check it against hand-computed values;
`apply_phase1` runs them in order on one GDN layer.
"""

from __future__ import annotations

import math

import torch

from tcal.init.calibration.stats import LayerStats
from tcal.settings.init import Phase1Settings
from tcal.student.alignment import valid_tokens
from tcal.student.gdn import GatedDeltaNet


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """softplus^-1(y) = y + log(-expm1(-y)), stable for small y."""
    return y + torch.log(-torch.expm1(-y))


def decay_rates(mean_distance: torch.Tensor, gamma_min: float = 1e-3, gamma_max: float = 5.0) -> torch.Tensor:
    """gamma_h = clip(ln 2 / d_h): with A = 1 and a_proj x ~ 0 the state's half-life is d_h tokens."""
    return (math.log(2.0) / mean_distance.double()).clamp(gamma_min, gamma_max).float()


def write_targets(mean_entropy: torch.Tensor, beta_low: float = 0.3, beta_span: float = 0.4,
                  min_spread: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(concentration c_h, target beta*_h): focused heads (low entropy within the layer) write harder."""
    spread = max(float(mean_entropy.max() - mean_entropy.min()), min_spread)
    concentration = 1.0 - (mean_entropy - mean_entropy.min()) / spread
    return concentration, beta_low + beta_span * concentration


def rescale_write_gate(weight: torch.Tensor, beta_target: torch.Tensor) -> torch.Tensor:
    """Wb[h] <- (logit(beta*_h) / sqrt(D)) * Wb[h] / mean|Wb[h]|."""
    logit = torch.log(beta_target / (1.0 - beta_target))
    scale = logit / math.sqrt(weight.shape[1]) / weight.abs().mean(dim=1)
    return weight * scale[:, None].to(weight.dtype)


def ols_value_scale(context: torch.Tensor, output: torch.Tensor, low: float = 0.1, high: float = 10.0) -> torch.Tensor:
    """sigma_h = sum <ctx_h, o_h> / sum |o_h|^2 over tokens, clipped: the least-squares gain mapping the GDN's
    pre-norm output onto the teacher's context. context, output: [..., H, dh] -> [H]."""
    heads = context.shape[-2]
    ctx, out = context.reshape(-1, heads, context.shape[-1]).double(), output.reshape(-1, heads, output.shape[-1]).double()
    sigma = (ctx * out).sum(dim=(0, 2)) / (out * out).sum(dim=(0, 2)).clamp_min(1e-12)
    return sigma.clamp(low, high).float()


def rms(t: torch.Tensor) -> float:
    """Root mean square; 0 for no elements (an all-padding batch), not NaN."""
    return float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0


def output_gate_alpha(context: torch.Tensor, value_activation: torch.Tensor, damping: float = 0.01) -> float:
    """alpha = damping * RMS(ctx) / RMS(silu(Wv x)): Wg <- alpha Wv starts the output gate small but aligned."""
    return damping * rms(context) / max(rms(value_activation), 1e-12)


@torch.no_grad()
def set_decay(gdn: GatedDeltaNet, stats: LayerStats, phase1: Phase1Settings, mask=None) -> dict:
    """Rule 2: A_log <- 0, dt_bias <- softplus^-1(gamma_h), so the state's half-life is d_h tokens."""
    gamma = decay_rates(stats.mean_distance, phase1.gamma_min, phase1.gamma_max)
    gdn.A_log.zero_()
    gdn.dt_bias.copy_(inverse_softplus(gamma.double()).to(gdn.A_log))
    return {"mean_distance": stats.mean_distance.tolist(), "gamma": gamma.tolist()}


@torch.no_grad()
def set_write_gate(gdn: GatedDeltaNet, stats: LayerStats, phase1: Phase1Settings, mask=None) -> dict:
    """Rule 3: rows of Wb rescaled so that focused heads write harder."""
    concentration, beta_target = write_targets(stats.mean_entropy, phase1.beta_low, phase1.beta_span)
    gdn.b_proj.weight.copy_(rescale_write_gate(gdn.b_proj.weight.float(), beta_target))
    return {"mean_entropy": stats.mean_entropy.tolist(), "concentration": concentration.tolist(),
            "beta_target": beta_target.tolist()}


def _layer_inputs(gdn: GatedDeltaNet, stats: LayerStats) -> torch.Tensor:
    return stats.inputs.to(gdn.A_log.device, gdn.q_proj.weight.dtype)


@torch.no_grad()
def set_value_scale(gdn: GatedDeltaNet, stats: LayerStats, phase1: Phase1Settings, mask=None) -> dict:
    """Rule 4: Wv rows of head h *= sigma_h, the OLS gain of the current recurrence onto the teacher context."""
    o, _ = gdn.mix(_layer_inputs(gdn, stats), mask)
    if not phase1.value_fit_query_scale:
        o = o * math.sqrt(gdn.head_dim)
    context = stats.context.to(gdn.A_log.device)
    sigma = ols_value_scale(valid_tokens(context, mask), valid_tokens(o, mask), phase1.sigma_min, phase1.sigma_max)
    heads = gdn.v_proj.weight.view(gdn.num_heads, gdn.head_dim, -1)
    heads.mul_(sigma.to(heads)[:, None, None])
    return {"sigma": sigma.tolist()}


@torch.no_grad()
def set_output_gate(gdn: GatedDeltaNet, stats: LayerStats, phase1: Phase1Settings, mask=None) -> dict:
    """Rule 5: Wg <- alpha Wv, a small output gate aligned with the values."""
    value_activation = torch.nn.functional.silu(gdn.v_proj(_layer_inputs(gdn, stats)).float())
    context = stats.context.to(gdn.A_log.device)
    alpha = output_gate_alpha(valid_tokens(context, mask), valid_tokens(value_activation, mask), phase1.gate_damping)
    gdn.g_proj.weight.copy_(alpha * gdn.v_proj.weight)
    return {"alpha": alpha}


# The order matters: the value scale is fitted with the calibrated gates, the output gate copies the scaled Wv.
PHASE1_RULES = {"decay": set_decay, "write_gate": set_write_gate, "value_scale": set_value_scale,
                "output_gate": set_output_gate}


def apply_phase1(gdn: GatedDeltaNet, stats: LayerStats, phase1: Phase1Settings, mask: torch.Tensor | None = None,
                 rules=tuple(PHASE1_RULES)) -> dict:
    """Run the named Phase 1 rules (all by default) in `PHASE1_RULES` order on one GDN layer; return what was set."""
    unknown = sorted(set(rules) - set(PHASE1_RULES))
    if unknown:
        raise ValueError(f"unknown Phase 1 rules {unknown}; expected a subset of {list(PHASE1_RULES)}")
    record: dict = {}
    for name, rule in PHASE1_RULES.items():
        if name in rules:
            record.update(rule(gdn, stats, phase1, mask))
    return record
