"""Zero-shot evaluation of teacher and student: perplexity per eval set, the lm-eval harness, RULER.

Perplexity is Lightning validation over all of the run's ranks (`tcal.evaluate.validation`); RULER splits its
examples over the ranks and sums their hits; the harness scores each rank's share of every task's documents and
rank 0 aggregates them. RULER and the harness run
under autocast per `trainer.precision`, as validation does. The teacher's figures depend only on the teacher, the eval data and the
settings, so they are cached on disk (`paths.cache_dir/teacher_eval`): a sweep computes them once.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from tcal.data.documents import Document, eval_sets, token_windows
from tcal.evaluate.validation import validate_windows
from tcal.registry import HARNESSES, RULERS
from tcal.settings.relevance import cache_settings
from tcal.store.cache import built_pairs, get_or_build_each, json_codec
from tcal.store.fingerprint import digest, teacher_fingerprint, tokenizer_digest

log = logging.getLogger(__name__)


def _docs_digest(docs: list[Document]) -> str:
    return digest([(d.name, d.text) for d in docs])


def cached_teacher(ctx, kind: str, settings, compute, collective: bool = False):
    """`compute()` for the teacher, memoized on disk (`tcal.store.cache`, kind `teacher_eval`) by teacher weights,
    `kind` and `settings`. `collective`: every rank calls this and `compute` runs on all of them together."""
    return cached_teacher_each(ctx, kind, {None: settings}, lambda items: {None: compute()}, collective)[None]


def cached_teacher_each(ctx, kind: str, settings: dict, compute_some, collective: bool = False) -> dict:
    """{item: value} for the teacher, each item an entry of its own keyed by teacher weights, `kind` and
    `settings[item]`: the entries found are read, the others computed together by `compute_some(items)` ({item:
    value}, or (item, value) pairs yielded as each is done, written as they come). `collective`: every rank calls
    this and `compute_some` runs on all of them together."""
    teacher = (teacher_fingerprint(ctx.teacher), tokenizer_digest(ctx.tokenizer))
    keys = {item: f"{kind}-{digest(*teacher, kind, item_settings)}" for item, item_settings in settings.items()}
    codec = json_codec(lambda entry: {"kind": kind, "settings": entry[0], "value": entry[1]},
                       lambda record: (record["settings"], record["value"]))

    def build(items):
        for item, value in built_pairs(compute_some(items)):
            yield item, (settings[item], value)

    found = get_or_build_each("teacher_eval", keys, build, folder=ctx.cache_dir / "teacher_eval", codec=codec,
                              ranks=ctx.ranks if collective else None)
    return {item: value for item, (_, value) in found.items()}


def position_buckets(evaluation) -> tuple[int, ...] | None:
    """`eval.position_buckets` as a tuple of bucket starts, or None when off."""
    buckets = evaluation.position_buckets
    return tuple(int(start) for start in buckets) if buckets else None


def perplexities(ctx, student) -> dict:
    """{eval set: {teacher_ppl, student_ppl}} on windows of `eval.seq_len` tokens (every rank takes part); with
    `eval.position_buckets` also `by_position`: [{start, end, tokens, teacher_ppl, student_ppl}, ...] per bucket
    of positions within the window."""
    ev = ctx.settings.eval
    buckets = position_buckets(ev)
    windows, settings = {}, {}
    for name, docs in eval_sets(ctx.settings.data, ctx.splits).items():
        windows[name] = token_windows(docs, ctx.tokenizer, int(ev.seq_len), int(ev.num_windows))
        settings[name] = {"docs": _docs_digest(docs),
                          **cache_settings("ppl_by_position" if buckets else "ppl", ctx.settings)}

    def validate(model, names):
        return validate_windows(model, {n: windows[n] for n in names}, int(ev.batch_size), ctx.settings.trainer,
                                ctx.ranks, buckets)

    def teacher_figures(name) -> dict:
        done = validate(ctx.teacher, [name])
        return {"ppl": done.perplexities[name], "by_position": done.by_position.get(name)}

    def teacher_cached(name) -> dict:
        """The teacher's figures, memoized; the plain perplexity keeps its own cache kind (a bare number)."""
        if buckets:
            return cached_teacher(ctx, "ppl_by_position", settings[name], lambda: teacher_figures(name),
                                  collective=True)
        return {"ppl": cached_teacher(ctx, "ppl", settings[name], lambda: teacher_figures(name)["ppl"],
                                      collective=True)}

    student_done = validate(student, list(windows))
    out = {}
    for name in windows:
        teacher = teacher_cached(name)
        out[name] = {"teacher_ppl": teacher["ppl"], "student_ppl": student_done.perplexities[name]}
        if buckets:
            out[name]["by_position"] = [
                {"start": bucket["start"], "end": bucket["end"], "tokens": bucket["tokens"],
                 "teacher_ppl": teacher_bucket["ppl"], "student_ppl": bucket["ppl"]}
                for teacher_bucket, bucket in zip(teacher["by_position"], student_done.by_position[name], strict=True)]
    return out


def harness(ctx, student) -> dict | None:
    """{"teacher": {task: {metric: value}}, "student": {...}} on rank 0, None on the other ranks and for a harness
    that measures nothing (`none`): the implementation of the `eval/harness` option chosen (`tcal.registry.HARNESSES`).
    Every rank calls this."""
    implementation = HARNESSES[ctx.settings.eval.harness.name].implementation
    return implementation(ctx, student) if implementation is not None else None


def local_harness(ctx, student) -> dict | None:
    """`eval/harness=local`: lm-eval on tasks built from the held-out documents, offline (`local_tasks`)."""
    from tcal.evaluate import local_tasks

    harness, docs = ctx.settings.eval.harness, ctx.splits.evaluation
    folder = ctx.cache_dir / "local_tasks" / digest(_docs_digest(docs), cache_settings("harness", ctx.settings))
    tasks = ctx.ranks.decide(lambda: local_tasks.build_local_tasks([d.text for d in docs], folder,
                                                                   int(harness.seed), int(harness.n_examples)))
    return run_harness(ctx, student, [(tasks, None)], include=folder, offline=True)


def paper_harness(ctx, student) -> dict | None:
    """`eval/harness=paper`: the paper's zero-shot tasks, then each few-shot task with its shots (the dataset hub)."""
    from tcal.evaluate import local_tasks

    ctx.ranks.decide(local_tasks.check_paper_tasks_available)
    runs = [(list(local_tasks.PAPER_TASKS), None), *[([t], shots) for t, shots in local_tasks.PAPER_FEWSHOT_TASKS]]
    return run_harness(ctx, student, runs, include=None, offline=False)


def run_harness(ctx, student, runs: list[tuple[list[str], int | None]], include, offline: bool) -> dict | None:
    """Teacher (cached) and student on every (tasks, shots) of `runs`: each rank scores its share of every task's
    documents (`tcal.evaluate.ranked_lm`), and rank 0 aggregates."""
    from tcal.evaluate import local_tasks

    harness = ctx.settings.eval.harness

    def run(model):
        out = {}
        with in_run_precision(ctx):
            for tasks, shots in runs:
                figures = local_tasks.run_harness(model, ctx.tokenizer, tasks, include, int(harness.batch_size),
                                                  int(harness.max_length), harness.limit, shots, offline,
                                                  ranks=ctx.ranks)
                out.update(figures or {})
        return out if ctx.ranks.is_main else None

    settings = {"docs": _docs_digest(ctx.splits.evaluation), **cache_settings("harness", ctx.settings)}
    teacher = cached_teacher(ctx, "harness", settings, lambda: run(ctx.teacher), collective=True)
    student_figures = run(student)
    return {"teacher": teacher, "student": student_figures} if ctx.ranks.is_main else None


def ruler(ctx, student) -> dict | None:
    """The implementation of the `eval/ruler` option chosen (`tcal.registry.RULERS`), None for `none`. Every rank
    calls this."""
    implementation = RULERS[ctx.settings.eval.ruler.name].implementation
    return implementation(ctx, student) if implementation is not None else None


def needle_ruler(ctx, student) -> dict:
    """`eval/ruler=default`: {"teacher": {length: {task: score}}, "student": {...}, "n": {length: {task: examples}},
    "summary": {role: {"needle" | "other" | "all": {mean, se, n}}}} (`ruler_summary`). Every
    rank calls this: each generates its share of the examples (`cell_scores` with the run's ranks). The teacher's
    score of each (length, task) is an entry of its own (`ruler_cell_settings`), so a run asking for cells another
    run measured, alone or among others, reuses them."""
    from tcal.evaluate.ruler import cell_scores, ruler_summary

    ruler = ctx.settings.eval.ruler
    docs = [d.text for d in ctx.splits.evaluation]
    cells = [(int(length), task) for length in ruler.lengths for task in ruler.tasks]

    def run(model, role, asked):
        with in_run_precision(ctx):
            yield from cell_scores(model, ctx.tokenizer, docs, asked, int(ruler.n), int(ruler.seed),
                                   desc=f"RULER {role}" if ctx.ranks.is_main else None, ranks=ctx.ranks,
                                   batch_size=int(ruler.batch_size))

    settings = {cell: ruler_cell_settings(ctx, *cell) for cell in cells}
    teacher = cached_teacher_each(ctx, "ruler_cell", settings, lambda asked: run(ctx.teacher, "teacher", asked),
                                  collective=True)
    scores = {"teacher": teacher, "student": dict(run(student, "student", cells))}
    nested = {role: {str(length): {task: by_cell[(length, task)] for task in ruler.tasks} for length in ruler.lengths}
              for role, by_cell in scores.items()}
    n = {str(length): {task: int(ruler.n) for task in ruler.tasks} for length in ruler.lengths}
    return {**nested, "n": n, "summary": {role: ruler_summary(nested[role], n) for role in nested}}


def ruler_cell_settings(ctx, length: int, task: str) -> dict:
    """What the teacher's score of one RULER cell depends on besides the teacher and tokenizer: the evaluation
    documents, the cell's length and task, and every other setting of RULER's cache key (`eval.ruler.n`, `seed`,
    `batch_size`, precision, ...). The asked lengths and tasks are not in it: a cell's examples are its own."""
    asked = {f"eval.ruler.{field}" for field in ("lengths", "tasks")}
    shared = {key: value for key, value in cache_settings("ruler", ctx.settings).items() if key not in asked}
    return {"docs": _docs_digest(ctx.splits.evaluation), "length": int(length), "task": task, **shared}


AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def in_run_precision(ctx):
    """Autocast as the training stages and validation compute under `trainer.precision` (`bf16-mixed`: bfloat16
    matmuls and GDN kernel inputs, float32 weights); nothing under `32-true` and the `-true` precisions."""
    dtype = AUTOCAST_DTYPES.get(str(ctx.settings.trainer.precision))
    return torch.autocast(ctx.device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def evaluate(ctx, student) -> dict:
    """The results.json entries of the zero-shot evaluation, `metrics`, `harness` and `ruler` (their fields:
    `tcal.store.record`). Every rank computes its share of each; the harness's figures are kept on rank 0 only."""
    out = {"metrics": perplexities(ctx, student)}
    ruler_scores = ruler(ctx, student)
    harness_scores = harness(ctx, student)
    if not ctx.ranks.is_main:
        return out
    for name, value in (("harness", harness_scores), ("ruler", ruler_scores)):
        if value is not None:
            out[name] = value
    return out


def format_table(results: dict) -> str:
    """A short console table: perplexities, then harness and RULER rows when present."""
    rows = [f"{'eval':<28}{'teacher':>12}{'student':>12}{'ratio':>10}"]
    for name, m in results["metrics"].items():
        rows.append(f"{'ppl ' + name:<28}{m['teacher_ppl']:>12.2f}{m['student_ppl']:>12.2f}"
                    f"{m['student_ppl'] / m['teacher_ppl']:>9.2f}x")
    for task, metrics in (results.get("harness") or {}).get("student", {}).items():
        for metric, value in metrics.items():
            teacher = results["harness"]["teacher"].get(task, {}).get(metric, float("nan"))
            rows.append(f"{task + ' ' + metric:<28}{teacher:>12.3f}{value:>12.3f}")
    for length, scores in (results.get("ruler") or {}).get("student", {}).items():
        for task, value in scores.items():
            teacher = results["ruler"]["teacher"].get(length, {}).get(task, float("nan"))
            rows.append(f"{'ruler ' + length + ' ' + task:<28}{teacher:>12.3f}{value:>12.3f}")
    return "\n".join(rows)
