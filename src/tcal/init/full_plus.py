"""`full_plus`: this project's own calibration (docs/method.md, section "full_plus"). The same statistics, Phase 1
rules and alignment objective as `full`, with the recipe the measurements support: the Phase 1 rules named in the
config only, Phase 2 on minibatches of a calibration-split pool, the state kept by held-out loss."""

import dataclasses

from tcal.calibration.calibrate import calibration_store
from tcal.calibration.pool import CalibrationPool, calibrate_on_pool, calibration_pool
from tcal.fingerprint import plain
from tcal.init import INIT_MODES


def full_plus_pool(ctx, cfg) -> CalibrationPool:
    """The pool of `cfg.pool` windows, from the calibration split only (the evaluation split stays unseen)."""
    return calibration_pool(ctx.splits.calibration, ctx.tokenizer, int(cfg.pool.seq_len), int(cfg.pool.windows),
                            int(cfg.pool.held_out_every))


@INIT_MODES.register("full_plus")
def full_plus(gdns, cfg, ctx) -> dict:
    calibration = ctx.settings.calibration
    phase1_cfg = dataclasses.replace(calibration.phase1, **dict(cfg.phase1))  # `full`'s knobs, this recipe's own
    pool = full_plus_pool(ctx, cfg)
    block_size = int(calibration.block_size)
    recipe = plain(cfg)
    layers_per_pass = recipe["pool"].pop("layers_per_pass", None)  # memory only: not part of the artifact key
    settings = {"init": recipe, "phase1": plain(phase1_cfg), "block_size": block_size}
    records = calibrate_on_pool(ctx.teacher, gdns, pool, cfg.phase1_rules, phase1_cfg, cfg.phase2, settings,
                                calibration_store(ctx), int(ctx.settings.seed), block_size, layers_per_pass,
                                ctx.ranks)
    return {"phase1_rules": list(cfg.phase1_rules), "pool_tokens": pool.fit.numel(),
            "held_out_tokens": pool.held_out.numel(), "layers": {str(i): r for i, r in records.items()}}
