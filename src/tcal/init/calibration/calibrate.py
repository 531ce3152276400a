"""Calibrating GDN layers from one teacher forward: Phase 1, Phase 2, or both (Taylor-Calibrate).

Layers are independent given the teacher-forced inputs, so each layer's result is an artifact on disk keyed
by teacher weights, layer, phases, calibration tokens and settings. The GA-S2 retention policy and later
runs of a sweep reuse them instead of calibrating again.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from tcal.data.documents import between_windows, token_windows
from tcal.init.calibration.phase1 import apply_phase1
from tcal.init.calibration.phase2 import FullBatch, fit_stack, layer_groups, layers_per_fit
from tcal.init.calibration.stats import collect_teacher_stats
from tcal.runtime.distributed import Ranks
from tcal.runtime.progress import progress
from tcal.settings.init import PHASES, CalibrationSettings, Phase2Settings, PoolPhase2Settings
from tcal.settings.relevance import cache_settings
from tcal.store.cache import get_or_build_each, tensor_codec
from tcal.store.fingerprint import digest, plain, teacher_fingerprint, tensor_bytes
from tcal.student.alignment import alignment_metrics
from tcal.student.gdn import GatedDeltaNet

log = logging.getLogger(__name__)



def calibration_batch(ctx, calibration: CalibrationSettings) -> torch.Tensor:
    """[batch_size, seq_len] tokens from the calibration split (never the evaluation split)."""
    return token_windows(ctx.splits.calibration, ctx.tokenizer, int(calibration.seq_len),
                         int(calibration.batch_size))


def check_batch(ctx, calibration: CalibrationSettings) -> torch.Tensor | None:
    """Calibration-split windows between those of the calibration batch: the fit never sees them, so the
    alignment loss on them says whether a layer's calibration generalizes. None when `calibration.check` is off."""
    if not calibration.check:
        return None
    try:
        return between_windows(ctx.splits.calibration, ctx.tokenizer, int(calibration.seq_len),
                               int(calibration.batch_size))
    except ValueError as err:
        raise ValueError(f"calibration.check: {err}; set calibration.check=false or use shorter windows") from err


def teacher_io(gdn: GatedDeltaNet, stats) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher-forced input, teacher attention output) of a layer, on the GDN's device."""
    device = next(gdn.parameters()).device
    return stats.inputs.to(device), stats.attn_output.to(device)


def check_metrics(gdn: GatedDeltaNet, stats) -> dict:
    return alignment_metrics(gdn, *teacher_io(gdn, stats))


def check_record(before: dict, after: dict, tokens: int) -> dict:
    return {"tokens": tokens, "loss_before": before["mse"], "cosine_before": before["cosine"],
            "loss_after": after["mse"], "cosine_after": after["cosine"]}


def artifact_key(teacher, layer: int, phases, batch: torch.Tensor, settings: dict, naive: GatedDeltaNet,
                 check: torch.Tensor | None = None) -> str:
    """Everything a layer's calibration and its record depend on: teacher, layer, phases, tokens, settings,
    starting point, and the held-out check tokens."""
    start = b"".join(tensor_bytes(p) for p in naive.state_dict().values())
    held_out = tensor_bytes(check) if check is not None else None
    return digest(teacher_fingerprint(teacher), layer, list(phases), tensor_bytes(batch), settings, start, held_out)


class ArtifactStore:
    """Where calibrated layers are cached: one safetensors file per layer, its GDN state dict with its
    calibration record as JSON metadata (`tcal.store.cache`, kind `calibration`). `folder=None`: no cache."""

    def __init__(self, folder: Path | None):
        self.folder = Path(folder) if folder is not None else None


def _layer_entry(value: dict) -> tuple[dict, dict]:
    record = {k: v for k, v in value["record"].items() if k not in ("cached", "rank")}
    return value["state"], record


def _layer_value(state: dict, record) -> dict:
    if not state or not isinstance(record, dict):
        raise ValueError("no GDN state or no record in it (a foreign file)")
    return {"state": state, "record": {**record, "cached": True}}


LAYER = tensor_codec(_layer_entry, _layer_value)


def calibration_store(ctx) -> ArtifactStore:
    """The run's calibration artifact folder (none with `calibration.cache=false`)."""
    cache = ctx.settings.calibration.cache
    return ArtifactStore(ctx.cache_dir / "calibration" / ctx.settings.teacher.name if cache else None)


@contextmanager
def float32_master(gdn: GatedDeltaNet):
    """The layer in float32 for the block (Phase 1 fits and Phase 2 steps), back in its own dtype after: a bfloat16
    student is calibrated on float32 weights and rounded once. A float32 layer is untouched."""
    dtype = gdn.A_log.dtype
    gdn.float()
    try:
        yield gdn
    finally:
        gdn.to(dtype)


def calibrate_shared(gdns: dict[int, GatedDeltaNet], keys: dict[int, str], store: ArtifactStore, ranks: Ranks,
                     calibrate_some: Callable[[list[int]], Iterator[tuple[int, dict]]]) -> dict[int, dict]:
    """Each layer read from the cache (its weights loaded in place, its record marked cached) or calibrated:
    the layers not in the cache are calibrated together by `calibrate_some(layers)` (yielding each layer's
    record as it is done, so each is cached at once), split across ranks, and every rank receives every layer's
    weights and record. Each layer is built once however many ranks and jobs need it (`tcal.store.cache`)."""

    def build_some(todo: list[int]):
        for i, record in calibrate_split(todo, gdns, ranks, calibrate_some):
            yield i, {"state": gdns[i].state_dict(), "record": record}

    values = get_or_build_each("calibration", keys, build_some, folder=store.folder, codec=LAYER, ranks=ranks)
    for i, value in values.items():
        if value["record"]["cached"]:
            gdns[i].load_state_dict(value["state"])
    return {i: values[i]["record"] for i in sorted(values)}


def calibrate_split(todo: list[int], gdns: dict[int, GatedDeltaNet], ranks: Ranks,
                    calibrate_some: Callable[[list[int]], Iterator[tuple[int, dict]]]) -> Iterator[tuple[int, dict]]:
    """(layer, record) as each layer of `todo` is done. One process yields each as it finishes; several ranks
    each calibrate their share, then every rank holds every layer's weights and record."""
    if not ranks.distributed:
        yield from calibrate_some(todo)
        return
    mine = ranks.share(todo)
    log.info("rank %d of %d calibrates layers %s (of %s)", ranks.rank, ranks.world_size, mine, todo)
    with ranks.together():  # a layer that fails (a divergence in Phase 2) stops every rank with its error
        built = {i: {**r, "rank": ranks.rank} for i, r in (calibrate_some(mine) if mine else [])}
    for position, i in enumerate(todo):
        ranks.broadcast_module(gdns[i], src=ranks.owner(position))
    yield from sorted(ranks.merge(built).items())


@dataclass(frozen=True)
class Recipe:
    """How a mode calibrates a stack of layers. `phase1(gdn, stats)`: Phase 1 in place, its record (None: no
    Phase 1). `phase2`: Phase 2's settings (None: no Phase 2), on the windows of `source(layers, fit, held_out)`, a
    `phase2.fit_stack` source built from the stacked teacher I/O of the fit windows and, when `selects`, of the
    held-out windows (which then pick the state kept; otherwise held-out windows are check windows, measured before
    and after). `fit`, `fit_size`: `calibration.fit` and `calibration.layers_per_fit`. `log_fit(layer, record)`
    logs a layer's Phase 2."""
    phase1: Callable | None
    phase2: Phase2Settings | PoolPhase2Settings | None
    source: Callable
    fit: str
    fit_size: int | None
    block_size: int
    log_fit: Callable[[int, dict], None]
    selects: bool = True


def calibrate_layers(teacher, gdns: dict[int, GatedDeltaNet], batch: torch.Tensor, calibration: CalibrationSettings,
                     phases, store: ArtifactStore, check: torch.Tensor | None = None, ranks: Ranks | None = None,
                     key_settings: dict | None = None) -> dict[int, dict]:
    """Calibrate each GDN (in place) against the teacher layer of the same index; returns per-layer records.
    With `check` tokens, each record also gets the alignment loss and cosine on them before and after.
    With several ranks each calibrates a share of the layers (`calibrate_shared`). Each layer's cache key holds
    `key_settings` (a run's: every setting that changes a calibrated layer; by default the `calibration` given)."""
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown calibration phases {unknown}; expected a subset of {PHASES}")
    settings = plain(calibration) if key_settings is None else key_settings
    keys = {i: artifact_key(teacher, i, phases, batch, settings, gdn, check) for i, gdn in gdns.items()}
    recipe = Recipe(phase1=(lambda gdn, stats: apply_phase1(gdn, stats, calibration.phase1)) if "phase1" in phases
                    else None, phase2=calibration.phase2 if "phase2" in phases else None,
                    source=lambda layers, windows, held_out: FullBatch(*windows), fit=calibration.fit,
                    fit_size=calibration.layers_per_fit, block_size=int(calibration.block_size),
                    log_fit=log_phase2, selects=False)
    steps = int(calibration.phase2.steps) if "phase2" in phases else 0

    def calibrate_some(todo: list[int]) -> Iterator[tuple[int, dict]]:
        log.info("calibrating layers %s (%s) on %s calibration tokens", todo, "+".join(phases), batch.numel())
        with progress(total=len(todo) * max(steps, 1), desc=f"calibrate {'+'.join(phases)}", unit="step") as bar:
            yield from calibrate_group(teacher, gdns, todo, batch, check, recipe, bar)

    return calibrate_shared(gdns, keys, store, ranks or Ranks(), calibrate_some)


def calibrate_group(teacher, gdns: dict[int, GatedDeltaNet], group: list[int], windows: torch.Tensor,
                    held_out: torch.Tensor | None, recipe: Recipe, bar) -> Iterator[tuple[int, dict]]:
    """The layers of `group` (in place) from one teacher pass over `windows` (and `held_out`), their fits stacked
    `calibration.layers_per_fit` at a time (one with `calibration.fit=sequential`); (layer, record) as each stack is
    done."""
    fit_stats = collect_teacher_stats(teacher, windows, layers=group, block_size=recipe.block_size)
    held_stats = None if held_out is None else collect_teacher_stats(teacher, held_out, layers=group,
                                                                     block_size=recipe.block_size)
    size = 1 if recipe.fit == "sequential" else layers_per_fit(recipe.fit_size, gdns[group[0]].A_log.device)
    for members in layer_groups(group, size):
        records = calibrate_stack({i: gdns[i] for i in members}, fit_stats, held_stats, recipe, bar,
                                  0 if held_out is None else held_out.numel())
        for i in members:
            yield i, {**records[i], "cached": False}


def calibrate_stack(layers: dict[int, GatedDeltaNet], fit_stats: dict, held_stats: dict | None, recipe: Recipe, bar,
                    check_tokens: int) -> dict[int, dict]:
    """Phase 1 of each layer of `layers` ({index: GDN}, in place, in float32), then their Phase 2 as one
    `fit_stack`; their records by index. Each layer's statistics are dropped from `fit_stats` (and, when they
    select, `held_stats`) once stacked (the stacked tensors replace them)."""
    checks = {i: None if held_stats is None or recipe.selects else held_stats[i] for i in layers}
    with contextlib.ExitStack() as masters:
        for gdn in layers.values():
            masters.enter_context(float32_master(gdn))
        started = {i: start_record(gdn, fit_stats[i], checks[i], recipe) for i, gdn in layers.items()}
        if recipe.phase2 is None:
            bar.update(len(layers))
        else:
            windows = stacked_io(layers, fit_stats)
            held_out = stacked_io(layers, held_stats) if recipe.selects else None
            fits = fit_stack(list(layers.values()), recipe.source(list(layers), windows, held_out), recipe.phase2, bar)
            del windows, held_out
            for (record, _), fit in zip(started.values(), fits):
                record["phase2"] = fit
        return {i: finish_record(gdn, i, *started[i], checks[i], check_tokens, recipe.log_fit)
                for i, gdn in layers.items()}


def stacked_io(layers: dict[int, GatedDeltaNet], stats: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [L, N, T, D] of `layers` on their device, each layer's statistics popped from `stats` as
    they are copied in (so one layer's tensors at a time exist twice)."""
    first = next(iter(layers.values()))
    inputs, targets = teacher_io(first, stats[next(iter(layers))])
    x = inputs.new_empty(len(layers), *inputs.shape)
    target = targets.new_empty(len(layers), *targets.shape)
    for l, (i, gdn) in enumerate(layers.items()):
        x[l], target[l] = teacher_io(gdn, stats.pop(i))
    return x, target


def start_record(gdn: GatedDeltaNet, layer_stats, check_stats, recipe: Recipe) -> tuple[dict, dict | None]:
    """A layer's record before Phase 2: its check metrics before any phase (None without check windows), then
    Phase 1 (in place) when the recipe has one."""
    record: dict = {}
    before = check_metrics(gdn, check_stats) if check_stats is not None else None
    if recipe.phase1 is not None:
        record["phase1"] = recipe.phase1(gdn, layer_stats)
    return record, before


def finish_record(gdn: GatedDeltaNet, i: int, record: dict, before: dict | None, check_stats,
                  check_tokens: int, log_fit: Callable[[int, dict], None]) -> dict:
    """A layer's record after its phases: Phase 2 logged, and the check metrics after, beside those before."""
    if "phase2" in record:
        log_fit(i, record["phase2"])
    if before is not None:
        record["check"] = check_record(before, check_metrics(gdn, check_stats), check_tokens)
        log.info("layer %d on %d unseen tokens: loss %.4g -> %.4g, cosine %.3f -> %.3f", i, check_tokens,
                 *(record["check"][k] for k in ("loss_before", "loss_after", "cosine_before", "cosine_after")))
    return record


def log_phase2(layer: int, p2: dict) -> None:
    log.info("layer %d phase2: loss %.4g -> %.4g, cosine %.3f -> %.3f", layer, p2["loss_before"], p2["loss_after"],
             p2["cosine_before"], p2["cosine_after"])


def calibrate_gdns(gdns: dict[int, GatedDeltaNet], ctx, phases) -> dict:
    """Calibrate GDN layers with the run's `calibration` settings and artifact cache."""
    calibration = ctx.settings.calibration
    store = calibration_store(ctx)
    batch = calibration_batch(ctx, calibration)
    records = calibrate_layers(ctx.teacher, gdns, batch, calibration, phases, store, check_batch(ctx, calibration),
                               ctx.ranks, cache_settings("calibration", ctx.settings))
    return {"phases": list(phases), "calibration_tokens": batch.numel(), "layers": {str(i): r for i, r in records.items()}}
