"""`full_plus`: this project's own calibration (docs/method.md, section "full_plus"). The same statistics, Phase 1
rules and alignment objective as `full`, with the recipe the measurements support: the Phase 1 rules named in the
config only, Phase 2 on minibatches of a calibration-split pool, the state kept by held-out loss."""

from tcal.init.calibration.calibrate import calibration_store
from tcal.init.calibration.pool import CalibrationPool, calibrate_on_pool, calibration_pool
from tcal.settings.init import FullPlusSettings, pool_windows
from tcal.settings.relevance import cache_settings


def pool_shape(init, seq_len: int) -> dict:
    """The pool as it is cut: `init.pool.tokens` in windows of `seq_len` (the run's `calibration.seq_len`)."""
    return {"windows": pool_windows(int(init.pool.tokens), int(seq_len)), "seq_len": int(seq_len),
            "held_out_every": int(init.pool.held_out_every)}


def full_plus_pool(ctx, init) -> CalibrationPool:
    """The pool of `init.pool.tokens` in windows of `calibration.seq_len`, from the calibration split only (the
    evaluation split stays unseen)."""
    shape = pool_shape(init, ctx.settings.calibration.seq_len)
    return calibration_pool(ctx.splits.calibration, ctx.tokenizer, shape["seq_len"], shape["windows"],
                            shape["held_out_every"])


def full_plus(gdns, init: FullPlusSettings, ctx) -> dict:
    calibration = ctx.settings.calibration
    phase1 = init.phase1_settings(calibration)  # `full`'s knobs, this recipe's own
    pool = full_plus_pool(ctx, init)
    block_size = int(calibration.block_size)
    records = calibrate_on_pool(ctx.teacher, gdns, pool, init.phase1_rules, phase1, init.phase2,
                                cache_settings("calibration", ctx.settings), calibration_store(ctx),
                                int(ctx.settings.seed), block_size, init.pool.layers_per_pass, ctx.ranks,
                                calibration.fit, calibration.layers_per_fit)
    return {"phase1_rules": list(init.phase1_rules), "pool_seq_len": pool.fit.shape[1], "pool_tokens": pool.fit.numel(),
            "held_out_tokens": pool.held_out.numel(), "layers": {str(i): r for i, r in records.items()}}
