"""`zero_gate` and `small_gate`: the output-gate baselines (the GDN branch starts silent or nearly so)."""

import torch

from tcal.settings.init import GateInitSettings, InitSettings


@torch.no_grad()
def zero_gate(gdns, init: InitSettings, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.zero_()
    return {}


@torch.no_grad()
def small_gate(gdns, init: GateInitSettings, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.mul_(float(init.gate_scale))
    return {"gate_scale": float(init.gate_scale)}
