"""`tcal-report FOLDER --wandb ENTITY/PROJECT` on a real tiny sweep (two inits, 64 Stage 2 tokens): the W&B report
spec has one section per teacher/policy/ratio, one line panel per eval set of `<stage>/ppl/<set>` against
`<stage>/tokens_seen` grouped by init, with keys the runs really logged (their metrics.csv), and the tables of
tcal-report; offline it writes the spec and says how to push it; the spec becomes wandb-workspaces objects
without network."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
from conftest import as_version_1, isolated_cache_dir
from test_sweep import ONE_STEP, sweep
from wandb_workspaces import expr

from tcal.store.record import recorded_setting
from tcal.tools import dashboard
from tcal.tools.dashboard import SPEC_FILE, dashboard_spec, load_logged_runs, to_report
from tcal.tools.figures import collect, efficiency_table, markdown_table
from tcal.tools.report import main

INITS = ("naive", "zero_gate")


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory) -> Path:
    """`tcal -m init=naive,zero_gate stage=distill ... logger=csv` on the tiny teacher."""
    root = tmp_path_factory.mktemp("dashboard")
    done, summary = sweep(isolated_cache_dir(root / "cache"), root / "sweep", *ONE_STEP, "logger=csv",
                          f"init={','.join(INITS)}")
    assert done.returncode == 0 and not summary, done.stderr[-3000:]
    return root / "sweep"


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc


def logged_points(run_dir: Path, x: str, y: str) -> list[tuple[int, float]]:
    """The (x, y) pairs of the metrics.csv rows that logged `y` (a KeyError when a column is missing)."""
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return [(int(float(row[x])), float(row[y])) for row in csv.DictReader(handle) if row[y]]


def test_offline_spec_of_a_tiny_sweep(tiny_sweep, no_credentials, capsys):
    assert main([str(tiny_sweep), "--wandb", "my-team/tcal"]) == 0
    out = capsys.readouterr().out
    path = tiny_sweep / "report" / SPEC_FILE
    assert (f"W&B report not pushed (no WANDB_API_KEY and no api.wandb.ai entry in ~/.netrc): push it with "
            f"`WANDB_API_KEY=<key> tcal-report {tiny_sweep} --wandb my-team/tcal`") in out.splitlines()
    assert f"W&B report spec: 1 sections, 1 line panels, 2 tables -> {path}" in out.splitlines()
    assert any(line.startswith("note: 2 of 2 runs did not log to W&B (logger=csv, e.g. ") for line in out.splitlines())
    spec = json.loads(path.read_text())
    assert (spec["entity"], spec["project"], spec["kind"]) == ("my-team", "tcal", "report")

    records = {p.parent: json.loads(p.read_text()) for p in tiny_sweep.glob("*/results.json")}
    assert sorted(recorded_setting(r, "init.name") for r in records.values()) == list(INITS)
    eval_sets = {s for r in records.values() for s in r["stages"]["distill"]["curve"]}
    assert eval_sets == {"shakespeare"}
    [section] = spec["sections"]
    assert section["name"] == "tiny_llama / uniform / ratio 0.5"
    [grid] = section["grids"]
    assert grid["filters"] == {"teacher.name": "tiny_llama", "retention.name": "uniform", "retention.ratio": 0.5,
                               "stage.name": "distill"}
    assert grid["group_by"] == ["init.name"] and grid["inits"] == list(INITS)
    assert [(p["x"], p["y"]) for p in grid["panels"]] == [("distill/tokens_seen", [f"distill/ppl/{s}"])
                                                          for s in sorted(eval_sets)]
    for run_dir, record in records.items():  # the panels' keys are those the runs logged, point for point
        for panel, eval_set in zip(grid["panels"], sorted(eval_sets)):
            curve = [(p["tokens"], pytest.approx(p["ppl"])) for p in record["curve"][eval_set]]
            assert len(curve) == 2 and logged_points(run_dir, panel["x"], panel["y"][0]) == curve
        config = record["config"]
        assert {key: config[key.split(".")[0]][key.split(".")[1]] for key in grid["filters"]} == grid["filters"]
        assert config["init"]["name"] == recorded_setting(record, "init.name") and "init_mode" not in record

    runs = collect(tiny_sweep).runs
    efficiency, _ = efficiency_table(runs, "zero_gate")
    tables = {t["name"]: t["markdown"] for t in spec["tables"]}
    assert tables["token_efficiency"] == markdown_table(efficiency)
    assert "| zero_gate final |" in tables["token_efficiency"] and tables["zero_shot"] == "_No rows._\n"


def test_sections_split_by_teacher_policy_ratio_and_skip_cached_stages(tiny_sweep):
    logged, notes = load_logged_runs(tiny_sweep)
    assert len(logged) == 2 and notes == []
    naive = next(m for m in logged if m.run.init_mode == "naive")
    other_policy = dataclasses.replace(naive, run=dataclasses.replace(naive.run, policy="ar"),
                                       selectors={**naive.selectors, "retention.name": "ar"})
    two_stages = dataclasses.replace(naive, curves={"align": ["shakespeare"], **naive.curves},
                                     run=dataclasses.replace(naive.run, teacher="a_teacher"),
                                     selectors={**naive.selectors, "teacher.name": "a_teacher"})
    spec = dashboard_spec([*logged, other_policy, two_stages], "e", "p", "t")
    assert [s["name"] for s in spec["sections"]] == ["a_teacher / uniform / ratio 0.5",
                                                     "tiny_llama / uniform / ratio 0.5",
                                                     "tiny_llama / ar / ratio 0.5"]
    assert [[p["y"][0] for p in s["grids"][0]["panels"]] for s in spec["sections"]] == [
        ["align/ppl/shakespeare", "distill/ppl/shakespeare"], ["distill/ppl/shakespeare"],
        ["distill/ppl/shakespeare"]]
    assert [s["grids"][0]["inits"] for s in spec["sections"]] == [["naive"], list(INITS), ["naive"]]

    seq_len = [dataclasses.replace(m, run=dataclasses.replace(m.run, variant_keys=("calibration.seq_len",)))
               for m in logged]  # runs of one init that differ in a setting: W&B groups by it too
    [grid] = dashboard_spec(seq_len, "e", "p", "t")["sections"][0]["grids"]
    assert grid["group_by"] == ["init.name", "calibration.seq_len"]

    on_wandb = [dataclasses.replace(m, logger="wandb", project=project) for m, project in zip(logged, ("p", "q"))]
    assert dashboard.logging_notes(on_wandb, "p") == ["some runs logged to W&B project 'q', not 'p'"]

    record = json.loads(naive.run.path.read_text())
    record["stages"]["distill"]["cached"] = True  # a reused stage logs nothing in this run
    assert dashboard.logged_run(naive.run, record).curves == {}


def test_a_record_without_config_is_named_and_left_out(tiny_sweep, tmp_path):
    """An older record (version 1: its settings copied to the top level) whose config lacks the stage is reported,
    but left out of the W&B report, whose filters are config keys."""
    folder = tmp_path / "copy"
    for record_path in tiny_sweep.glob("*/results.json"):
        record = json.loads(record_path.read_text())
        if recorded_setting(record, "init.name") == "naive":
            record = as_version_1(record)
            del record["config"]["stage"]
        (folder / record_path.parent.name).mkdir(parents=True)
        (folder / record_path.parent.name / "results.json").write_text(json.dumps(record))
    logged, notes = load_logged_runs(folder)
    assert [m.run.init_mode for m in logged] == ["zero_gate"]
    [naive_dir] = [p.parent for p in folder.glob("*/results.json") if p.parent.name != logged[0].run.path.parent.name]
    assert notes == [f"{naive_dir / 'results.json'}: no config key 'stage' in the record; left out of the W&B report"]


def test_spec_becomes_a_report_without_network(tiny_sweep, no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    spec = dashboard_spec(load_logged_runs(tiny_sweep)[0], "my-team", "tcal", "tiny")
    report = to_report(spec)
    assert (report.entity, report.project, report.title) == ("my-team", "tcal", "tiny")
    [grid] = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    [runset] = grid.runsets
    assert (runset.entity, runset.project, runset.groupby) == ("my-team", "tcal", ["config.init.name"])
    filters = expr.filters_tree_to_v2(expr.expr_to_filters(runset.filters))["filters"]
    assert {(f["key"]["section"], f["key"]["name"], f["value"]) for f in filters} == {
        ("config", "teacher.value.name", "tiny_llama"), ("config", "retention.value.name", "uniform"),
        ("config", "retention.value.ratio", 0.5), ("config", "stage.value.name", "distill")}
    [panel] = grid.panels
    config = panel._to_model().model_dump(by_alias=True, exclude_none=True)["config"]
    assert (config["xAxis"], config["metrics"], config["yLogScale"]) == (
        "distill/tokens_seen", ["distill/ppl/shakespeare"], True)
    markdown = [b.text for b in report.blocks if type(b).__name__ == "MarkdownBlock"]
    assert markdown == [t["markdown"] for t in spec["tables"]]


class SavedReport:
    url = "https://wandb.ai/my-team/tcal/reports/tiny--abc"

    def __init__(self, error: Exception | None = None):
        self.error = error

    def save(self):
        if self.error:
            raise self.error
        return self


def test_push_with_credentials_prints_the_url_or_the_failure(tiny_sweep, no_credentials, monkeypatch, tmp_path,
                                                              capsys):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert dashboard.missing_for_push() == ["WANDB_MODE=offline"]
    monkeypatch.delenv("WANDB_MODE")
    assert dashboard.missing_for_push() == []
    target, out = ("my-team", "tcal"), tmp_path / "out"
    monkeypatch.setattr(dashboard, "to_report", lambda spec: SavedReport())
    assert dashboard.publish(tiny_sweep, out, target) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"W&B report: {SavedReport.url}"
    monkeypatch.setattr(dashboard, "to_report", lambda spec: SavedReport(ConnectionError("no route to host")))
    assert dashboard.publish(tiny_sweep, out, target) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"W&B report not pushed to my-team/tcal: ConnectionError: no route to host (spec kept in {out / SPEC_FILE})")


def test_bad_target_is_named(tiny_sweep, capsys):
    with pytest.raises(SystemExit):
        main([str(tiny_sweep), "--wandb", "just-a-project"])
    assert ("argument --wandb: 'just-a-project'; expected ENTITY/PROJECT, e.g. my-team/taylor-calibrate"
            in capsys.readouterr().err)
