"""Phase 2 on a calibration pool (`full_plus`): minibatches drawn from many calibration-split windows, and the
state kept by its loss on held-out windows of the same split.

Why: the paper's Phase 2 fits 1,024 tokens and keeps its lowest *fitted* loss, and it overfits them (loss on
unseen calibration-split windows 5-13x the fitted loss; docs/method.md, section "Findings on full"). The same
objective (`tcal.student.alignment`) and optimizer, fed fresh windows each step and judged on windows it never fits,
does not pay for that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import torch

from tcal.data.documents import every_nth, token_windows
from tcal.init.calibration.calibrate import ArtifactStore, Recipe, artifact_key, calibrate_group, calibrate_shared
from tcal.init.calibration.phase1 import apply_phase1
from tcal.init.calibration.phase2 import LayerStack, layer_groups, stack_metrics
from tcal.runtime.distributed import Ranks
from tcal.runtime.progress import progress
from tcal.settings.init import Phase1Settings, PoolPhase2Settings
from tcal.settings.schedule import lr_factor
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


class PoolDraws:
    """`full_plus`'s windows for `phase2.fit_stack`: layer l's step fits `phase2.batch_size` windows of fit =
    (inputs [L, N, T, D], targets), drawn by `generators[l]`; the loss on held_out ([L, M, T, D] each), every
    `phase2.select_every` steps and after the last one, picks the state each layer keeps. `phase2.schedule` shapes
    the learning rate over the steps. Its records hold each layer's held-out curve."""

    def __init__(self, fit: tuple, held_out: tuple, phase2: PoolPhase2Settings, generators: list[torch.Generator]):
        steps, self.every = int(phase2.steps), int(phase2.select_every)
        self.fit, self.held_out, self.curve = fit, held_out, []  # curve: (step, [L] MSE, [L] cosine), on the device
        draws = [minibatches(fit[0].shape[1], int(phase2.batch_size), steps, g) for g in generators]
        self.draws = torch.stack(draws).to(fit[0].device)
        self.rows = torch.arange(len(generators), device=fit[0].device)[:, None]
        self.tokens = int(phase2.batch_size) * fit[0].shape[2]
        self.factor = lr_factor(phase2.schedule, steps, setting="phase2.schedule")

    def start(self, stack: LayerStack) -> None:
        pass

    def windows(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.draws[:, step]
        return self.fit[0][self.rows, windows], self.fit[1][self.rows, windows]

    def selection_loss(self, stack: LayerStack, step: int, losses: torch.Tensor) -> torch.Tensor | None:
        return self.last_loss(stack, step) if step % self.every == 0 else None

    def last_loss(self, stack: LayerStack, step: int) -> torch.Tensor:
        self.curve.append((step, *stack_metrics(stack, *self.held_out)))
        return self.curve[-1][1]

    def records(self, stack: LayerStack, fit) -> list[dict]:
        read = [(step, mse.tolist(), cosine.tolist()) for step, mse, cosine in self.curve]
        records = []
        for l, best_step in enumerate(fit.best.step.tolist()):
            layer_curve = [[step, mse[l], cosine[l]] for step, mse, cosine in read]
            first, kept = layer_curve[0], next(c for c in layer_curve if c[0] == best_step)
            records.append({"held_out_loss_before": first[1], "held_out_cosine_before": first[2],
                            "held_out_loss_after": kept[1], "held_out_cosine_after": kept[2], "best_step": best_step,
                            "held_out_curve": layer_curve, "losses": fit.layer_losses(l)})
        return records


def calibrate_on_pool(teacher, gdns: dict[int, GatedDeltaNet], pool: CalibrationPool, phase1_rules,
                      phase1: Phase1Settings, phase2: PoolPhase2Settings, settings: dict, store: ArtifactStore,
                      seed: int, block_size: int, layers_per_pass: int | None = None,
                      ranks: Ranks | None = None, fit: str = "batched",
                      fit_size: int | None = None) -> dict[int, dict]:
    """Phase 1 rules `phase1_rules` on the fit windows' statistics, then Phase 2 on the pool (`PoolDraws`), per
    layer (in place); each layer cached under a key of everything it depends on (`settings` must hold every knob).
    The teacher-forced tensors of a pool are large (about 0.1 GB per SmolLM2 layer), so with `layers_per_pass`
    the teacher runs once per group of that many layers and keeps only that group's tensors: more teacher
    passes, less memory, the same result (a layer's statistics do not depend on which others are recorded; on a
    GPU, where a pass's layers share one batched fit, the same up to float rounding). `fit`: `calibration.fit`, the
    group's Phase 2 fits stacked `fit_size` = `calibration.layers_per_fit` at a time (`batched`) or one layer at a
    time (`sequential`)."""
    keys = {i: artifact_key(teacher, i, ["full_plus"], pool.fit, {**settings, "seed": seed}, gdn, pool.held_out)
            for i, gdn in gdns.items()}
    recipe = Recipe(phase1=lambda gdn, stats: apply_phase1(gdn, stats, phase1, rules=tuple(phase1_rules)),
                    phase2=phase2, fit=fit, fit_size=fit_size, block_size=block_size, log_fit=log_pool_fit,
                    source=lambda layers, windows, held_out: PoolDraws(windows, held_out, phase2,
                                                                       [layer_generator(seed, i) for i in layers]))

    def calibrate_some(todo: list[int]) -> Iterator[tuple[int, dict]]:
        log.info("full_plus: layers %s on a pool of %d + %d held-out windows", todo, len(pool.fit),
                 len(pool.held_out))
        with progress(total=len(todo) * int(phase2.steps), desc="calibrate full_plus", unit="step") as bar:
            for group in layer_groups(todo, layers_per_pass):
                yield from calibrate_group(teacher, gdns, group, pool.fit, pool.held_out, recipe, bar)

    return calibrate_shared(gdns, keys, store, ranks or Ranks(), calibrate_some)


def log_pool_fit(layer: int, p2: dict) -> None:
    log.info("layer %d full_plus: held-out loss %.4g -> %.4g (step %d), cosine %.3f -> %.3f", layer,
             p2["held_out_loss_before"], p2["held_out_loss_after"], p2["best_step"],
             p2["held_out_cosine_before"], p2["held_out_cosine_after"])
