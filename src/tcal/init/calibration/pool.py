"""Phase 2 on a calibration pool (`full_plus`): minibatches drawn from many calibration-split windows, and the
state kept by its loss on held-out windows of the same split.

Why: the paper's Phase 2 fits 1,024 tokens and keeps its lowest *fitted* loss, and it overfits them (loss on
unseen calibration-split windows 5-13x the fitted loss; docs/method.md, section "Findings on full"). The same
objective (`align.alignment_loss`) and optimizer, fed fresh windows each step and judged on windows it never fits,
does not pay for that.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
from tqdm.auto import tqdm

from tcal.data.documents import every_nth, token_windows
from tcal.errors import Divergence, check_finite
from tcal.init.calibration.align import BestState, only_trainable, optimizer_step, phase2_optimizer
from tcal.init.calibration.batched import (
    LayerStack,
    StackFit,
    layer_groups,
    layers_per_fit,
    stack_losses,
    stack_metrics,
)
from tcal.init.calibration.calibrate import ArtifactStore, artifact_key, calibrate_shared, float32_master, teacher_io
from tcal.init.calibration.phase1 import apply_phase1
from tcal.init.calibration.stats import collect_teacher_stats
from tcal.runtime.distributed import Ranks
from tcal.runtime.progress import progress
from tcal.settings.init import Phase1Settings, PoolPhase2Settings
from tcal.settings.schedule import lr_factor
from tcal.student.alignment import alignment_loss, alignment_metrics
from tcal.student.convert import layer_generator
from tcal.student.gdn import GatedDeltaNet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationPool:
    fit: torch.Tensor  # [N, T] windows the minibatches are drawn from
    held_out: torch.Tensor  # [M, T] windows that only choose which state to keep


def calibration_pool(docs, tokenizer, seq_len: int, num_windows: int, held_out_every: int) -> CalibrationPool:
    """`num_windows` non-overlapping windows spread over `docs` (pass the calibration split), every
    `held_out_every`-th one held out for state selection."""
    return CalibrationPool(*every_nth(token_windows(docs, tokenizer, seq_len, num_windows), held_out_every))


def minibatches(num_windows: int, batch_size: int, steps: int, generator: torch.Generator) -> torch.Tensor:
    """[steps, batch_size] indices into the fit windows: shuffled passes over the pool, so each window is
    drawn about equally often; the generator's seed fixes the draws."""
    if not 1 <= batch_size <= num_windows:
        raise ValueError(f"minibatches of {batch_size} windows from a pool of {num_windows}")
    need = steps * batch_size
    passes = -(-need // num_windows)
    order = torch.cat([torch.randperm(num_windows, generator=generator) for _ in range(passes)])
    return order[:need].view(steps, batch_size)


def align_on_pool(gdn: GatedDeltaNet, fit: tuple, held_out: tuple, phase2: PoolPhase2Settings,
                  generator: torch.Generator, progress: tqdm | None = None) -> dict:
    """Phase 2 on minibatches of `fit` = (inputs [N, T, D], targets): `phase2.steps` AdamW steps of
    `phase2.batch_size` windows. The loss on `held_out` (every `phase2.select_every` steps and after the last one)
    picks the state that is kept. `phase2.schedule` shapes the learning rate over the steps."""
    draws = minibatches(fit[0].shape[0], int(phase2.batch_size), int(phase2.steps), generator)
    optimizer, trainable = phase2_optimizer(gdn, phase2)
    factor = lr_factor(phase2.schedule, len(draws), setting="phase2.schedule")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    best, held_out_curve, losses = BestState(), [], []

    def held_out_loss(step: int) -> float:
        metrics = alignment_metrics(gdn, *held_out)
        held_out_curve.append([step, metrics["mse"], metrics["cosine"]])
        return metrics["mse"]

    tokens = int(phase2.batch_size) * fit[0].shape[1]
    with only_trainable(gdn, trainable):
        for step, windows in enumerate(draws):
            if step % int(phase2.select_every) == 0:
                best.offer(gdn, held_out_loss(step), step)
            loss = alignment_loss(gdn, fit[0][windows], fit[1][windows])
            losses.append(loss.item())
            check_finite(losses[-1], lambda value: Divergence.in_phase2(gdn.layer_idx, value, step, tokens))
            optimizer_step(optimizer, trainable, loss, phase2.grad_clip)
            scheduler.step()
            if progress is not None:
                progress.update(1)
        best.settle(gdn, held_out_loss(len(draws)), len(draws))
    first, kept = held_out_curve[0], next(c for c in held_out_curve if c[0] == best.step)
    return {"held_out_loss_before": first[1], "held_out_cosine_before": first[2], "held_out_loss_after": kept[1],
            "held_out_cosine_after": kept[2], "best_step": best.step, "held_out_curve": held_out_curve,
            "losses": losses}


def align_on_pool_together(gdns: list[GatedDeltaNet], fit: tuple, held_out: tuple, phase2: PoolPhase2Settings,
                            generators: list[torch.Generator], progress: tqdm | None = None) -> list[dict]:
    """`align_on_pool` of L layers as one batched fit (in place): layer l on fit = (inputs [L, N, T, D], targets)
    and held_out ([L, M, T, D] each), its minibatches drawn by `generators[l]`, its state chosen by its own
    held-out loss; their records."""
    steps, every = int(phase2.steps), int(phase2.select_every)
    stack = LayerStack(gdns)
    device = stack.o_proj.device
    draws = torch.stack([minibatches(fit[0].shape[1], int(phase2.batch_size), steps, g) for g in generators]).to(device)
    rows = torch.arange(len(stack), device=device)[:, None]
    factor = lr_factor(phase2.schedule, steps, setting="phase2.schedule")
    fitting = StackFit(stack, phase2, steps, int(phase2.batch_size) * fit[0].shape[2], factor, progress)
    curve = []  # (step, [L] MSE, [L] cosine), on the device

    def held_out_loss(step: int) -> torch.Tensor:
        curve.append((step, *stack_metrics(stack, *held_out)))
        return curve[-1][1]

    for step in range(steps):
        if step % every == 0:
            fitting.best.offer(held_out_loss(step), step)
        windows = draws[:, step]
        fitting.step(step, stack_losses(stack, fit[0][rows, windows], fit[1][rows, windows]))
    fitting.read(steps)
    fitting.best.settle(held_out_loss(steps), steps)
    stack.write_back()
    read = [(step, mse.tolist(), cosine.tolist()) for step, mse, cosine in curve]
    records = []
    for l, best_step in enumerate(fitting.best.step.tolist()):
        layer_curve = [[step, mse[l], cosine[l]] for step, mse, cosine in read]
        first, kept = layer_curve[0], next(c for c in layer_curve if c[0] == best_step)
        records.append({"held_out_loss_before": first[1], "held_out_cosine_before": first[2],
                        "held_out_loss_after": kept[1], "held_out_cosine_after": kept[2], "best_step": best_step,
                        "held_out_curve": layer_curve, "losses": fitting.layer_losses(l)})
    return records


def calibrate_on_pool(teacher, gdns: dict[int, GatedDeltaNet], pool: CalibrationPool, phase1_rules,
                      phase1: Phase1Settings, phase2: PoolPhase2Settings, settings: dict, store: ArtifactStore,
                      seed: int, block_size: int, layers_per_pass: int | None = None,
                      ranks: Ranks | None = None, fit: str = "batched",
                      fit_size: int | None = None) -> dict[int, dict]:
    """Phase 1 rules `phase1_rules` on the fit windows' statistics, then Phase 2 on the pool, per layer (in
    place); each layer cached under a key of everything it depends on (`settings` must hold every knob).
    The teacher-forced tensors of a pool are large (about 0.1 GB per SmolLM2 layer), so with `layers_per_pass`
    the teacher runs once per group of that many layers and keeps only that group's tensors: more teacher
    passes, less memory, the same result (a layer's statistics do not depend on which others are recorded; on a
    GPU, where a pass's layers share one batched fit, the same up to float rounding). `fit`: `calibration.fit`, the group's Phase 2 fits batched
    (`batched`, `fit_size` = `calibration.layers_per_fit` layers per fit) or one after another (`sequential`)."""
    keys = {i: artifact_key(teacher, i, ["full_plus"], pool.fit, {**settings, "seed": seed}, gdn, pool.held_out)
            for i, gdn in gdns.items()}

    def calibrate_some(todo: list[int]) -> Iterator[tuple[int, dict]]:
        log.info("full_plus: layers %s on a pool of %d + %d held-out windows", todo, len(pool.fit),
                 len(pool.held_out))
        with progress(total=len(todo) * int(phase2.steps), desc="calibrate full_plus", unit="step") as bar:
            for group in layer_groups(todo, layers_per_pass):
                fit_stats = collect_teacher_stats(teacher, pool.fit, layers=group, block_size=block_size)
                held_stats = collect_teacher_stats(teacher, pool.held_out, layers=group, block_size=block_size)
                if fit == "batched":
                    for members in layer_groups(group, layers_per_fit(fit_size, gdns[group[0]].A_log.device)):
                        records = calibrate_group_on_pool({i: gdns[i] for i in members}, fit_stats, held_stats,
                                                          phase1_rules, phase1, phase2, seed, bar)
                        for i in members:
                            yield i, {**records[i], "cached": False}
                    continue
                for i in group:
                    with float32_master(gdns[i]) as gdn:
                        record = calibrate_layer_on_pool(gdn, i, fit_stats.pop(i), held_stats.pop(i), phase1_rules,
                                                         phase1, phase2, seed, bar)
                    yield i, {**record, "cached": False}

    return calibrate_shared(gdns, keys, store, ranks or Ranks(), calibrate_some)


def calibrate_group_on_pool(layers: dict[int, GatedDeltaNet], fit_stats: dict, held_stats: dict, phase1_rules,
                            phase1: Phase1Settings, phase2: PoolPhase2Settings, seed: int,
                            progress: tqdm | None = None) -> dict[int, dict]:
    """`calibrate_layer_on_pool` of every layer of `layers` ({index: GDN}, in place), their Phase 2 fits as one
    batched fit; their records by index. Each layer's statistics are dropped from `fit_stats` and `held_stats` once
    stacked (the stacked pool tensors replace them)."""
    with contextlib.ExitStack() as masters:
        for gdn in layers.values():
            masters.enter_context(float32_master(gdn))
        records = {i: {"phase1": apply_phase1(gdn, fit_stats[i], phase1, rules=tuple(phase1_rules))}
                   for i, gdn in layers.items()}
        fit, held_out = (stacked_io(layers, stats) for stats in (fit_stats, held_stats))
        fits = align_on_pool_together(list(layers.values()), fit, held_out, phase2,
                                      [layer_generator(seed, i) for i in layers], progress=progress)
        del fit, held_out
        for (i, gdn), p2 in zip(layers.items(), fits):
            records[i]["phase2"] = p2
            log_pool_fit(i, p2)
    return records


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


def log_pool_fit(layer: int, p2: dict) -> None:
    log.info("layer %d full_plus: held-out loss %.4g -> %.4g (step %d), cosine %.3f -> %.3f", layer,
             p2["held_out_loss_before"], p2["held_out_loss_after"], p2["best_step"],
             p2["held_out_cosine_before"], p2["held_out_cosine_after"])


def calibrate_layer_on_pool(gdn: GatedDeltaNet, layer: int, fit_stats, held_stats, phase1_rules,
                            phase1: Phase1Settings, phase2: PoolPhase2Settings, seed: int,
                            progress: tqdm | None = None) -> dict:
    """One layer: the Phase 1 rules on the fit windows' statistics, then Phase 2 on the pool; its record."""
    record = {"phase1": apply_phase1(gdn, fit_stats, phase1, rules=tuple(phase1_rules))}
    record["phase2"] = align_on_pool(gdn, teacher_io(gdn, fit_stats), teacher_io(gdn, held_stats), phase2,
                                     layer_generator(seed, layer), progress=progress)
    log_pool_fit(layer, record["phase2"])
    return record
