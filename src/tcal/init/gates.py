"""`zero_gate` and `small_gate`: the output-gate baselines (the GDN branch starts silent or nearly so)."""

import torch

from tcal.init import INIT_MODES


@INIT_MODES.register("zero_gate")
@torch.no_grad()
def zero_gate(gdns, cfg, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.zero_()
    return {}


@INIT_MODES.register("small_gate")
@torch.no_grad()
def small_gate(gdns, cfg, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.mul_(float(cfg.gate_scale))
    return {"gate_scale": float(cfg.gate_scale)}
