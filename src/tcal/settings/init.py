"""`init` and `calibration`: how the converted GDN layers start (conf/init/, conf/calibration/; the modes:
tcal.init). Every mode starts from the naive conversion (`gqa_expansion`); the Taylor-Calibrate modes (`phase1`,
`phase2`, `full`) read `calibration`, `full_plus` its own pool and Phase 2 and `calibration`'s Phase 1 knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from tcal.settings.fields import (
    INIT,
    NOTHING,
    Key,
    SettingError,
    Settings,
    bad,
    bound,
    declared,
    distinct,
    is_number,
    learning_rate,
    non_negative,
    one_of,
    optional,
    positive_int,
    positive_number,
    setting,
    window_length,
)
from tcal.registry import INIT_MODES
from tcal.settings.schedule import SCHEDULES

GQA_EXPANSIONS = ("whole_head", "row_repeat")  # how a KV head serves its query heads in the GDN (tcal.student.convert)
PHASES = ("phase1", "phase2")
FITS = ("batched", "sequential")  # how Phase 2 advances the layers (tcal.init.calibration.phase2)
PHASE1_RULES = ("decay", "write_gate", "value_scale", "output_gate")  # in the order they run (tcal.init.calibration.phase1)


@declared
@dataclass
class Phase1Settings(Settings):
    """Phase 1's closed-form rules: decay range, write-gate target, value-scale clip, output-gate damping."""

    gamma_min: float = setting(1.0e-3, affects=[INIT], check=positive_number)  # clip of the decay rate ln2 / d_h
    gamma_max: float = setting(5.0, affects=[INIT])
    # beta* = beta_low + beta_span * concentration
    beta_low: float = setting(0.3, affects=[INIT], check=bound(lambda v: is_number(v) and 1e-9 <= v < 1.0,
                                                               "a write-gate target in (0, 1)"))
    beta_span: float = setting(0.4, affects=[INIT])
    sigma_min: float = setting(0.1, affects=[INIT], check=positive_number)  # clip of the OLS value scale
    sigma_max: float = setting(10.0, affects=[INIT])
    # false: the reference code's hand loop (the paper's `full`); true keeps fla's 1/sqrt(dk)
    value_fit_query_scale: bool = setting(False, affects=[INIT])
    # alpha = damping * RMS(ctx) / RMS(silu(Wv x))
    gate_damping: float = setting(0.01, affects=[INIT], check=non_negative)

    def check(self) -> None:
        for low, high in (("gamma_min", "gamma_max"), ("sigma_min", "sigma_max")):
            if not is_number(getattr(self, high)) or getattr(self, high) < getattr(self, low):
                raise SettingError(Key(high), f"={getattr(self, high)!r}; expected a number >= ", Key(low),
                                   f"={getattr(self, low)}")
        if not is_number(self.beta_span) or not 0.0 < self.beta_low + self.beta_span < 1.0:
            raise bad("beta_span", self.beta_span, "beta_low + beta_span in (0, 1)")


@declared
@dataclass
class Phase2Settings(Settings):
    """Phase 2: per-layer alignment to the teacher's attention output on the calibration batch."""

    steps: int = setting(300, affects=[INIT], check=positive_int)
    lr_projections: float = setting(1.0e-4, affects=[INIT], check=learning_rate)  # q, k, v
    # a, b, g projections, A_log, dt_bias (Wo and o_norm stay frozen)
    lr_dynamics: float = setting(1.0e-3, affects=[INIT], check=learning_rate)
    weight_decay: float = setting(0.01, affects=[INIT], check=non_negative)
    grad_clip: float = setting(1.0, affects=[INIT], check=positive_number)


@declared
@dataclass
class CalibrationSettings(Settings):
    """Knobs of the Taylor-Calibrate modes (phase1, phase2, full) and the Phase 1 rules full_plus shares: the
    calibration batch (`batch_size` windows of `seq_len` calibration-split tokens), the recurrence's chunk size,
    the held-out check of every calibrated layer."""

    schema = "calibration/calibration"

    # calibration sequences, from the calibration split
    batch_size: int = setting(4, affects=[INIT], check=positive_int)
    # also the full_plus pool's window length (2,048 measured worse: docs/results.md)
    seq_len: int = setting(256, affects=[INIT], check=window_length)
    # query block of the streaming attention statistics
    block_size: int = setting(256, affects=[INIT], check=positive_int)
    # The held-out check measures each layer on unseen windows: no weight changes, and its tokens key the layer's
    # cache entry themselves (a layer's record holds its check only when it was made).
    # also report each layer's alignment loss on batch_size - 1 unseen calibration-split windows
    check: bool = setting(True, affects=NOTHING)
    cache: bool = setting(True, affects=NOTHING)  # keep each calibrated layer on disk under paths.cache_dir/calibration
    # Phase 2 (of phase2, full, full_plus): `batched` fits every layer in one stacked step; `sequential` one layer
    # after another, the reference the batched fit is tested against (the same fits up to float rounding)
    fit: str = setting("batched", affects=[INIT], check=one_of(FITS))
    # layers per batched fit: all on a GPU, one on a CPU by default (where stacking measured slower); the same fits
    # up to float rounding
    layers_per_fit: Optional[int] = setting(None, affects=[INIT], check=optional(positive_int))
    phase1: Phase1Settings = setting(affects=[INIT], factory=Phase1Settings)
    phase2: Phase2Settings = setting(affects=[INIT], factory=Phase2Settings)

    def __post_init__(self):  # `check` is a field here: its fields' bounds alone are checked
        self.checked()


@declared
@dataclass
class InitSettings(Settings):
    """`naive` and `zero_gate`: the conversion, then (zero_gate) Wg = 0."""

    name: str = setting("naive", affects=[INIT], check=one_of(INIT_MODES.names))
    # or row_repeat (the reference code's mistake, for comparison)
    gqa_expansion: str = setting("whole_head", affects=[INIT], check=one_of(GQA_EXPANSIONS))

    def calibrates(self) -> bool:
        """Whether the mode reads the calibration split (and so `calibration.seq_len` of the teacher)."""
        return False

    def check_with(self, calibration: CalibrationSettings) -> None:
        """What the mode's settings need of `calibration` (SettingError with keys from the run's root)."""

    def calibration_work(self, calibration: CalibrationSettings, n_gdn: int) -> CalibrationWork | None:
        """The windows the mode reads of the calibration split (`tcal-plan`'s memory, the split's token check);
        None for a mode that does not calibrate."""
        return None

    def split_needs(self, calibration: CalibrationSettings) -> list[tuple[str, int]]:
        """(what, tokens) the mode reads of the calibration split, what naming the keys that set it."""
        return []


@declared
@dataclass
class CalibratedInitSettings(InitSettings):
    """`full`, `phase1`, `phase2`: the Taylor-Calibrate phases named in `phases`."""

    name: str = setting("full", affects=[INIT])
    phases: List[str] = setting(affects=[INIT], factory=lambda: ["phase1", "phase2"], check=distinct(PHASES))

    def calibrates(self) -> bool:
        return True

    def calibration_work(self, calibration: CalibrationSettings, n_gdn: int) -> CalibrationWork:
        """The calibration batch and, with `calibration.check`, its held-out check windows."""
        windows = int(calibration.batch_size)
        check = windows - 1 if calibration.check and windows > 1 else 0
        return CalibrationWork(int(calibration.seq_len), windows + check, windows, windows, windows,
                               "phase2" in self.phases, n_gdn, n_gdn)

    def split_needs(self, calibration: CalibrationSettings) -> list[tuple[str, int]]:
        work = self.calibration_work(calibration, 1)
        return [(f"calibration.batch_size={calibration.batch_size} windows of calibration.seq_len={calibration.seq_len}"
                 + (" (with calibration.check=true, the unseen windows between them too)" if calibration.check else ""),
                 work.stats_windows * work.seq_len)]


@declared
@dataclass
class GateInitSettings(InitSettings):
    """`small_gate`: Wg *= gate_scale."""

    name: str = setting("small_gate", affects=[INIT])
    gate_scale: float = setting(0.02, affects=[INIT], check=positive_number)


@declared
@dataclass
class PoolSettings(Settings):
    """full_plus's pool: `tokens` of the calibration split cut into windows of calibration.seq_len, every
    `held_out_every`-th window held out; `layers_per_pass` layers share one teacher pass (memory only)."""

    # cut into windows of calibration.seq_len tokens: 64 x 256, or 8 x 2,048 (same budget)
    tokens: int = setting(16384, affects=[INIT], check=positive_int)
    # every 8th window is held out: it only chooses which Phase 2 state to keep
    held_out_every: int = setting(8, affects=[INIT])
    # the same weights (tested), less memory
    layers_per_pass: Optional[int] = setting(None, affects=NOTHING, check=optional(positive_int))


@declared
@dataclass
class PoolPhase2Settings(Settings):
    """full_plus's Phase 2: minibatches of `batch_size` pool windows, the state kept by held-out loss checked
    every `select_every` steps."""

    steps: int = setting(300, affects=[INIT], check=positive_int)
    # windows per step, drawn from the pool's fit windows
    batch_size: int = setting(4, affects=[INIT], check=positive_int)
    # held-out loss checked every this many steps, and after the last
    select_every: int = setting(25, affects=[INIT], check=positive_int)
    # q, k, v (3e-4 gave 1.21x the teacher PPL against 1.14x, docs/results.md)
    lr_projections: float = setting(1.0e-3, affects=[INIT], check=learning_rate)
    # a, b, g projections, A_log, dt_bias (Wo and o_norm stay frozen)
    lr_dynamics: float = setting(3.0e-3, affects=[INIT], check=learning_rate)
    # or cosine: the learning rates decay to 0 over the steps
    schedule: str = setting("constant", affects=[INIT], check=one_of(SCHEDULES))
    weight_decay: float = setting(0.01, affects=[INIT], check=non_negative)
    grad_clip: float = setting(1.0, affects=[INIT], check=positive_number)


def phase1_overrides(key: str, overrides: dict) -> None:
    """Keys of `Phase1Settings`, each named `<key>.<its key>`."""
    known = [f.name for f in dataclasses.fields(Phase1Settings)]
    for name in overrides:
        if name not in known:
            raise bad(f"{key}.{name}", overrides[name], f"a key of calibration.phase1 ({', '.join(known)})")


@declared
@dataclass
class FullPlusSettings(InitSettings):
    """`full_plus`: the named Phase 1 rules (with `phase1` overriding calibration.phase1), then Phase 2 on
    minibatches of a calibration-split pool, the state kept by held-out loss."""

    name: str = setting("full_plus", affects=[INIT])
    # all four: dropping the other three costs 3% PPL (docs/results.md)
    phase1_rules: List[str] = setting(affects=[INIT], factory=lambda: list(PHASE1_RULES), check=distinct(PHASE1_RULES))
    # overrides of calibration.phase1 (conf/calibration/default.yaml) for those rules
    phase1: Dict[str, Any] = setting(affects=[INIT], factory=lambda: {"sigma_min": 0.1, "sigma_max": 0.1},
                                     check=phase1_overrides)
    # calibration-split windows only; the evaluation split is never read
    pool: PoolSettings = setting(affects=[INIT], factory=PoolSettings)
    phase2: PoolPhase2Settings = setting(affects=[INIT], factory=PoolPhase2Settings)

    def calibrates(self) -> bool:
        return True

    def check_with(self, calibration: CalibrationSettings) -> None:
        self.check_pool(calibration.seq_len)
        try:
            self.phase1_settings(calibration)
        except SettingError as err:
            raise err.placed("init.phase1.") from None

    def calibration_work(self, calibration: CalibrationSettings, n_gdn: int) -> CalibrationWork:
        """The pool (`pool.tokens` in windows of `calibration.seq_len`) and minibatches of `phase2.batch_size`."""
        windows = pool_windows(int(self.pool.tokens), int(calibration.seq_len))
        return CalibrationWork(int(calibration.seq_len), windows, windows - windows // int(self.pool.held_out_every),
                               windows, int(self.phase2.batch_size), True, int(self.pool.layers_per_pass or n_gdn),
                               n_gdn)

    def split_needs(self, calibration: CalibrationSettings) -> list[tuple[str, int]]:
        return [(f"init.pool.tokens={self.pool.tokens} (windows of calibration.seq_len={calibration.seq_len})",
                 self.pool.tokens)]

    def phase1_settings(self, calibration: CalibrationSettings) -> Phase1Settings:
        """`calibration.phase1` with this recipe's overrides."""
        return dataclasses.replace(calibration.phase1, **self.phase1)

    def check_pool(self, seq_len: int) -> None:
        """The pool cut in windows of `calibration.seq_len` (keys relative to the run's root)."""
        pool, phase2 = self.pool, self.phase2
        if pool.tokens % seq_len:
            raise SettingError(Key("init.pool.tokens"), f"={pool.tokens}; expected a multiple of ",
                               Key("calibration.seq_len"), f"={seq_len} (the pool is cut into whole windows of that "
                               f"length)")
        windows = pool.tokens // seq_len
        every = pool.held_out_every
        if not isinstance(every, int) or isinstance(every, bool) or not 2 <= every <= windows:
            raise SettingError(Key("init.pool.held_out_every"), f"={every!r}; expected an integer from 2 to the "
                               f"{windows} windows of the pool (", Key("init.pool.tokens"), f"={pool.tokens} / ",
                               Key("calibration.seq_len"), f"={seq_len}; every n-th pool window is held out: at least "
                               f"one must be)")
        fit = windows - windows // every
        if phase2.batch_size > fit:
            raise SettingError(Key("init.phase2.batch_size"), f"={phase2.batch_size} is more than the {fit} fit windows "
                               f"of the pool ({windows} windows of ", Key("calibration.seq_len"), f"={seq_len}, one in ",
                               Key("init.pool.held_out_every"), f"={every} held out)")


@dataclass(frozen=True)
class CalibrationWork:
    """The windows an init mode calibrates on: those of the statistics (host memory), of its teacher forward, of its
    Phase 2 tensors on the device and of one Phase 2 step; how many layers' statistics are held at once; and how many
    layers it converts."""

    seq_len: int
    stats_windows: int
    forward_windows: int
    device_windows: int
    step_windows: int
    phase2: bool
    layers_at_once: int
    layers: int


def pool_windows(tokens: int, seq_len: int) -> int:
    """Windows in a pool of `tokens` calibration tokens cut into windows of `seq_len`: longer windows, fewer of
    them, the same budget (16,384 tokens are 64 windows of 256 or 8 of 2,048)."""
    if seq_len < 1 or tokens % seq_len:
        raise ValueError(f"a pool of {tokens} tokens does not cut into whole windows of {seq_len} tokens")
    return tokens // seq_len


def init_settings(name: str, **changes) -> InitSettings:
    """The default settings of init mode `name` (as conf/init/<name>.yaml gives them), with `changes`."""
    if name not in INIT_MODES:
        raise SettingError(Key("name"), f"={name!r}; expected one of {', '.join(INIT_MODES.names())}")
    return INIT_MODES[name].make_settings(**changes)
