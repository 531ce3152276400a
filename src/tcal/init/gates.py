"""`zero_gate` and `small_gate`: the output-gate baselines (the GDN branch starts silent or nearly so)."""

import torch

from tcal.registry import INIT_MODES
from tcal.settings.init import GateInitSettings, InitSettings


@INIT_MODES.option("zero_gate", InitSettings)
@torch.no_grad()
def zero_gate(gdns, init: InitSettings, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.zero_()
    return {}


@INIT_MODES.option("small_gate", GateInitSettings)
@torch.no_grad()
def small_gate(gdns, init: GateInitSettings, ctx) -> dict:
    for gdn in gdns.values():
        gdn.g_proj.weight.mul_(float(init.gate_scale))
    return {"gate_scale": float(init.gate_scale)}
