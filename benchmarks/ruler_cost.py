"""The `ruler` benchmark: one `recall_table` cell of RULER on a student, its examples generated one by one (what
`eval.ruler.batch_size=1` runs: `model.generate` on each prompt alone, as RULER did before batches) and in batches
of `eval.ruler.batch_size`, both in this process and interleaved (length by length, task by task), with the ratio
of the two and whether their replies are equal."""

from __future__ import annotations

from measurement import Clock, emit

from tcal.evaluate.ruler import generated_tokens, make_ruler_examples

RULER_LENGTHS = (512, 1024, 2048)  # the recall table's cell at 512-2,048 tokens
RULER_TASKS = ("niah_single",)
RULER_N = 50


def bench_ruler(student, tokenizer, documents: list[str], lengths=RULER_LENGTHS, tasks=RULER_TASKS, n: int = RULER_N,
                batch_size: int = 8, seed: int = 0) -> list[dict]:
    """A `ruler_part` line per (length, task), then a `ruler_cell` line of their sums: wall and process CPU seconds
    one by one and batched, and the batched / one-by-one ratio of each. On a shared machine the CPU seconds of a
    one-thread process are the steadier figure (`measurement.Clock`)."""
    lines, totals = [], {"one_by_one_s": 0.0, "one_by_one_cpu_s": 0.0, "batched_s": 0.0, "batched_cpu_s": 0.0}
    same = True
    for length in lengths:
        for task in tasks:
            examples = make_ruler_examples(documents, tokenizer, length, task, n, seed)
            with Clock() as alone_clock:
                alone = generated_tokens(student, tokenizer, examples, batch_size=1)
            with Clock() as batched_clock:
                batched = generated_tokens(student, tokenizer, examples, batch_size=batch_size)
            part = {"one_by_one_s": alone_clock.wall, "one_by_one_cpu_s": alone_clock.cpu,
                    "batched_s": batched_clock.wall, "batched_cpu_s": batched_clock.cpu}
            for key, value in part.items():
                totals[key] += value
            same = same and alone == batched
            lines.append(emit("ruler_part", length=length, task=task, n=n, batch_size=batch_size, **part,
                              ratio=part["batched_s"] / part["one_by_one_s"],
                              cpu_ratio=part["batched_cpu_s"] / part["one_by_one_cpu_s"],
                              same_replies=alone == batched))
    lines.append(emit("ruler_cell", lengths=list(lengths), tasks=list(tasks), n=n, batch_size=batch_size, **totals,
                      ratio=totals["batched_s"] / totals["one_by_one_s"],
                      cpu_ratio=totals["batched_cpu_s"] / totals["one_by_one_cpu_s"], same_replies=same,
                      target="ratio <= 0.4 on one thread"))
    return lines
