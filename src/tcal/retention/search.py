"""`retention.search=greedy`: the `recall` keep list improved on the converted student itself (docs/method.md,
"Retained-layer policies": the search); `retention.search=prune`: backward elimination from a larger keep list by the
same students' figures (`prune_search`; docs/method.md, the elimination).

The recall score is read on the teacher with one layer bypassed at a time, so a retriever's need of a neighbour that
shows only once the neighbours are converted is invisible to it. The search measures students instead: a candidate
keeps a set S softmax and converts every other layer with the run's init mode, and on the probe's needle sequences
gives, per sequence p, the mean NLL of the answer tokens `A_p(S)` and of the text tokens `T_p(S)`. From the rule's
keep list S0 (`z = noise_z`, paired means and standard errors over the P sequences):

    add pass   g_j = mean_p (A_p(S0) - A_p(S0 + j))  for every converted j; j is a candidate when g_j - z se_j > 0
    swaps      S + j - i is accepted when  mean_p T_p(S + j - i) - mean_p T_p(S0) <= text_margin
                                      and  mean_p (A_p(S) - A_p(S + j - i)) - z se > 0

with the candidates j by descending gain and the removable layers i (the fill's, never the score's) by ascending text
rise, the first accepted i taken; an accepted j stays. It stops when `search_budget` student forwards are spent (the
start's included) or no candidate is left.

Every layer is initialized once (`initialized_gdns`, cached per layer, as for `ga_s2`), so a candidate is an assembly
and a forward: one model whose mixers are swapped in place, whose forward replays S0's recorded layer outputs below
the first layer where the candidate differs from S0 (those layers and their inputs are S0's).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext

import torch

from tcal.retention import Selection
from tcal.retention.cache import score_folder, selection_key
from tcal.retention.ga_s2 import initialized_gdns
from tcal.retention.probe import earlier_layers_replayed, layer_outputs_recorded, probe_sequences, sequence_losses
from tcal.runtime.progress import progress
from tcal.settings.fields import INIT, KEEP
from tcal.settings.retention import num_kept
from tcal.store.cache import get_or_build, json_codec
from tcal.student.convert import build_student
from tcal.student.hybrid import LINEAR, teacher_layer_types
from tcal.teachers import adapter_for

log = logging.getLogger(__name__)


class Students:
    """Students of one teacher that differ only in their keep sets, each measured on the same sequences
    (`losses(keep)`: `sequence_losses` per sequence, [[A_p, T_p]]).

    One model: a kept layer runs the teacher's own attention module, a converted layer j the initialized `gdns[j]`,
    swapped in place for each candidate. The first candidate measured is the reference; its decoder layers' outputs
    are recorded, and every later candidate replays them below the first layer where the two keep sets differ (its
    losses are those of a full forward: the layers below and their inputs are the reference's). A candidate measured
    with `record=True` becomes the reference instead (the elimination re-records each step's set, so that a
    candidate computes only its removed layer and those above it). `forwards` counts the candidates measured."""

    def __init__(self, teacher, gdns: dict, ids: torch.Tensor, labels: torch.Tensor, batch_size: int,
                 gqa_expansion: str = "whole_head", seed: int = 0):
        self.teacher, self.gdns = teacher, gdns
        self.own = teacher_layer_types(teacher.config)
        self.adapter = adapter_for(teacher.config)
        self.model = build_student(teacher, list(range(len(self.own))), gqa_expansion, seed)
        self.model.to(next(teacher.parameters()).device).eval()
        self.batches = [(ids[s:s + batch_size], labels[s:s + batch_size]) for s in range(0, ids.shape[0], batch_size)]
        self.reference: set[int] | None = None
        self.recorded: list[list] = []
        self.forwards = 0

    def assemble(self, keep: set[int]) -> None:
        for j, layer in enumerate(self.adapter.decoder_layers(self.model)):
            layer.self_attn = self.adapter.attention(self.teacher, j) if j in keep else self.gdns[j]
        self.model.config.layer_types = [kind if j in keep else LINEAR for j, kind in enumerate(self.own)]

    def losses(self, keep, record: bool = False) -> list[list[float]]:
        """The candidate's [[A_p, T_p]]; with `record` (and for the first candidate) it becomes the reference: its
        layers' outputs are recorded (those it replays included), so later candidates replay below their first
        difference from it."""
        keep = set(keep)
        self.assemble(keep)
        self.forwards += 1
        first = 0 if self.reference is None else min(keep ^ self.reference, default=len(self.own))
        record = record or self.reference is None
        rows: list[list[float]] = []
        recorded: list[list] = []
        for b, (ids, labels) in enumerate(self.batches):
            earlier = self.recorded[b] if self.recorded else []
            with earlier_layers_replayed(self.model, earlier, first), \
                    (layer_outputs_recorded(self.model) if record else nullcontext([])) as outputs:
                rows += sequence_losses(self.model, ids, labels)
            recorded.append(outputs)
        if record:
            self.reference, self.recorded = keep, recorded
        return rows


def paired_drop(before: list[list[float]], after: list[list[float]], column: int = 0) -> tuple[float, float]:
    """(mean_p (before_p - after_p), its standard error over the sequences) of one column of two `losses` results
    (0: answer, 1: text)."""
    drop = torch.tensor([b[column] - a[column] for b, a in zip(before, after)], dtype=torch.float64)
    n = drop.numel()
    return float(drop.mean()), float(drop.std(correction=1)) / math.sqrt(n) if n > 1 else math.inf


def mean_column(rows: list[list[float]], column: int) -> float:
    return float(torch.tensor([r[column] for r in rows], dtype=torch.float64).mean())


def greedy_search(measure, start: list[int], removable: list[int], add_order: list[int], budget: int,
                  text_margin: float, noise_z: float) -> dict:
    """The search from keep list `start` (docs/method.md, "Retained-layer policies": the search): `measure(keep)`
    gives a candidate's losses ([[A_p, T_p]] per sequence, one forward each); `removable`, the layers of `start` a
    swap may give up, cheapest first; `add_order`, the converted layers in the order the add pass measures them.
    Returns {"keep", "swaps" (the accepted ones, "+j-i"), "path" (every set measured: its move, keep list, mean
    answer and text loss, per-sequence losses, the decision's figures), "forwards", "stopped", and the settings it
    ran with}."""
    path: list[dict] = []
    swaps: list[str] = []
    z = float(noise_z)

    def done(keep, why: str) -> dict:
        return {"keep": sorted(keep), "swaps": swaps, "path": path, "forwards": len(path), "budget": int(budget),
                "stopped": why, "text_margin": float(text_margin), "noise_z": z}

    def step(keep, move: str) -> dict:
        rows = measure(sorted(keep))
        entry = {"move": move, "keep": sorted(keep), "answer": mean_column(rows, 0), "text": mean_column(rows, 1),
                 "losses": rows}
        path.append(entry)
        return entry

    if not removable:
        return done(start, "nothing removable: the score chose every kept layer")
    if budget < 1:
        return done(start, "budget")
    first = step(start, "start")
    gains: dict[int, tuple[float, float]] = {}
    for j in add_order:
        if len(path) >= budget:
            return done(start, "budget")
        entry = step([*start, j], f"add {j}")
        gain, se = paired_drop(first["losses"], entry["losses"])
        entry.update(gain=gain, se=se, candidate=bool(gain - z * se > 0))
        gains[j] = (gain, se)
    candidates = sorted((j for j, (g, se) in gains.items() if g - z * se > 0), key=lambda j: (-gains[j][0], j))
    keep, current, removable = set(start), first, list(removable)
    for j in candidates:
        for i in removable:
            if len(path) >= budget:
                return done(keep, "budget")
            entry = step((keep - {i}) | {j}, f"swap +{j} -{i}")
            text_rise = entry["text"] - first["text"]
            drop, se = paired_drop(current["losses"], entry["losses"])
            accepted = bool(text_rise <= text_margin and drop - z * se > 0)
            entry.update(text_rise=text_rise, answer_drop=drop, se=se, accepted=accepted)
            if accepted:
                keep, current = set(entry["keep"]), entry
                removable.remove(i)
                swaps.append(f"+{j}-{i}")
                break
    return done(keep, "no candidate left" if candidates else "no layer's gain above the noise")


def prune_search(measure, start: list[int], target: int, budget: int, text_margin: float) -> dict:
    """Backward elimination from keep list `start` down to `target` layers (docs/method.md, "Retained-layer
    policies": the elimination): `measure(keep, record)` gives a candidate's losses ([[A_p, T_p]] per sequence, one
    forward each; `record`: the candidate becomes the set later candidates replay from). Each step measures the
    current set S less each of its layers in turn and removes the layer i whose student has the lowest mean answer
    loss among those whose mean text loss is within `text_margin` of the step's lowest (ties: the lower index).
    Returns {"method": "prune", "keep", "removed" (in order), "steps" (each step's set, its figures, the layer
    removed, its forwards and seconds), "path" (every forward: its move, keep list, mean answer and text loss,
    per-sequence losses, wall and CPU seconds (the CPU seconds of the process: on a shared core, what one thread
    spent); a candidate's paired rises over S with their standard errors and whether the text margin
    let it be chosen), "forwards", "stopped", and the settings it ran with}."""
    path: list[dict] = []
    steps: list[dict] = []
    removed: list[int] = []

    def done(keep, why: str) -> dict:
        return {"method": "prune", "keep": sorted(keep), "removed": removed, "steps": steps, "path": path,
                "forwards": len(path), "budget": int(budget), "target": int(target), "stopped": why,
                "text_margin": float(text_margin)}

    def forward(keep, move: str, step: int, record: bool = False) -> dict:
        begun, begun_cpu = time.perf_counter(), time.process_time()
        rows = measure(sorted(keep), record)
        entry = {"move": move, "step": step, "keep": sorted(keep), "answer": mean_column(rows, 0),
                 "text": mean_column(rows, 1), "losses": rows, "seconds": round(time.perf_counter() - begun, 3),
                 "cpu_seconds": round(time.process_time() - begun_cpu, 3)}
        path.append(entry)
        log.info("retention recall prune: forward %d of at most %d (%s, %d kept): answer %.4f, text %.4f; %.1f s "
                 "(%.1f s of CPU)", len(path), budget, move, len(entry["keep"]), entry["answer"], entry["text"],
                 entry["seconds"], entry["cpu_seconds"])
        return entry

    keep = sorted(start)
    if len(keep) <= target:
        return done(keep, f"the start keeps {len(keep)} layers, no more than the target {target}")
    if budget < 1:
        return done(keep, "budget")
    current = forward(keep, "start", 0, record=True)
    while len(keep) > target:
        step, begun, begun_cpu, before = len(steps) + 1, time.perf_counter(), time.process_time(), len(path)
        if step > 1:
            if len(path) >= budget:
                return done(keep, "budget")
            forward(keep, "record", step, record=True)
        candidates = []
        for i in keep:
            if len(path) >= budget:
                return done(keep, "budget")
            entry = forward([j for j in keep if j != i], f"remove {i}", step)
            answer_rise, answer_se = paired_drop(entry["losses"], current["losses"], 0)
            text_rise, text_se = paired_drop(entry["losses"], current["losses"], 1)
            entry.update(layer=i, answer_rise=answer_rise, answer_se=answer_se, text_rise=text_rise, text_se=text_se)
            candidates.append(entry)
        lowest_text = min(c["text"] for c in candidates)
        for c in candidates:
            c["within_text_margin"] = bool(c["text"] - lowest_text <= text_margin)
        chosen = min((c for c in candidates if c["within_text_margin"]), key=lambda c: (c["answer"], c["layer"]))
        steps.append({"step": step, "keep": list(keep), "answer": current["answer"], "text": current["text"],
                      "removed": chosen["layer"], "forwards": len(path) - before,
                      "seconds": round(time.perf_counter() - begun, 3),
                      "cpu_seconds": round(time.process_time() - begun_cpu, 3)})
        log.info("retention recall prune, step %d: %d kept (answer %.3f, text %.3f) -> removed %d (answer %.3f, "
                 "text %.3f; %d forwards, %.1f s)", step, len(keep), current["answer"], current["text"],
                 chosen["layer"], chosen["answer"], chosen["text"], len(path) - before, time.perf_counter() - begun)
        removed.append(chosen["layer"])
        keep, current = chosen["keep"], chosen
    return done(keep, "target reached")


def cached_search(retention, ctx, run, initializes: bool) -> dict:
    """A search's record: `run(measure)` (`measure(keep, record=False)`: one student forward over the probe's
    sequences, counted against `search_budget` by a progress bar), with its seconds, the seconds of initializing
    every layer and the init; cached beside the probe's losses (keyed by the probe's settings, the init and the keep
    settings). `initializes`: whether the search measures any student (else no layer is initialized)."""
    key, parts = selection_key(retention, ctx, (INIT, KEEP))

    def compute() -> dict:
        begun = time.perf_counter()
        gdns = initialized_gdns(ctx) if initializes else {}
        init_seconds = round(time.perf_counter() - begun, 3)

        def search() -> dict:
            begun = time.perf_counter()
            students = None
            if initializes:
                ids, labels = probe_sequences(retention, ctx)
                students = Students(ctx.teacher, gdns, ids, labels, int(retention.batch_size),
                                    ctx.settings.init.gqa_expansion, int(ctx.settings.seed))
            with progress(total=int(retention.search_budget), unit="student",
                          desc=f"retention recall search={retention.search} ({ctx.settings.init.name}): "
                               f"forwards") as bar:
                def measure(keep, record: bool = False):
                    rows = students.losses(keep, record)
                    bar.update(1)
                    return rows

                result = run(measure)
            return {**result, "seconds": round(time.perf_counter() - begun, 3), "init_seconds": init_seconds,
                    "init": str(ctx.settings.init.name)}

        return ctx.ranks.decide(search)

    codec = json_codec(lambda value: {"key": key, "parts": parts, "value": value}, lambda record: record["value"])
    return get_or_build("retention", f"recall-search-{key}", compute, folder=score_folder(retention, ctx),
                        codec=codec, ranks=ctx.ranks)


def searched(retention, ctx, selection: Selection, text_rise: dict[int, float],
             answer_rise: dict[int, float]) -> Selection:
    """`selection` (the rule's) with its keep list searched on the student (`search=greedy`); the search's record in
    `details["search"]`, cached beside the probe's losses (keyed by them, the init and the keep settings)."""
    num_layers = ctx.num_layers
    chosen = set(selection.details["scored_layers"])
    start = selection.keep_layers
    removable = sorted((i for i in start if i not in chosen), key=lambda i: (text_rise[i], i))
    add_order = sorted((j for j in range(num_layers) if j not in start), key=lambda j: (-answer_rise[j], j))

    def run(measure) -> dict:
        result = greedy_search(measure, start, removable, add_order, int(retention.search_budget),
                               float(retention.text_margin), float(retention.noise_z))
        return {**result, "start": list(start)}

    result = cached_search(retention, ctx, run, initializes=bool(removable))
    log.info("retention recall search (%s init): %s -> keep %s, swaps %s (%d of %d forwards, %s; %.1f s)",
             result["init"], start, result["keep"], " ".join(result["swaps"]) or "none", result["forwards"],
             result["budget"], result["stopped"], result["seconds"])
    return Selection(result["keep"], selection.scores, {**selection.details, "search": result})


def pruned(retention, ctx, start: list[int], selection: Selection | None = None) -> Selection:
    """The keep list of `search=prune`: backward elimination from `start` (the rule's list at `prune_from_ratio`,
    whose `selection` at `ratio` gives the scores and details kept beside the search, or `prune_from`) down to
    `ratio`'s count; the elimination's record in `details["search"]`, cached as greedy's is."""
    target = num_kept(retention.ratio, ctx.num_layers)
    start = sorted(int(i) for i in start)

    def run(measure) -> dict:
        result = prune_search(measure, start, target, int(retention.search_budget), float(retention.text_margin))
        return {**result, "start": start, "prune_from": "given" if retention.prune_from is not None else
                f"rule at prune_from_ratio={retention.prune_from_ratio}"}

    result = cached_search(retention, ctx, run, initializes=len(start) > target)
    log.info("retention recall prune (%s init): %d kept %s -> %d kept %s, removed %s (%d of %d forwards, %s; %.1f s)",
             result["init"], len(start), start, len(result["keep"]), result["keep"],
             " ".join(map(str, result["removed"])) or "none", result["forwards"], result["budget"], result["stopped"],
             result["seconds"])
    details = selection.details if selection is not None else {}
    scores = selection.scores if selection is not None else {}
    return Selection(result["keep"], scores, {**details, "search": result})
