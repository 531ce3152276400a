"""lm-eval tasks built from held-out text, so the harness runs with no dataset hub.

`build_local_tasks` writes task YAMLs and jsonl files into a folder that `run_harness` passes to
lm-eval's `TaskManager(include_path=...)`. The paper's hub task list lives here too, with the check
that fails early, naming the datasets, when the hub is unreachable.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from pathlib import Path

from tcal.hub import hub_reachable, offline_mode
from tcal.runtime.distributed import Ranks
from tcal.store.files import write_text_atomic

CLOZE_TASK = "tcal_cloze"
NEXTLINE_TASK = "tcal_nextline"

# The paper's zero-shot list with the metric it reports for each.
PAPER_TASKS: dict[str, str] = {
    "arc_challenge": "acc_norm", "arc_easy": "acc_norm", "hellaswag": "acc_norm",
    "piqa": "acc_norm", "winogrande": "acc", "boolq": "acc", "lambada_openai": "acc",
    "openbookqa": "acc_norm", "race": "acc", "sciq": "acc", "copa": "acc",
}
PAPER_FEWSHOT_TASKS: tuple[tuple[str, int], ...] = (("mmlu", 5),)

# Hub datasets behind each paper task (from lm-eval 0.4.13's YAMLs); one MMLU subject stands for all.
_PAPER_DATASETS: dict[str, tuple[str, str | None]] = {
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"), "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "hellaswag": ("Rowan/hellaswag", None), "piqa": ("baber/piqa", None),
    "winogrande": ("allenai/winogrande", "winogrande_xl"), "boolq": ("aps/super_glue", "boolq"),
    "lambada_openai": ("EleutherAI/lambada_openai", "default"), "openbookqa": ("allenai/openbookqa", "main"),
    "race": ("EleutherAI/race", "high"), "sciq": ("allenai/sciq", None), "copa": ("aps/super_glue", "copa"),
    "mmlu": ("cais/mmlu", "abstract_algebra"),
}

_CONTEXT_LINES = 4
_MIN_LINE_WORDS = 4


def build_local_tasks(documents: list[str], out_dir, seed: int = 0, n_examples: int = 200,
                      split: str = "eval") -> list[str]:
    """Write the cloze and next-line tasks (YAML + jsonl) into `out_dir`; return their task names.

    `documents` must be held-out text; `split` is only recorded in each record's metadata.
    The jsonl bytes depend only on the documents, the seed and `n_examples`.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = task_records(documents, seed, n_examples, split)
    for task, rows in records.items():
        data = out / f"{task}.jsonl"
        write_text_atomic(data, "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows))
        write_text_atomic(out / f"{task}.yaml", _task_yaml(task, data))
    return list(records)


def task_records(documents: list[str], seed: int = 0, n_examples: int = 200, split: str = "eval") -> dict:
    """{task: its records} of the cloze and next-line tasks; a ValueError names what the documents lack (the run
    builds them before any work, `tcal.preflight.check_loaded`, so short documents never fail after training)."""
    return {CLOZE_TASK: _cloze_records(documents, random.Random(f"{seed}:cloze"), n_examples, split),
            NEXTLINE_TASK: _nextline_records(documents, random.Random(f"{seed}:nextline"), n_examples, split)}


def _cloze_records(documents, rng, n, split):
    """LAMBADA-style passages of 40-120 words that end on a purely alphabetic word."""
    words = [doc.split() for doc in documents]
    usable = [i for i, w in enumerate(words) if len(w) > 130]
    if not usable:
        raise ValueError("cloze task needs at least one document longer than 130 words")
    rows = []
    for _ in range(100 * n):
        if len(rows) == n:
            break
        d = rng.choice(usable)
        size = rng.randint(40, 120)
        end = rng.randrange(size, len(words[d]))
        while end < len(words[d]) and not words[d][end - 1].isalpha():
            end += 1
        if end >= len(words[d]):
            continue
        text = " ".join(words[d][end - size:end])
        rows.append({"text": text, "metadata": {"split": split, "document": d, "end_word": end}})
    if len(rows) < n:
        raise ValueError("cloze task found too few passages ending on an alphabetic word")
    return rows


def _nextline_records(documents, rng, n, split):
    """Context lines, the true next line and three distractor lines from elsewhere in the same document."""
    lines = [(d, line.strip()) for d, doc in enumerate(documents) for line in doc.splitlines() if line.strip()]
    long_idx = [i for i, (_, line) in enumerate(lines) if len(line.split()) >= _MIN_LINE_WORDS]
    anchors = [i for i in long_idx if i >= _CONTEXT_LINES and lines[i - _CONTEXT_LINES][0] == lines[i][0]]
    if not anchors or len(long_idx) < 50:
        raise ValueError("next-line task needs more held-out text (at least 50 lines of 4+ words)")
    by_doc: dict[int, list[int]] = {}
    for i in long_idx:
        by_doc.setdefault(lines[i][0], []).append(i)
    rows = []
    for _ in range(n):
        i = rng.choice(anchors)
        true = lines[i][1]
        pool = by_doc[lines[i][0]] if len(by_doc[lines[i][0]]) >= 50 else long_idx  # same play, same style
        distractors: list[str] = []
        while len(distractors) < 3:
            j = rng.choice(pool)
            if abs(j - i) > 2 * _CONTEXT_LINES and lines[j][1] not in distractors + [true]:
                distractors.append(lines[j][1])
        choices = distractors[:]
        label = rng.randrange(4)
        choices.insert(label, true)
        context = "\n".join(line for _, line in lines[i - _CONTEXT_LINES:i])
        rows.append({"context": context, "choices": choices, "label": label,
                     "metadata": {"split": split, "document": lines[i][0], "line": i}})
    return rows


def _task_yaml(task: str, data: Path) -> str:
    """The YAML for one task; the jsonl path is absolute because lm-eval resolves it from the cwd."""
    head = (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data))}\ntest_split: test\n")
    if task == CLOZE_TASK:
        body = ("output_type: loglikelihood\n"
                "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
                "metric_list:\n"
                "  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}\n"
                "  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    else:
        body = ("output_type: multiple_choice\n"
                "doc_to_text: \"{{context}}\"\n"
                "target_delimiter: \"\\n\"\n"
                "doc_to_choice: \"{{choices}}\"\n"
                "doc_to_target: label\n"
                "metric_list:\n"
                "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
                "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")
    return head + body + "metadata:\n  version: 1.0\n"


def run_harness(model, tokenizer, task_names, include_path=None, batch_size: int = 8,
                max_length: int = 512, limit=None, num_fewshot: int | None = None,
                offline: bool = True, ranks: Ranks | None = None) -> dict[str, dict[str, float]] | None:
    """Evaluate an in-memory model with lm-eval; returns {task: {metric: value}} without stderrs. With several
    `ranks`, every rank calls this and scores its share of each task's documents (`tcal.evaluate.ranked_lm`);
    the figures come back on rank 0, None on the others."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from tcal.evaluate.ranked_lm import RankedHFLM

    mode = offline_mode() if offline else contextlib.nullcontext()
    with mode:
        lm = RankedHFLM(ranks or Ranks(), pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                        max_length=max_length, device=str(model.device))
        manager = TaskManager(include_path=str(include_path) if include_path else None)
        out = simple_evaluate(model=lm, tasks=list(task_names), task_manager=manager, limit=limit,
                              num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    if out is None:
        return None
    return {task: _plain_metrics(values) for task, values in out["results"].items()}


def _plain_metrics(values: dict) -> dict[str, float]:
    """'acc,none' -> 'acc'; drops stderrs and entries that are not 'metric,filter' (alias, sample_len)."""
    plain = {}
    for key, value in values.items():
        metric, _, metric_filter = key.partition(",")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if metric_filter and numeric and not metric.endswith("_stderr"):
            plain[metric] = float(value)
    return plain


def main_metric(task: str, metrics: dict[str, float]) -> str | None:
    """The paper's metric for its tasks; acc_norm when present, else acc, for the others."""
    if task in PAPER_TASKS:
        return PAPER_TASKS[task] if PAPER_TASKS[task] in metrics else None
    return next((m for m in ("acc_norm", "acc") if m in metrics), None)


def nlu_average(results: dict[str, dict[str, float]]) -> float | None:
    """Mean main metric over the zero-shot tasks in `results` (MMLU and its subtasks excluded)."""
    scores = [metrics[m] for task, metrics in results.items()
              if not task.startswith("mmlu") and (m := main_metric(task, metrics)) is not None]
    scores = [s for s in scores if math.isfinite(s)]
    return sum(scores) / len(scores) if scores else None


def check_paper_tasks_available(tasks=None, timeout: float = 3.0) -> None:
    """Raise a RuntimeError naming the paper datasets that neither the hub nor the cache can supply."""
    tasks = list(tasks) if tasks is not None else [*PAPER_TASKS, *(t for t, _ in PAPER_FEWSHOT_TASKS)]
    if hub_reachable(timeout):
        return
    import datasets

    missing = []
    with offline_mode():
        for task in tasks:
            path, name = _PAPER_DATASETS[task]
            try:
                datasets.load_dataset_builder(path, name)
            except Exception:  # any failure means lm-eval could not load it either
                missing.append(f"{task} ({path}{'/' + name if name else ''})")
    if missing:
        raise RuntimeError(
            "eval/harness=paper needs datasets from the Hugging Face hub, which is unreachable, and "
            f"these are not in the local cache: {', '.join(missing)}. "
            "Use eval/harness=local offline, or pre-cache the datasets on a machine with network access.")
