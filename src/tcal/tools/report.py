"""`tcal-report`: turn a run or multirun folder of results.json files into the paper's tables and plots.

Writes report.md, one CSV per table (same cells as the Markdown), one PNG of perplexity against tokens seen
and, for runs evaluated with `eval.position_buckets`, one PNG of the student/teacher perplexity ratio against
position in the window, per teacher x policy x ratio x eval set, then prints the Markdown. Runs that cannot be
used are listed with the reason, never dropped silently; failed runs (status "failed": a bad setting in a
sweep job, divergence, a crash) are listed apart with their error, and records that cannot be read (damaged, or
of an unknown schema version: `tcal.store.record.load_record`) apart again, each with its field and why, also on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tcal.arguments import name, names
from tcal.errors import ConfigError
from tcal.store.files import check_writable, in_the_way, write_text_atomic
from tcal.tools.dashboard import publish, wandb_target
from tcal.tools.figures import (
    ablation_table,
    after_training_table,
    collect,
    efficiency_table,
    elimination_table,
    markdown_table,
    plot_curves,
    plot_positions,
    position_table,
    retrieval_table,
    write_csv,
    zero_shot_table,
)
from tcal.tracking import finish, log_table, wandb_logger


def build_report(folder: Path, out_dir: Path, baseline: str = "zero_gate", calibrated: list[str] | None = None,
                 logger=None) -> str:
    """Write every table, CSV and plot into `out_dir`; return the Markdown. A Lightning `logger` (W&B)
    also receives each table (W&B tables for a dashboard)."""
    folder, out_dir = Path(folder), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found = collect(folder)
    runs = found.runs
    for err in found.damaged:
        print(f"tcal-report: not read: {err}", file=sys.stderr, flush=True)
    efficiency, efficiency_notes = efficiency_table(runs, baseline, calibrated)
    tables = {"zero_shot": ("Zero-shot perplexity (student; NLU avg and RULER are student scores)",
                            zero_shot_table(runs), []),
              "phase_ablation": ("Phase ablation", ablation_table(runs), []),
              "token_efficiency": (f"Token efficiency: Stage 2 tokens to reach each target, interpolated between "
                                   f"evaluations; gain = {baseline} tokens / the init's tokens", efficiency,
                                   efficiency_notes),
              "after_training": ("After training (Stage 1; Stage 1 + 2)", after_training_table(runs), []),
              "retrieval": ("Retrieval: RULER exact match ± standard error (examples) per subtask and length, needle "
                            "subtasks and the others apart", retrieval_table(runs), []),
              "elimination": ("Backward elimination (retention.search=prune): each step's set, the layer removed, "
                              "its student's loss on the probe's answers and text, their rises ± standard error",
                              elimination_table(runs), []),
              "by_position": ("Zero-shot perplexity by position in the window (student PPL and student/teacher per "
                              "bucket of positions)", position_table(runs), [])}
    counts = (f"{len(runs)} complete runs, {len(found.failed)} failed, {len(found.incomplete)} incomplete, "
              f"{len(found.damaged)} damaged.")
    parts = [f"# tcal report: {folder}\n\n{counts}\n"]
    for name, (title, table, notes) in tables.items():
        write_csv(out_dir / f"{name}.csv", table)
        log_table(logger, name, *table)
        listed_notes = "".join(f"\n- {note}" for note in notes) + ("\n" if notes else "")
        parts.append(f"## {title}\n\n{markdown_table(table)}{listed_notes}")
    plots = plot_curves(runs, out_dir) + plot_positions(runs, out_dir)
    parts.append("## Plots\n\n" + ("".join(f"- ![{p.stem}]({p.name})\n" for p in plots) or "_No curves._\n"))
    damaged = [(err.path, err.problem) for err in found.damaged]
    for title, listed in (("Failed runs", found.failed), ("Incomplete runs", found.incomplete),
                          ("Damaged records", damaged)):
        lines = "".join(f"- `{path.relative_to(folder)}`: {why}\n" for path, why in listed)
        parts.append(f"## {title}\n\n" + (lines or "None.\n"))
    markdown = "\n".join(parts)
    write_text_atomic(out_dir / "report.md", markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tcal-report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a run or multirun folder (searched recursively)")
    parser.add_argument("--out", type=Path, help="output folder (default: FOLDER/report)")
    parser.add_argument("--baseline", type=name, default="zero_gate", help="init whose tokens are the numerator of each gain")
    parser.add_argument("--calibrated", type=names,
                        help="comma-separated inits compared with the baseline (default: every other init with a curve)")
    parser.add_argument("--wandb-project", help="also log the tables to this W&B project (WANDB_MODE=offline works)")
    parser.add_argument("--wandb", type=wandb_target, metavar="ENTITY/PROJECT",
                        help="also build the W&B report of init curves and tables (tcal.tools.dashboard); saved there "
                             "with credentials, else its spec is written to the output folder")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    out = args.out or args.folder / "report"
    blocker = in_the_way(out)
    if blocker is not None:
        parser.error(f"--out {out}: {blocker} is a file; expected a folder for the report (or a path where one can "
                     f"be made)")
    try:
        check_writable(out)
    except ConfigError as err:
        parser.error(f"--out {err}")
    logger = None
    if args.wandb_project:
        logger = wandb_logger(args.wandb_project, out, f"report-{args.folder.name}", "report",
                              config={"folder": str(args.folder)})
    print(build_report(args.folder, out, args.baseline, args.calibrated, logger))
    finish(logger)
    return publish(args.folder, out, args.wandb, args.baseline, args.calibrated) if args.wandb else 0


if __name__ == "__main__":
    raise SystemExit(main())
