"""Phase 1 of Taylor-Calibrate: closed-form GDN dynamics from teacher attention statistics (DESIGN section 5).

Each rule is a small function on tensors, so tests can check it against hand-computed values;
`apply_phase1` runs them in order on one GDN layer.
"""

from __future__ import annotations

import math

import torch

from tcal.calibration.align import valid_tokens
from tcal.calibration.stats import LayerStats
from tcal.gdn import GatedDeltaNet


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
def apply_phase1(gdn: GatedDeltaNet, stats: LayerStats, cfg, mask: torch.Tensor | None = None) -> dict:
    """Set A_log, dt_bias, b_proj, v_proj and g_proj of one GDN layer; return what was set, per head."""
    param = gdn.A_log
    gamma = decay_rates(stats.mean_distance, cfg.gamma_min, cfg.gamma_max)
    gdn.A_log.zero_()
    gdn.dt_bias.copy_(inverse_softplus(gamma.double()).to(param))

    concentration, beta_target = write_targets(stats.mean_entropy, cfg.beta_low, cfg.beta_span)
    gdn.b_proj.weight.copy_(rescale_write_gate(gdn.b_proj.weight.float(), beta_target))

    x = stats.inputs.to(param.device, gdn.q_proj.weight.dtype)
    o, _ = gdn.mix(x, mask)
    if not cfg.value_fit_query_scale:
        o = o * math.sqrt(gdn.head_dim)
    context = stats.context.to(param.device)
    sigma = ols_value_scale(valid_tokens(context, mask), valid_tokens(o, mask), cfg.sigma_min, cfg.sigma_max)
    heads = gdn.v_proj.weight.view(gdn.num_heads, gdn.head_dim, -1)
    heads.mul_(sigma.to(heads)[:, None, None])

    value_activation = torch.nn.functional.silu(gdn.v_proj(x).float())
    alpha = output_gate_alpha(valid_tokens(context, mask), valid_tokens(value_activation, mask), cfg.gate_damping)
    gdn.g_proj.weight.copy_(alpha * gdn.v_proj.weight)
    return {
        "mean_distance": stats.mean_distance.tolist(),
        "mean_entropy": stats.mean_entropy.tolist(),
        "gamma": gamma.tolist(),
        "concentration": concentration.tolist(),
        "beta_target": beta_target.tolist(),
        "sigma": sigma.tolist(),
        "alpha": alpha,
    }
