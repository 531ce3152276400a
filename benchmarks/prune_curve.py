"""The retrieval curve along a finished elimination path (`retention.search=prune`): for each count of softmax layers
asked (default 12, 10, 8), the path's set at that count as an ordinary keep list (`retention=explicit`), zero-shot
with the path's init: RULER niah_single at 512 tokens (n = 50, standard errors in results.json) and perplexity on
held-out Shakespeare (the eval split) and the Python reference.

    python benchmarks/prune_curve.py outputs/<task>/<date>/results.json [--counts 12,10,8] [--jobs 2] [--run]

Without `--run` it prints one `tcal` command per cell (run them two at a time, one thread each); with `--run` it
runs them, `--jobs` at once, each with OMP_NUM_THREADS=1 and its log beside its run folder
(outputs/prune_curve-<count>/...). The results file is the elimination run's (its `retention_details.search`); the
Python reference is made as sweeps/recall_table.yaml says. Run the cells in the elimination run's working folder,
so that they read its calibrated layers from its cache (.cache/tcal) instead of calibrating again. The cell at the
path's start (the default recall list at 0.5) is in docs/results.md already.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tcal.arguments import number, numbers
from tcal.runtime.processes import pool_size


def path_sets(search: dict) -> dict[int, list[int]]:
    """{number kept: the keep list at that count} along the path: the start and the set after each step."""
    sets = {len(search["start"]): sorted(search["start"])}
    for step in search["steps"]:
        keep = sorted(i for i in step["keep"] if i != step["removed"])
        sets[len(keep)] = keep
    return sets


def cell_command(keep: list[int], init: str, count: int) -> list[str]:
    return ["tcal", "retention=explicit", f"retention.keep=[{','.join(map(str, keep))}]", f"init={init}",
            "eval/harness=none", "eval/ruler=default", "eval.ruler.lengths=[512]", "eval.ruler.tasks=[niah_single]",
            "eval.ruler.n=50", "save_student=false", "data.eval_files=[python_reference.txt]",
            f"task_name=prune_curve-{count}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.json of the elimination run")
    parser.add_argument("--counts", type=numbers(number(int, above=0)), default=(12, 10, 8),
                        help="comma list of softmax layer counts along the path")
    parser.add_argument("--jobs", type=number(int, above=0), default=2,
                        help="cells run at once (at most the CPUs this process may use)")
    parser.add_argument("--run", action="store_true", help="run the cells instead of printing their commands")
    args = parser.parse_args()
    try:
        record = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        parser.error(f"{args.results}: cannot be read as a run's results.json ({type(err).__name__}: {err})")
    search = (record.get("retention_details") or {}).get("search") or {}
    if search.get("method") != "prune":
        sys.exit(f"{args.results}: retention_details.search is not an elimination path (retention.search=prune)")
    sets = path_sets(search)
    counts = list(args.counts)
    missing = [c for c in counts if c not in sets]
    if missing:
        sys.exit(f"--counts {missing}: the path ({search['stopped']}) has sets at {sorted(sets, reverse=True)} only")
    init = search["init"]
    commands = {c: cell_command(sets[c], init, c) for c in counts}
    if not args.run:
        for c in counts:
            print(f"OMP_NUM_THREADS=1 {shlex.join(commands[c])} > prune_curve-{c}.log 2>&1")
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = min(pool_size(args.jobs, "--jobs"), len(counts))
    pending, running = list(counts), []
    while pending or running:
        while pending and len(running) < jobs:
            c = pending.pop(0)
            log = open(f"prune_curve-{c}.log", "w")
            running.append((c, subprocess.Popen(commands[c], stdout=log, stderr=subprocess.STDOUT, env=env), log))
            print(f"{c} kept: {shlex.join(commands[c])} (log prune_curve-{c}.log)", flush=True)
        c, process, log = running.pop(0)
        process.wait()
        log.close()
        print(f"{c} kept: exit {process.returncode}", flush=True)


if __name__ == "__main__":
    main()
