"""The runs of a folder and the figures made of them: every results.json below a folder read into a `Run` (failed,
incomplete and damaged records kept apart, each with why), runs of one init told apart by the result settings
that differ; the zero-shot, phase-ablation, token-efficiency, after-training, retrieval and by-position tables
with their Markdown and CSV forms, and the curves' and positions' plots. `tcal-report` (`tcal.tools.report`)
writes them; the W&B dashboard (`tcal.tools.dashboard`) builds on them."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tcal.evaluate.local_tasks import nlu_average
from tcal.store.files import flatten, write_atomic, write_text_atomic
from tcal.store.record import COPIES, RESULTS, RecordError, load_record, recorded_num_layers, recorded_setting

INIT_ORDER = ("naive", "zero_gate", "small_gate", "phase1", "phase2", "full", "full_plus")
POLICY_ORDER = ("uniform", "ar", "ga_s2", "recall", "explicit")  # the paper's table order
ABLATION_INITS = ("naive", "zero_gate", "phase1", "phase2", "full")
TARGET_MULTIPLES = (1.10, 1.15, 1.20, 1.25, 1.5, 2.0, 3.0)
MISSING = "-"

Table = tuple[list[str], list[list[str]]]


# --- formatting: every number in the report goes through one of these ---

def fmt_ppl(x: float | None) -> str:
    if x is None:
        return MISSING
    if not math.isfinite(x):
        return "non-finite"
    return f"{x:,.1f}" if x > 1000 else f"{x:.2f}"


def fmt_ratio(x: float | None, bound: str = "") -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{bound}inf" if math.isinf(x) else f"{bound}{x:.2f}x"


def fmt_score(x: float | None) -> str:
    return MISSING if x is None else f"{x:.3f}"


def fmt_tokens(n: int) -> str:
    return f"{n:,}"


# --- loading ---

class IncompleteRun(Exception):
    """A results.json the tables cannot use; the message says why."""


class FailedRun(IncompleteRun):
    """A run that failed: the message is its error and how far it got."""


@dataclass
class Run:
    """One complete results.json, flattened to what the tables need."""

    path: Path
    teacher: str
    policy: str
    ratio: float
    init_mode: str
    gqa_expansion: str
    teacher_ppl: dict[str, float]
    student_ppl: dict[str, float]
    nlu: dict[str, float | None]     # role ("teacher" / "student") -> NLU average
    ruler: dict[str, float | None]   # role -> mean over lengths and tasks
    curve: list[tuple[int, dict[str, float]]]
    stage: str = "none"               # the training stages the run ended with (none = zero-shot)
    tokens_trained: int = 0           # tokens seen over all its stages
    by_position: dict[str, list[dict]] = field(default_factory=dict)  # eval set -> buckets (results.json's)
    config: dict = field(default_factory=dict)  # the recorded settings, {"a.b": value}
    reported_keys: frozenset = frozenset()  # those of them that change what the run reports (result or evaluation)
    variant: str = ""                 # the settings that tell it from runs of the same group, init and stage
    variant_keys: tuple[str, ...] = ()  # their keys ("calibration.seq_len", ...)
    ruler_cells: dict = field(default_factory=dict)  # role -> {(length, task): (exact match, examples)}
    keep_layers: list[int] = field(default_factory=list)
    num_layers: int = 0
    retention_details: dict = field(default_factory=dict)  # results.json's (recall: ranks, scoring seconds)
    retention_seconds: float | None = None  # the run's retention step (scoring, or reading the cached scores)

    @property
    def group(self) -> tuple[str, str, float]:
        return (self.teacher, self.policy, self.ratio)

    @property
    def init(self) -> str:
        """The init mode, marked with a non-default GQA expansion and with the run's variant settings:
        `full (row_repeat)`, `full_plus (calibration.seq_len=2048)`."""
        marks = [mark for mark in (self.gqa_expansion != "whole_head" and self.gqa_expansion, self.variant) if mark]
        return f"{self.init_mode} ({'; '.join(marks)})" if marks else self.init_mode


def load_run(path: Path) -> Run:
    """One results.json as a Run; RecordError when it is damaged or of an unknown schema version (it names the
    field), FailedRun or IncompleteRun when its run failed or has not finished."""
    data = load_record(path)
    status = data["status"]
    if status == "failed":
        raise FailedRun(f"{data['error']} (after: {data['failed_after'] or 'nothing'})")
    if status != "complete":
        raise IncompleteRun(f"status is {status!r}")
    return _normalize(Path(path), data)


def _normalize(path: Path, data: dict) -> Run:
    metrics, num_layers = data["metrics"], recorded_num_layers(data)
    teacher, policy, ratio, init_mode, gqa_expansion, stage = (recorded_setting(data, key) for key in COPIES)
    if ratio is None:
        ratio = len(data["keep_layers"]) / num_layers
    if not _ppl_by_set(metrics, "student_ppl"):
        raise IncompleteRun("'metrics' holds no student perplexity (no eval set, or each null: NaN or infinite)")
    harness, ruler = data.get("harness") or {}, data.get("ruler") or {}
    return Run(
        path=path, teacher=teacher, policy=policy, ratio=round(float(ratio), 4), init_mode=init_mode,
        gqa_expansion=gqa_expansion,
        teacher_ppl=_ppl_by_set(metrics, "teacher_ppl"), student_ppl=_ppl_by_set(metrics, "student_ppl"),
        nlu={role: nlu_average(harness[role]) if harness.get(role) else None for role in ("teacher", "student")},
        ruler={role: _mean(v for by_task in (ruler.get(role) or {}).values() for v in by_task.values()
                           if v is not None) for role in ("teacher", "student")},
        curve=_curve_points(data.get("curve") or {}),
        by_position={name: [_position_bucket(b) for b in m["by_position"]] for name, m in metrics.items()
                     if m.get("by_position")},
        stage=stage, tokens_trained=sum(r["tokens_seen"] for r in (data.get("stages") or {}).values()),
        config=flatten(data.get("config") or {}), reported_keys=reported_keys(data.get("config") or {}),
        ruler_cells={role: _ruler_cells(ruler, role, data.get("config") or {}) for role in ("teacher", "student")},
        keep_layers=list(data["keep_layers"]), num_layers=int(num_layers),
        retention_details=data.get("retention_details") or {},
        retention_seconds=(data.get("timings") or {}).get("retention"),
    )


def _number(value) -> float:
    """A recorded number; null (a NaN or infinite value, `tcal.store.record`) is NaN here: shown as non-finite."""
    return math.nan if value is None else float(value)


def _ruler_cells(ruler: dict, role: str, config: dict) -> dict:
    """{(length, task): (exact match, examples)}: examples from the record's `n`, else from its config's
    `eval.ruler.n` (records written before `n` was recorded)."""
    default_n = ((config.get("eval") or {}).get("ruler") or {}).get("n")
    counts = ruler.get("n") or {}
    return {(length, task): (score, (counts.get(length) or {}).get(task, default_n))
            for length, by_task in (ruler.get(role) or {}).items() for task, score in by_task.items()}


def _position_bucket(bucket: dict) -> dict:
    return {"start": int(bucket["start"]), "end": int(bucket["end"]), "teacher_ppl": _number(bucket["teacher_ppl"]),
            "student_ppl": _number(bucket["student_ppl"])}


def _curve_points(curve: dict) -> list[tuple[int, dict[str, float]]]:
    """results.json's {eval set: [{"tokens", "ppl"}, ...]} as [(tokens, {eval set: ppl}), ...] by tokens; a point
    recorded as null (non-finite: the stage diverged there) has no value to plot or reach and is left out."""
    by_tokens: dict[int, dict[str, float]] = {}
    for eval_set, points in curve.items():
        for point in points:
            if point["ppl"] is not None:
                by_tokens.setdefault(int(point["tokens"]), {})[eval_set] = float(point["ppl"])
    return sorted(by_tokens.items())


def _ppl_by_set(metrics: dict, key: str) -> dict[str, float]:
    return {name: float(m[key]) for name, m in metrics.items() if isinstance(m, dict) and m.get(key) is not None}


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


@dataclass
class Collected:
    """Every results.json below a folder, sorted out: the usable runs, (path, error) of the failed ones,
    (path, reason) of the unfinished or unusable ones, and the records that cannot be read (RecordError)."""

    runs: list[Run] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)
    incomplete: list[tuple[Path, str]] = field(default_factory=list)
    damaged: list[RecordError] = field(default_factory=list)


def record_paths(folder: Path) -> list[Path]:
    """Every results.json below `folder`, following symlinked folders (a sweep linked into a project folder) and
    listing each record once however many links reach it; a link that loops back is followed once."""
    found, seen_dirs, seen_files = [], set(), set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen_dirs:
            dirs[:] = []
            continue
        seen_dirs.add(real)
        dirs.sort()
        if RESULTS in files:
            path = Path(root) / RESULTS
            if os.path.realpath(path) not in seen_files:
                seen_files.add(os.path.realpath(path))
                found.append(path)
    return sorted(found)


def collect(folder: Path) -> Collected:
    """Every results.json below `folder`, sorted out. Runs of the same group, init and stage that differ in a
    setting that changes the student or its evaluation (a sweep over `calibration.seq_len` or `eval.seq_len`, say)
    each get those settings as their variant; of two that differ in none, the second is listed as incomplete."""
    found, usable = Collected(), []
    for path in record_paths(Path(folder)):
        try:
            usable.append(load_run(path))
        except RecordError as err:
            found.damaged.append(err)
        except FailedRun as err:
            found.failed.append((path, str(err)))
        except IncompleteRun as err:
            found.incomplete.append((path, str(err)))
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as err:  # one odd record never hides the others
            found.incomplete.append((path, f"cannot be reported ({type(err).__name__}: {err})"))
    alike: dict[tuple, list[Run]] = {}
    for run in usable:
        alike.setdefault((run.group, run.init, run.stage), []).append(run)
    for runs in alike.values():
        _name_variants(runs)
    seen = {}
    for run in usable:
        key = (run.group, run.init, run.stage)
        if key in seen:
            found.incomplete.append((run.path, f"duplicate of {seen[key]} (same teacher, policy, ratio, init, stage, "
                                               f"student and evaluation settings); ignored"))
            continue
        seen[key] = run.path
        found.runs.append(run)
    return found


def reported_keys(config: dict) -> frozenset:
    """The keys of a recorded config whose settings change what the run reports: its result or its evaluation
    figures, as the settings' fields declare it (`tcal.settings.fields`). A config this tcal cannot read as settings
    (an older record) is judged by today's fields of the same keys; a key no field has counts."""
    from tcal.errors import ConfigError
    from tcal.settings import RunSettings
    from tcal.settings.conversion import run_settings
    from tcal.settings.relevance import levels

    try:
        known = levels(run_settings(config))
    except (ConfigError, TypeError, ValueError):
        known = levels(RunSettings())
    return frozenset(key for key in flatten(config) if known.get(key, "result") in ("result", "eval"))


def _name_variants(runs: list[Run]) -> None:
    """Set each run's variant to its values of the reported settings that differ among `runs` (settings that change
    nothing aside), so no run of a sweep over such a setting, an evaluation setting included, hides another in the
    tables. Only settings all of them recorded count: a record older than a setting holds no value for it."""
    if len(runs) < 2:
        return
    common = set.intersection(*(set(run.config) for run in runs))
    counted = common & set.union(*(set(run.reported_keys) for run in runs))
    differing = sorted(key for key in counted if any(run.config.get(key) != runs[0].config.get(key) for run in runs))
    for run in runs:
        run.variant = ", ".join(f"{key}={_setting(run.config.get(key))}" for key in differing)
        run.variant_keys = tuple(differing)


def _setting(value) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)


# --- tables ---

ZERO_SHOT_STAGES = ("none",)
EFFICIENCY_STAGES = ("distill", "align_distill", "none")  # Stage 2 curves first


def _groups(runs: list[Run], stages=ZERO_SHOT_STAGES) -> dict[tuple, dict[str, Run]]:
    """{(teacher, policy, ratio): {init: run}}, each init's run taken from the first of `stages` it has."""
    groups: dict[tuple, dict[str, Run]] = {}
    for run in sorted((r for r in runs if r.stage in stages), key=lambda r: stages.index(r.stage), reverse=True):
        groups.setdefault(run.group, {})[run.init] = run
    return dict(sorted(groups.items(), key=lambda item: group_order(item[0])))


def _rank(name: str, order: tuple[str, ...]) -> int:
    """Position of `name` in `order`; names not listed come after all of them."""
    return order.index(name) if name in order else len(order)


def group_order(group: tuple) -> tuple:
    """Sort key of a (teacher, policy, ratio) group: by teacher, policies in the paper's order, then by ratio (the
    order of the report's tables and of the dashboard's sections)."""
    teacher, policy, ratio = group
    return teacher, _rank(policy, POLICY_ORDER), policy, ratio


def init_order(mode: str) -> tuple:
    """Sort key of an init mode: INIT_ORDER, then any other mode by name."""
    return _rank(mode, INIT_ORDER), mode


def _init_columns(runs: list[Run]) -> list[str]:
    """Whole-head inits in INIT_ORDER, then each other GQA expansion's inits in the same order."""
    def order(run: Run):
        mode = run.init_mode
        return run.gqa_expansion != "whole_head", run.gqa_expansion, *init_order(mode), _natural(run.init)
    return list(dict.fromkeys(run.init for run in sorted(runs, key=order)))


def _natural(text: str) -> list:
    """Sort key reading digit runs as numbers: `seq_len=256` before `seq_len=2048`."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def _eval_sets(by_init: dict[str, Run]) -> list[str]:
    return sorted({s for run in by_init.values() for s in (*run.student_ppl, *run.teacher_ppl)})


def _teacher_value(by_init: dict[str, Run], get):
    return next((v for run in by_init.values() if (v := get(run)) is not None), None)


def _row_head(group: tuple, eval_set: str) -> list[str]:
    teacher, policy, ratio = group
    return [teacher, policy, f"{ratio:g}", eval_set]


def zero_shot_table(runs: list[Run]) -> Table:
    inits = _init_columns(runs)
    nlu_inits = [i for i in inits if any(r.init == i and r.nlu["student"] is not None for r in runs)]
    ruler_inits = [i for i in inits if any(r.init == i and r.ruler["student"] is not None for r in runs)]
    extra = [name for name, attr in (("teacher NLU avg", "nlu"), ("teacher RULER", "ruler"))
             if any(getattr(r, attr)["teacher"] is not None for r in runs)]
    header = ["teacher", "policy", "ratio", "eval set", "teacher PPL", *inits,
              *extra, *(f"NLU avg {i}" for i in nlu_inits), *(f"RULER {i}" for i in ruler_inits)]
    rows = []
    for group, by_init in _groups(runs).items():
        teacher_scores = {"teacher NLU avg": _teacher_value(by_init, lambda r: r.nlu["teacher"]),
                          "teacher RULER": _teacher_value(by_init, lambda r: r.ruler["teacher"])}
        for eval_set in _eval_sets(by_init):
            rows.append([
                *_row_head(group, eval_set),
                fmt_ppl(_teacher_value(by_init, lambda r: r.teacher_ppl.get(eval_set))),
                *(fmt_ppl(by_init[i].student_ppl.get(eval_set)) if i in by_init else MISSING for i in inits),
                *(fmt_score(teacher_scores[name]) for name in extra),
                *(fmt_score(by_init[i].nlu["student"]) if i in by_init else MISSING for i in nlu_inits),
                *(fmt_score(by_init[i].ruler["student"]) if i in by_init else MISSING for i in ruler_inits),
            ])
    return header, rows


def fmt_rate(p: float | None, n: int | None) -> str:
    """An exact-match rate with its binomial standard error and examples: `0.80 ± 0.06 (n=50)`."""
    from tcal.evaluate.ruler import standard_error

    if p is None or n is None:
        return MISSING
    return f"{p:.2f} ± {standard_error(p, int(n)):.2f} (n={int(n)})"


def fmt_summary(cell: dict | None) -> str:
    return MISSING if cell is None else f"{cell['mean']:.2f} ± {cell['se']:.2f} (n={cell['n']})"


def retrieval_table(runs: list[Run]) -> Table:
    """RULER per subtask and length, needle subtasks and the others apart beside the aggregate, each cell with its
    standard error and examples; with the converted layers, recall's ranks of the layers the report names
    (`RANKED_LAYERS`), perplexity per eval set and the retention step's seconds. A teacher row heads each teacher."""
    from tcal.evaluate.ruler import NEEDLE_TASKS, TASKS, cell_summary

    with_ruler = [r for r in runs if r.ruler_cells.get("student")]
    cells = sorted({c for r in with_ruler for role in ("teacher", "student") for c in r.ruler_cells[role]},
                   key=lambda c: (_rank(c[1], TASKS), c[1], int(c[0]) if c[0].isdigit() else c[0]))
    eval_sets = sorted({s for r in with_ruler for s in r.student_ppl})
    header = ["teacher", "policy", "variant", "ratio", "init", "stage", "GDN layers",
              *(f"recall rank of layer {i}" for i in RANKED_LAYERS),
              *(f"{task} @ {length}" for length, task in cells), "needle subtasks", "other subtasks", "all subtasks",
              *(f"PPL {s}" for s in eval_sets), "retention s"]

    def summaries(by_cell: dict) -> list[str]:
        pairs = [(task, p, n) for (length, task), (p, n) in by_cell.items() if n]
        return [fmt_summary(cell_summary([(p, n) for t, p, n in pairs if keep(t)]))
                for keep in (lambda t: t in NEEDLE_TASKS, lambda t: t not in NEEDLE_TASKS, lambda t: True)]

    rows, teachers_done = [], set()
    order = sorted(with_ruler, key=lambda r: (r.teacher, _rank(r.policy, POLICY_ORDER), r.policy, r.ratio,
                                              _rank(r.init_mode, INIT_ORDER), r.init, r.stage))
    for run in order:
        if run.teacher not in teachers_done and run.ruler_cells.get("teacher"):
            teachers_done.add(run.teacher)
            by_cell = run.ruler_cells["teacher"]
            rows.append([run.teacher, "-", "-", "1", "teacher", "-", "none", *(MISSING for _ in RANKED_LAYERS),
                         *(fmt_rate(*by_cell.get(c, (None, None))) for c in cells), *summaries(by_cell),
                         *(fmt_ppl(run.teacher_ppl.get(s)) for s in eval_sets), MISSING])
        by_cell = run.ruler_cells["student"]
        ranks = (run.retention_details or {}).get("rank") or {}
        converted = [i for i in range(run.num_layers) if i not in run.keep_layers]
        seconds = (run.retention_details or {}).get("seconds", run.retention_seconds)
        rows.append([run.teacher, run.policy, retention_variant(run.retention_details), f"{run.ratio:g}", run.init,
                     run.stage, " ".join(map(str, converted)) or "none",
                     *(str(ranks.get(str(i), MISSING)) for i in RANKED_LAYERS),
                     *(fmt_rate(*by_cell.get(c, (None, None))) for c in cells), *summaries(by_cell),
                     *(fmt_ppl(run.student_ppl.get(s)) for s in eval_sets),
                     MISSING if seconds is None else f"{float(seconds):.0f}"])
    return header, rows


RANKED_LAYERS = (7, 16, 18)  # SmolLM2's retrieving layers (docs/results.md, "Long context"): where recall ranks them


def retention_variant(details: dict | None) -> str:
    """How a recall run chose its layers, from its results.json `retention_details`: the probe (and its length),
    the scored layers and what chose them (the rule with its margin, or `scored=N`), the fill, and the search's
    accepted swaps with its forwards and budget, or the elimination's path (`search=prune`: the layers removed in
    order, from how many to how many); "-" for the other policies. Records written before the rule (no `rule`
    field) chose the `scored` highest, all kept when unset."""
    search = (details or {}).get("search")
    if search and search.get("method") == "prune" and "scored_layers" not in details:
        return f"prune_from={' '.join(map(str, search['start']))} {pruning(search)}"
    if not details or "scored_layers" not in details:
        return MISSING
    scored = details["scored_layers"]
    if "rule" not in details:
        how = f"scored={len(scored)}"
    elif details.get("scored") is None:
        how = f"rule z={details['noise_z']:g}"
    else:
        how = f"scored={details['scored']}"
    length = f"/{details['seq_len']}" if "seq_len" in details else ""
    variant = f"{details['probe']}{length} {how} ({' '.join(map(str, scored)) or 'none'}) fill={details['fill']}"
    if search and search.get("method") == "prune":
        variant += f" {pruning(search)}"
    elif search:
        variant += (f" search={' '.join(search['swaps']) or 'no swap'} ({search['forwards']}/{search['budget']} "
                    f"forwards, {search['init']})")
    return variant


def pruning(search: dict) -> str:
    """`search=prune` as the report names it: the elimination's path, its forwards and budget, why it stopped."""
    removed = " ".join(f"-{i}" for i in search["removed"]) or "nothing removed"
    return (f"search=prune {len(search['start'])}->{len(search['keep'])}: {removed} ({search['forwards']}/"
            f"{search['budget']} forwards, {search['stopped']}, {search['init']})")


def elimination_table(runs: list[Run]) -> Table:
    """The path of every `retention.search=prune` run, a row a step: the set's size, the layer removed, its student's
    mean answer and text loss on the probe's sequences with their paired rises over the set (± standard error),
    the set left, the step's forwards and its wall and CPU seconds."""
    header = ["teacher", "ratio", "init", "step", "kept", "removed", "answer NLL", "answer rise", "text NLL",
              "text rise", "kept after", "forwards", "seconds (CPU)"]
    rows = []
    for run in runs:
        search = (run.retention_details or {}).get("search") or {}
        if search.get("method") != "prune":
            continue
        by_layer = {(e["step"], e["layer"]): e for e in search["path"] if "layer" in e}
        for step in search["steps"]:
            chosen = by_layer[(step["step"], step["removed"])]
            rows.append([run.teacher, f"{run.ratio:g}", run.init, str(step["step"]), str(len(step["keep"])),
                         str(step["removed"]), f"{chosen['answer']:.3f}",
                         f"{chosen['answer_rise']:+.3f} ± {chosen['answer_se']:.3f}", f"{chosen['text']:.3f}",
                         f"{chosen['text_rise']:+.3f} ± {chosen['text_se']:.3f}", " ".join(map(str, chosen["keep"])),
                         str(step["forwards"]), f"{step['seconds']:.0f} ({step.get('cpu_seconds', 0):.0f})"])
    return header, rows


def ablation_table(runs: list[Run]) -> Table:
    """The paper's phase-ablation layout, one row per GQA expansion (plus `full_plus` when it ran)."""
    inits = [*ABLATION_INITS, *(["full_plus"] if any(r.init_mode == "full_plus" for r in runs) else [])]
    header = ["teacher", "policy", "ratio", "eval set", "GQA expansion", *inits, "naive/full", "phase2/full"]
    rows = []
    for group, by_init in _groups(runs).items():
        expansions = sorted({run.gqa_expansion for run in by_init.values()}, key=lambda g: (g != "whole_head", g))
        for eval_set in _eval_sets(by_init):
            for gqa in expansions:
                runs_here = {run.init_mode: run for run in by_init.values() if run.gqa_expansion == gqa}
                ppl = {i: runs_here[i].student_ppl.get(eval_set) if i in runs_here else None for i in inits}
                full = ppl["full"]
                ratios = [fmt_ratio(ppl[i] / full if ppl[i] is not None and full else None)
                          for i in ("naive", "phase2")]
                rows.append([*_row_head(group, eval_set), gqa, *(fmt_ppl(ppl[i]) for i in inits), *ratios])
    return header, rows


@dataclass
class Reach:
    """When a curve first gets to a target: kind is 'exact' (interpolated between the two evaluations around the
    crossing), 'upper' (already there at the first evaluation) or 'never' (not within the budget)."""

    tokens: int
    kind: str

    def cell(self) -> str:
        return {"exact": fmt_tokens(self.tokens), "upper": f"<={fmt_tokens(self.tokens)}",
                "never": "not reached"}[self.kind]


def reach(points: list[tuple[int, float]], target: float) -> Reach:
    """Tokens at which PPL first reaches `target`, linear in tokens and PPL between evaluations."""
    for index, (tokens, ppl) in enumerate(points):
        if ppl <= target:
            if index == 0:
                return Reach(tokens, "upper")
            before_tokens, before_ppl = points[index - 1]
            fraction = (before_ppl - target) / (before_ppl - ppl)
            return Reach(round(before_tokens + fraction * (tokens - before_tokens)), "exact")
    return Reach(points[-1][0], "never")


def efficiency_ratio(base: Reach, calibrated: Reach) -> str:
    """baseline tokens / calibrated tokens, as a bound when either side is only bounded."""
    if calibrated.kind == "never" or (base.kind == "upper" and calibrated.kind == "upper"):
        return "n/a"
    value = base.tokens / calibrated.tokens if calibrated.tokens else math.inf
    if base.kind == "upper":
        return fmt_ratio(value, "<=")
    return fmt_ratio(value, ">=" if base.kind == "never" or calibrated.kind == "upper" else "")


def _series(run: Run, eval_set: str) -> list[tuple[int, float]]:
    return [(tokens, ppl[eval_set]) for tokens, ppl in run.curve if eval_set in ppl]


def efficiency_table(runs: list[Run], baseline: str, calibrated: list[str] | None = None
                     ) -> tuple[Table, list[str]]:
    """Token-efficiency rows: the baseline's tokens to each target, then each calibrated init's tokens and gain
    (baseline tokens / its tokens); plus notes on groups that could not be compared. `calibrated=None` takes
    every other init that has a curve."""
    groups = _groups(runs, EFFICIENCY_STAGES)
    if calibrated is None:
        with_curve = {init for by_init in groups.values() for init, run in by_init.items() if run.curve}
        calibrated = [init for init in _init_columns(runs) if init in with_curve and init != baseline]
    header = ["teacher", "policy", "ratio", "eval set", "target", "target PPL", f"{baseline} tokens",
              *(cell for init in calibrated for cell in (f"{init} tokens", f"{init} gain"))]
    rows, notes = [], []
    for group, by_init in groups.items():
        label = " / ".join(_row_head(group, "")[:3])
        missing = [init for init in (baseline, *calibrated) if init not in by_init or not by_init[init].curve]
        if missing:
            notes.append(f"{label}: no curve for {', '.join(missing)}")
        if baseline in missing:
            continue
        for eval_set in sorted({s for _, p in by_init[baseline].curve for s in p}):
            base = _series(by_init[baseline], eval_set)
            series = {init: _series(by_init[init], eval_set) if init in by_init else [] for init in calibrated}
            teacher_ppl = _teacher_value(by_init, lambda r: r.teacher_ppl.get(eval_set))
            targets = [(f"{m:.2f}x teacher", m * teacher_ppl) for m in TARGET_MULTIPLES if teacher_ppl]
            targets.append((f"{baseline} final", base[-1][1]))
            for name, target in targets:
                b = reach(base, target)
                cells = []
                for init in calibrated:
                    if series[init]:
                        c = reach(series[init], target)
                        cells += [c.cell(), efficiency_ratio(b, c)]
                    else:
                        cells += [MISSING, MISSING]
                rows.append([*_row_head(group, eval_set), name, fmt_ppl(target), b.cell(), *cells])
    return (header, rows), notes


def after_training_table(runs: list[Run]) -> Table:
    """The paper's "after Stage 1 / after Stage 1 + 2" table: PPL, NLU average and RULER per init."""
    header = ["teacher", "policy", "ratio", "eval set", "init"]
    for label in ("Stage 1", "Stage 1+2"):
        header += [f"{label} tokens", f"{label} PPL", f"{label} NLU avg", f"{label} RULER"]
    after = {stage: _groups(runs, (stage,)) for stage in ("align", "align_distill")}
    rows = []
    for group in sorted(set(after["align"]) | set(after["align_distill"]), key=group_order):
        by_stage = {stage: after[stage].get(group, {}) for stage in after}
        inits = [i for i in _init_columns(runs) if any(i in by_init for by_init in by_stage.values())]
        for eval_set in sorted({s for by_init in by_stage.values() for s in _eval_sets(by_init)}):
            for init in inits:
                cells = []
                for stage in ("align", "align_distill"):
                    run = by_stage[stage].get(init)
                    cells += ([fmt_tokens(run.tokens_trained), fmt_ppl(run.student_ppl.get(eval_set)),
                               fmt_score(run.nlu["student"]), fmt_score(run.ruler["student"])]
                              if run else [MISSING] * 4)
                rows.append([*_row_head(group, eval_set), init, *cells])
    return header, rows


def _position_series(by_init: dict[str, Run], eval_set: str) -> tuple[list[tuple[int, int]], dict[str, dict]]:
    """The buckets any init has for `eval_set` ([(start, end)] by start) and {init: {(start, end): bucket}}."""
    per_init = {init: {(b["start"], b["end"]): b for b in run.by_position.get(eval_set, [])}
                for init, run in by_init.items()}
    per_init = {init: buckets for init, buckets in per_init.items() if buckets}
    return sorted({key for buckets in per_init.values() for key in buckets}), per_init


def position_table(runs: list[Run]) -> Table:
    """Zero-shot perplexity per bucket of positions within the window: the teacher's, then each init's and its
    ratio to the teacher's."""
    inits = [i for i in _init_columns(runs) if any(r.init == i and r.by_position for r in runs)]
    header = ["teacher", "policy", "ratio", "eval set", "positions", "teacher PPL",
              *(cell for init in inits for cell in (f"{init} PPL", f"{init}/teacher"))]
    rows = []
    for group, by_init in _groups(runs).items():
        for eval_set in sorted({s for run in by_init.values() for s in run.by_position}):
            buckets, per_init = _position_series(by_init, eval_set)
            for key in buckets:
                teacher_ppl = next(b[key]["teacher_ppl"] for b in per_init.values() if key in b)
                cells = []
                for init in inits:
                    bucket = per_init.get(init, {}).get(key)
                    cells += ([fmt_ppl(bucket["student_ppl"]), fmt_ratio(bucket["student_ppl"] / teacher_ppl)]
                              if bucket else [MISSING, MISSING])
                rows.append([*_row_head(group, eval_set), f"{key[0]}-{key[1] - 1}", fmt_ppl(teacher_ppl), *cells])
    return header, rows


# --- output ---

def markdown_table(table: Table) -> str:
    header, rows = table
    if not rows:
        return "_No rows._\n"
    lines = [header, ["---"] * len(header), *rows]
    return "".join("| " + " | ".join(c.replace("|", "\\|") for c in line) + " |\n" for line in lines)


def write_csv(path: Path, table: Table) -> None:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows([table[0], *table[1]])
    write_text_atomic(path, buffer.getvalue())


def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(str(p) for p in parts)).strip("-")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on a cluster node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, ax, path: Path) -> Path:
    """Add the legend below the axes (labels of run variants are long; it never hides a line), write the PNG
    atomically and free the figure."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize="small", frameon=False)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight"))
    pyplot().close(fig)
    return path


def plot_curves(runs: list[Run], out_dir: Path) -> list[Path]:
    """One log-scale PPL-vs-tokens PNG per teacher x policy x ratio x eval set, a line per init."""
    plt = pyplot()
    paths = []
    inits = _init_columns(runs)
    for (teacher, policy, ratio), by_init in _groups(runs, EFFICIENCY_STAGES).items():
        for eval_set in sorted({s for run in by_init.values() for _, p in run.curve for s in p}):
            fig, ax = plt.subplots(figsize=(6, 4))
            for init in (i for i in inits if i in by_init and _series(by_init[i], eval_set)):
                tokens, ppl = zip(*_series(by_init[init], eval_set))
                ax.plot(tokens, ppl, marker="o", label=init)
            teacher_ppl = _teacher_value(by_init, lambda r: r.teacher_ppl.get(eval_set))
            if teacher_ppl:
                ax.axhline(teacher_ppl, color="gray", linestyle="--", label="teacher")
            ax.set(yscale="log", xlabel="tokens seen", ylabel=f"perplexity ({eval_set})",
                   title=f"{teacher} / {policy} / ratio {ratio:g}")
            path = out_dir / f"{_slug('curve', teacher, policy, f'r{ratio:g}', eval_set)}.png"
            paths.append(save_plot(fig, ax, path))
    return paths


def plot_positions(runs: list[Run], out_dir: Path) -> list[Path]:
    """One PNG of student/teacher perplexity against position (each bucket at its middle, log scale) per
    teacher x policy x ratio x eval set of the zero-shot runs, a line per init."""
    import matplotlib.ticker

    plt = pyplot()
    paths = []
    inits = _init_columns(runs)
    for (teacher, policy, ratio), by_init in _groups(runs).items():
        for eval_set in sorted({s for run in by_init.values() for s in run.by_position}):
            _, per_init = _position_series(by_init, eval_set)
            fig, ax = plt.subplots(figsize=(6, 4))
            for init in (i for i in inits if i in per_init):
                buckets = sorted(per_init[init].values(), key=lambda b: b["start"])
                ax.plot([(b["start"] + b["end"]) / 2 for b in buckets],
                        [b["student_ppl"] / b["teacher_ppl"] for b in buckets], marker="o", label=init)
            ax.axhline(1.0, color="gray", linestyle="--", label="teacher")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set(yscale="log", xlabel="position in the window (bucket middle)",
                   ylabel=f"student / teacher perplexity ({eval_set})", title=f"{teacher} / {policy} / ratio {ratio:g}")
            path = out_dir / f"{_slug('position', teacher, policy, f'r{ratio:g}', eval_set)}.png"
            paths.append(save_plot(fig, ax, path))
    return paths
