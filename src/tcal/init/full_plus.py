"""`full_plus`: this project's own calibration (docs/method.md, section "full_plus"). The same statistics, Phase 1
rules and alignment objective as `full`, with the recipe the measurements support: the Phase 1 rules named in the
config only, Phase 2 on minibatches of a calibration-split pool, the state kept by held-out loss."""

from tcal.init import INIT_MODES
from tcal.init.calibration.calibrate import calibration_store
from tcal.init.calibration.pool import CalibrationPool, calibrate_on_pool, calibration_pool, pool_windows
from tcal.settings.relevance import cache_settings


def pool_shape(cfg, seq_len: int) -> dict:
    """The pool as it is cut: `cfg.pool.tokens` in windows of `seq_len` (the run's `calibration.seq_len`)."""
    return {"windows": pool_windows(int(cfg.pool.tokens), int(seq_len)), "seq_len": int(seq_len),
            "held_out_every": int(cfg.pool.held_out_every)}


def full_plus_pool(ctx, cfg) -> CalibrationPool:
    """The pool of `cfg.pool.tokens` in windows of `calibration.seq_len`, from the calibration split only (the
    evaluation split stays unseen)."""
    shape = pool_shape(cfg, ctx.settings.calibration.seq_len)
    return calibration_pool(ctx.splits.calibration, ctx.tokenizer, shape["seq_len"], shape["windows"],
                            shape["held_out_every"])


@INIT_MODES.register("full_plus")
def full_plus(gdns, cfg, ctx) -> dict:
    calibration = ctx.settings.calibration
    phase1_cfg = cfg.phase1_settings(calibration)  # `full`'s knobs, this recipe's own
    pool = full_plus_pool(ctx, cfg)
    block_size = int(calibration.block_size)
    records = calibrate_on_pool(ctx.teacher, gdns, pool, cfg.phase1_rules, phase1_cfg, cfg.phase2,
                                cache_settings("calibration", ctx.settings), calibration_store(ctx),
                                int(ctx.settings.seed), block_size, cfg.pool.layers_per_pass, ctx.ranks)
    return {"phase1_rules": list(cfg.phase1_rules), "pool_seq_len": pool.fit.shape[1], "pool_tokens": pool.fit.numel(),
            "held_out_tokens": pool.held_out.numel(), "layers": {str(i): r for i, r in records.items()}}
