"""`tcal-report FOLDER --wandb ENTITY/PROJECT`: the W&B dashboard of a sweep, as code (wandb-workspaces).

The dashboard is a W&B report: one section per teacher x policy x ratio, holding one line panel per training
stage and eval set (`<stage>/ppl/<eval set>` against `<stage>/tokens_seen`, the keys the training stages log)
with the runs grouped by init, then the zero-shot and tokens-to-target tables of `tcal-report` as Markdown. A
report rather than a workspace view because each panel grid of a report has its own run filter, so a section
shows its own teacher, policy and ratio only; a workspace view has one filter for all its sections.

The spec is plain data computed from the runs' results.json records alone (`dashboard_spec`); it is always
written to the report folder. Saving it to W&B (`push`) needs credentials; without them the command says so and
how to push it later.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tcal.store.files import write_text_atomic
from tcal.store.record import load_record
from tcal.tools.figures import (
    Run,
    collect,
    efficiency_table,
    fmt_ppl,
    group_order,
    init_order,
    markdown_table,
    zero_shot_table,
)
from tcal.tracking import curve_metric, tokens_metric, wandb_has_credentials

SPEC_FILE = "wandb_workspace.json"
SPEC_VERSION = 1
INIT_KEY = "init.name"
GQA_KEY = "init.gqa_expansion"


@dataclass(frozen=True)
class LoggedRun:
    """A complete run as W&B holds it: the config values that pick out its section's runs, and its curves."""

    run: Run
    selectors: dict[str, object]   # W&B config key -> this run's value (teacher, policy, ratio, stage)
    curves: dict[str, list[str]]   # stage kind -> eval sets whose perplexity curve the stage logged
    logger: str                    # the run's `logger.name`
    project: str | None            # the W&B project it logged to (`logger.project`), None unless logger=wandb


def logged_run(run: Run, record: dict) -> LoggedRun:
    """`run` (as `tcal-report` reads it) with what its record says it logged. A stage reused from the cache
    logged nothing in this run, so its curve is left out."""
    config = record.get("config") or {}
    retention = config.get("retention") or {}
    selectors = {"teacher.name": config["teacher"]["name"], "retention.name": retention["name"]}
    if "ratio" in retention:
        selectors["retention.ratio"] = retention["ratio"]
    selectors["stage.name"] = config["stage"]["name"]
    curves = {kind: sorted(stage["curve"]) for kind, stage in (record.get("stages") or {}).items()
              if stage.get("curve") and not stage.get("cached")}
    logger = config.get("logger") or {}
    return LoggedRun(run, selectors, curves, str(logger.get("name", "none")),
                     logger.get("project") if logger.get("name") == "wandb" else None)


def _line_panels(members: list[LoggedRun]) -> list[dict]:
    """One panel per (stage kind, eval set) that any member logged, in stage order then by eval set."""
    kinds = list(dict.fromkeys(kind for member in members for kind in member.curves))
    return [{"kind": "line", "title": f"{eval_set} perplexity ({kind})", "x": tokens_metric(kind),
             "y": [curve_metric(kind, eval_set)], "log_y": True, "x_title": "tokens seen",
             "y_title": f"perplexity ({eval_set})"}
            for kind in kinds for eval_set in sorted({s for m in members for s in m.curves.get(kind, [])})]


def _grid(members: list[LoggedRun]) -> dict:
    """The panel grid of the runs sharing one set of selectors: filtered to them, grouped by init, and by the
    settings that tell runs of one init apart (`Run.variant_keys`), so W&B never averages two variants."""
    inits = sorted({m.run.init_mode for m in members}, key=init_order)
    group_by = [INIT_KEY] + ([GQA_KEY] if any(m.run.gqa_expansion != "whole_head" for m in members) else [])
    group_by += sorted({key for m in members for key in m.run.variant_keys} - set(group_by))
    return {"name": f"stage {members[0].selectors['stage.name']}", "filters": dict(members[0].selectors),
            "group_by": group_by, "inits": inits, "panels": _line_panels(members)}


def _sections(logged: list[LoggedRun]) -> list[dict]:
    by_group: dict[tuple, dict[tuple, list[LoggedRun]]] = {}
    for member in logged:
        if member.curves:
            by_group.setdefault(member.run.group, {}).setdefault(tuple(member.selectors.items()), []).append(member)
    sections = []
    for group in sorted(by_group, key=group_order):
        teacher, policy, ratio = group
        grids = by_group[group]
        teacher_ppl = {name: value for members in grids.values() for m in members
                       for name, value in m.run.teacher_ppl.items()}
        sections.append({"name": f"{teacher} / {policy} / ratio {ratio:g}",
                         "teacher_ppl": dict(sorted(teacher_ppl.items())),
                         "grids": [_grid(members) for _, members in sorted(grids.items())]})
    return sections


def dashboard_spec(logged: list[LoggedRun], entity: str, project: str, title: str, baseline: str = "zero_gate",
                   calibrated: list[str] | None = None) -> dict:
    """The dashboard as plain data: the init-curve sections of the runs with a logged curve, then the zero-shot
    and tokens-to-target tables of all of them (`baseline` and `calibrated` as in `tcal-report`)."""
    runs = [member.run for member in logged]
    efficiency, notes = efficiency_table(runs, baseline, calibrated)
    tables = [{"name": "zero_shot", "title": "Zero-shot perplexity (student)",
               "markdown": markdown_table(zero_shot_table(runs))},
              {"name": "token_efficiency",
               "title": f"Tokens to target (gain = {baseline} tokens / the init's tokens)",
               "markdown": markdown_table(efficiency) + "".join(f"\n- {note}" for note in notes)}]
    return {"spec_version": SPEC_VERSION, "kind": "report", "entity": entity, "project": project, "title": title,
            "description": f"Init curves and tables of {len(runs)} runs (tcal-report).",
            "sections": _sections(logged), "tables": tables}


def load_logged_runs(folder: Path) -> tuple[list[LoggedRun], list[str]]:
    """The complete runs below `folder`, read by `tcal-report`'s `collect`, with their records; and a note for
    each record whose config lacks a key the dashboard needs (that run is left out)."""
    runs = collect(folder).runs
    logged, notes = [], []
    for run in runs:
        try:
            logged.append(logged_run(run, load_record(run.path)))
        except (KeyError, TypeError) as err:
            notes.append(f"{run.path}: no config key {err} in the record; left out of the W&B report")
    return logged, notes


def logging_notes(logged: list[LoggedRun], project: str) -> list[str]:
    """Runs whose curves the dashboard cannot show: not logged to W&B, or logged to another project."""
    notes = []
    elsewhere = [m for m in logged if m.logger != "wandb"]
    if elsewhere:
        notes.append(f"{len(elsewhere)} of {len(logged)} runs did not log to W&B (logger={elsewhere[0].logger}, "
                     f"e.g. {elsewhere[0].run.path.parent}); rerun them with logger=wandb to fill their panels")
    for other in sorted({m.project for m in logged if m.project and m.project != project}):
        notes.append(f"some runs logged to W&B project {other!r}, not {project!r}")
    return notes


# --- the library objects and the push ---

def _config_filter(selectors: dict[str, object]):
    """All selectors at once, each keyed the way W&B stores a nested config value (`teacher.value.name`)."""
    from wandb_workspaces import expr

    return expr.And(*(expr.Config(expr.groupby_str_to_key(f"config.{key}").name) == value
                      for key, value in selectors.items()))


def to_report(spec: dict):
    """The spec as a `wandb_workspaces.reports.v2.Report` (built without network; `save()` needs it)."""
    import wandb_workspaces.reports.v2 as wr

    entity, project = spec["entity"], spec["project"]
    blocks = [wr.P(spec["description"])]
    for section in spec["sections"]:
        blocks.append(wr.H2(section["name"]))
        if section["teacher_ppl"]:
            blocks.append(wr.P("Teacher perplexity: " + ", ".join(
                f"{name} {fmt_ppl(value)}" for name, value in section["teacher_ppl"].items())))
        for grid in section["grids"]:
            runset = wr.Runset(entity=entity, project=project, name=grid["name"],
                               filters=_config_filter(grid["filters"]),
                               groupby=[f"config.{key}" for key in grid["group_by"]])
            panels = [wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"]), log_y=p["log_y"],
                                  title_x=p["x_title"], title_y=p["y_title"]) for p in grid["panels"]]
            blocks.append(wr.PanelGrid(runsets=[runset], panels=panels))
    for table in spec["tables"]:
        blocks += [wr.H2(table["title"]), wr.MarkdownBlock(text=table["markdown"])]
    return wr.Report(entity=entity, project=project, title=spec["title"], description=spec["description"],
                     blocks=blocks)


def missing_for_push() -> list[str]:
    """What saving to W&B lacks here (empty when it can be tried)."""
    missing = []
    if not wandb_has_credentials():
        missing.append("no WANDB_API_KEY and no api.wandb.ai entry in ~/.netrc")
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        missing.append(f"WANDB_MODE={os.environ['WANDB_MODE']}")
    return missing


def wandb_target(text: str) -> tuple[str, str]:
    """`ENTITY/PROJECT` as (entity, project); the argparse type of `--wandb`."""
    entity, _, project = text.partition("/")
    if not entity or not project or "/" in project:
        raise argparse.ArgumentTypeError(f"{text!r}; expected ENTITY/PROJECT, e.g. my-team/taylor-calibrate")
    return entity, project


def publish(folder: Path, out_dir: Path, target: tuple[str, str], baseline: str = "zero_gate",
            calibrated: list[str] | None = None) -> int:
    """Write the spec into `out_dir`; save it to W&B when credentials allow, else say how. Exit status."""
    entity, project = target
    logged, notes = load_logged_runs(folder)
    spec = dashboard_spec(logged, entity, project, f"tcal: {Path(folder).resolve().name}", baseline, calibrated)
    path = Path(out_dir) / SPEC_FILE
    write_text_atomic(path, json.dumps(spec, indent=2) + "\n")
    panels = sum(len(grid["panels"]) for section in spec["sections"] for grid in section["grids"])
    print(f"W&B report spec: {len(spec['sections'])} sections, {panels} line panels, {len(spec['tables'])} tables "
          f"-> {path}")
    for note in notes + logging_notes(logged, project):
        print(f"note: {note}")
    missing = missing_for_push()
    if missing:
        print(f"W&B report not pushed ({'; '.join(missing)}): push it with "
              f"`WANDB_API_KEY=<key> tcal-report {folder} --wandb {entity}/{project}`")
        return 0
    try:
        report = to_report(spec).save()
    except Exception as err:  # the network or the W&B API: the spec stays on disk for a later push
        print(f"W&B report not pushed to {entity}/{project}: {type(err).__name__}: {err} (spec kept in {path})")
        return 1
    print(f"W&B report: {report.url}")
    return 0
