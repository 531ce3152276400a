"""tcal-report on a hand-made multirun folder: exact table cells, CSVs, PNGs, and the failed and incomplete runs
listed apart."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import as_version_1, example_record, example_stage

from tcal.tools import figures
from tcal.tools.figures import Reach, efficiency_ratio, fmt_ppl, fmt_ratio
from tcal.tools.report import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _curve(points):
    return {"shakespeare": [{"tokens": t, "ppl": p} for t, p in points]}


def _result(policy, init, student_ppl, curve=None, **extra):
    fields = {"retention": policy, "init_mode": init,
              "metrics": {"shakespeare": {"teacher_ppl": 20.0, "student_ppl": student_ppl}}}
    if policy != "uniform":
        fields["ratio"] = None  # the explicit policy has no ratio: 2 of 4 layers gives 0.5 too
    if curve is not None:
        fields["curve"] = _curve(curve)
    return example_record(**fields, **extra)


@pytest.fixture
def multirun(tmp_path):
    runs = {
        "uniform_naive": _result("uniform", "naive", 1500.0, [(0, 1500.0), (1000, 30.0), (2000, 25.0)]),
        "uniform_zero_gate": _result("uniform", "zero_gate", 40.0,
                                     [(0, 40.0), (1000, 26.0), (2000, 23.5), (3000, 22.8)]),
        "uniform_phase2": _result("uniform", "phase2", 27.5),
        "uniform_full": _result(
            "uniform", "full", 25.0, [(0, 25.3), (1000, 22.5), (2000, 21.5), (3000, 21.0)],
            harness={"teacher": {"tcal_cloze": {"acc": 0.6}, "tcal_nextline": {"acc": 0.5, "acc_norm": 0.7}},
                     "student": {"tcal_cloze": {"acc": 0.4, "perplexity": 50.0},
                                 "tcal_nextline": {"acc": 0.3, "acc_norm": 0.5}}},
            ruler={"teacher": {}, "student": {"512": {"niah_single": 1.0, "niah_multikey": 0.5},
                               "1024": {"niah_single": 0.5, "niah_multikey": 0.0}}}),
        "uniform_full_row_repeat": _result("uniform", "full", 33.0, gqa_expansion="row_repeat"),
        "explicit_naive": _result("explicit", "naive", 2180.0, [(500, 2180.0), (2000, 90.0)]),
        "explicit_zero_gate": _result("explicit", "zero_gate", 22.9, [(500, 22.9), (1000, 21.9), (2000, 21.0)]),
        "explicit_full": _result("explicit", "full", 21.8, [(500, 21.8), (1000, 21.2), (2000, 20.5)]),
    }
    running = example_record("initialized", init_mode="phase1")
    no_init = as_version_1(_result("explicit", "phase1", 30.0))
    del no_init["init_mode"]  # version 1 held a copy of the init mode
    diverged = example_record("failed", "initialized", init_mode="zero_gate", error="Divergence: distill: perplexity "
                              "on eval set 'shakespeare' is nan at step 3 (tokens_seen 192)")
    bad_setting = example_record("failed", error="configuration error: retention.ratio=1.5 must lie in (0, 1]",
                                 config={"seed": 0})
    for name, data in {**runs, "running": running, "no_init": no_init, "diverged": diverged,
                       "bad_setting": bad_setting}.items():
        folder = tmp_path / "multirun" / name
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(data))
    corrupt = tmp_path / "multirun" / "corrupt" / "nested"
    corrupt.mkdir(parents=True)
    (corrupt / "results.json").write_text('{"teacher": {"name": "t1"')
    return tmp_path / "multirun"


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_report_tables_plots_failed_and_incomplete_runs(multirun, capsys):
    assert main([str(multirun)]) == 0
    out = multirun / "report"
    printed = capsys.readouterr().out
    assert printed.strip() == (out / "report.md").read_text().strip()

    assert _rows(out / "zero_shot.csv") == [
        ["teacher", "policy", "ratio", "eval set", "teacher PPL", "naive", "zero_gate", "phase2", "full",
         "full (row_repeat)", "teacher NLU avg", "NLU avg full", "RULER full"],
        ["t1", "uniform", "0.5", "shakespeare", "20.00", "1,500.0", "40.00", "27.50", "25.00", "33.00",
         "0.650", "0.450", "0.500"],
        ["t1", "explicit", "0.5", "shakespeare", "20.00", "2,180.0", "22.90", "-", "21.80", "-", "-", "-", "-"],
    ]  # policies in the paper's order (uniform, ar, ga_s2), then explicit
    assert _rows(out / "phase_ablation.csv") == [
        ["teacher", "policy", "ratio", "eval set", "GQA expansion", "naive", "zero_gate", "phase1", "phase2", "full",
         "naive/full", "phase2/full"],
        ["t1", "uniform", "0.5", "shakespeare", "whole_head", "1,500.0", "40.00", "-", "27.50", "25.00", "60.00x",
         "1.10x"],
        ["t1", "uniform", "0.5", "shakespeare", "row_repeat", "-", "-", "-", "-", "33.00", "n/a", "n/a"],
        ["t1", "explicit", "0.5", "shakespeare", "whole_head", "2,180.0", "22.90", "-", "-", "21.80", "100.00x",
         "n/a"],
    ]
    head = ["t1", "explicit", "0.5", "shakespeare"]
    uni = ["t1", "uniform", "0.5", "shakespeare"]
    efficiency = _rows(out / "token_efficiency.csv")
    # every init with a curve is compared with zero_gate, each with its tokens and gain
    assert efficiency[0] == ["teacher", "policy", "ratio", "eval set", "target", "target PPL", "zero_gate tokens",
                             "naive tokens", "naive gain", "full tokens", "full gain"]
    # naive: explicit never gets below 90; uniform reaches 30 at 1,000 and 25 at 2,000 (zero_gate: 714, 1,400)
    assert [row[7:9] for row in efficiency[9:17]] == [["not reached", "n/a"]] * 8
    assert [row[7:9] for row in efficiency[4:6]] == [["2,000", "0.70x"], ["1,000", "0.71x"]]
    assert [row[:7] + row[9:] for row in efficiency[1:]] == [
        uni + ["1.10x teacher", "22.00", "not reached", "1,500", ">=2.00x"],
        uni + ["1.15x teacher", "23.00", "2,714", "821", "3.31x"],
        uni + ["1.20x teacher", "24.00", "1,800", "464", "3.88x"],
        uni + ["1.25x teacher", "25.00", "1,400", "107", "13.08x"],
        uni + ["1.50x teacher", "30.00", "714", "<=0", ">=inf"],
        uni + ["2.00x teacher", "40.00", "<=0", "<=0", "n/a"],
        uni + ["3.00x teacher", "60.00", "<=0", "<=0", "n/a"],
        uni + ["zero_gate final", "22.80", "3,000", "893", "3.36x"],
        # interpolated between evaluations, e.g. zero_gate 500 (22.9) -> 1000 (21.9) reaches 22.0 at 950
        head + ["1.10x teacher", "22.00", "950", "<=500", ">=1.90x"],
        head + ["1.15x teacher", "23.00", "<=500", "<=500", "n/a"],
        head + ["1.20x teacher", "24.00", "<=500", "<=500", "n/a"],
        head + ["1.25x teacher", "25.00", "<=500", "<=500", "n/a"],
        head + ["1.50x teacher", "30.00", "<=500", "<=500", "n/a"],
        head + ["2.00x teacher", "40.00", "<=500", "<=500", "n/a"],
        head + ["3.00x teacher", "60.00", "<=500", "<=500", "n/a"],
        head + ["zero_gate final", "21.00", "2,000", "1,286", "1.56x"],
    ]
    md = (out / "report.md").read_text()
    assert "| t1 | uniform | 0.5 | shakespeare | whole_head | 1,500.0 | 40.00 | - | 27.50 | 25.00 | 60.00x | 1.10x |" in md

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["curve_t1_explicit_r0.5_shakespeare.png", "curve_t1_uniform_r0.5_shakespeare.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert f"]({name})" in md
    assert not list(out.glob("*.tmp"))

    failed, rest = md.split("## Failed runs")[1].split("## Incomplete runs")
    incomplete, damaged = rest.split("## Damaged records")
    assert failed.strip().splitlines() == [
        "- `bad_setting/results.json`: configuration error: retention.ratio=1.5 must lie in (0, 1] (after: nothing)",
        "- `diverged/results.json`: Divergence: distill: perplexity on eval set 'shakespeare' is nan at step 3 "
        "(tokens_seen 192) (after: initialized)"]
    assert incomplete.strip().splitlines() == ["- `running/results.json`: status is 'initialized'"]
    damaged = damaged.strip().splitlines()
    assert damaged[0].startswith("- `corrupt/nested/results.json`: not valid JSON (")
    assert damaged[1:] == ["- `no_init/results.json`: field 'init_mode': missing (a record with status 'complete' "
                           "holds it)"]
    assert "8 complete runs, 2 failed, 1 incomplete, 2 damaged." in md


def test_records_of_version_1_report_and_plot_alike(multirun, tmp_path):
    """The same runs recorded as version 1 wrote them (settings copied to the top level, an older config without
    them) give the same tables and plots."""
    assert main([str(multirun), "--out", str(tmp_path / "new")]) == 0
    for path in multirun.glob("*/results.json"):
        record = json.loads(path.read_text())
        if record.get("schema_version") == 2 and record["status"] == "complete":
            old = as_version_1(record)
            path.write_text(json.dumps({**old, "config": {"seed": 0, "stage": old["config"]["stage"]}}))
    assert main([str(multirun), "--out", str(tmp_path / "old")]) == 0
    for name in ("zero_shot.csv", "phase_ablation.csv", "token_efficiency.csv", "report.md"):
        assert (tmp_path / "old" / name).read_text() == (tmp_path / "new" / name).read_text()
    assert sorted(p.name for p in (tmp_path / "old").glob("*.png")) == sorted(
        p.name for p in (tmp_path / "new").glob("*.png")) != []


def test_other_baseline_and_out_folder(multirun, tmp_path):
    """--baseline naive: the explicit naive curve starts above every target, so no bounds there."""
    out = tmp_path / "elsewhere"
    main([str(multirun), "--out", str(out), "--baseline", "naive", "--calibrated", "full,phase2"])
    rows = _rows(out / "token_efficiency.csv")  # uniform's 8 target rows first, then explicit's
    assert rows[0][6:] == ["naive tokens", "full tokens", "full gain", "phase2 tokens", "phase2 gain"]
    assert rows[9] == ["t1", "explicit", "0.5", "shakespeare", "1.10x teacher", "22.00", "not reached", "<=500",
                       ">=4.00x", "-", "-"]
    efficiency_section = (out / "report.md").read_text().split("## Token efficiency")[1].split("## After")[0]
    assert "t1 / explicit / 0.5: no curve for phase2" in efficiency_section
    assert "t1 / uniform / 0.5: no curve for phase2" in efficiency_section
    assert not (multirun / "report").exists()


def test_efficiency_ratio_bounds():
    assert efficiency_ratio(Reach(1000, "upper"), Reach(500, "exact")) == "<=2.00x"
    assert efficiency_ratio(Reach(1000, "exact"), Reach(500, "upper")) == ">=2.00x"
    assert efficiency_ratio(Reach(3000, "never"), Reach(1000, "exact")) == ">=3.00x"
    assert efficiency_ratio(Reach(3000, "exact"), Reach(1000, "never")) == "n/a"
    assert efficiency_ratio(Reach(500, "upper"), Reach(500, "upper")) == "n/a"
    assert figures.reach([(0, 30.0), (100, 20.0)], 20.0) == Reach(100, "exact")


def test_formatting():
    assert fmt_ppl(29.4) == "29.40" and fmt_ppl(1000.0) == "1000.00" and fmt_ppl(12345.67) == "12,345.7"
    assert fmt_ppl(None) == "-" and fmt_ratio(2.0) == "2.00x" and fmt_ratio(None) == "n/a"


def test_console_script(multirun, tmp_path):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "tcal.tools.report", str(multirun), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert "## Token efficiency" in done.stdout and (out / "zero_shot.csv").exists()


def _trained(init, stage, ppl, curve=None, nlu=None, tokens=(100,)):
    extra = {"harness": {"teacher": {}, "student": {"tcal_cloze": {"acc": nlu}}}} if nlu is not None else {}
    stages = {kind: example_stage(kind, t) for kind, t in zip(("align", "distill"), tokens)}
    return _result("uniform", init, ppl, curve, stage=stage, stages=stages, **extra)


def test_tables_pick_runs_by_stage_and_after_training(tmp_path):
    """Zero-shot tables read stage-none runs, token efficiency the Stage 2 curves, and the after-training table
    the align and align_distill runs, although all share teacher, policy, ratio and init."""
    runs = {
        "zs_zero_gate": _result("uniform", "zero_gate", 40.0),
        "zs_full": _result("uniform", "full", 30.0),
        "d_zero_gate": _trained("zero_gate", "distill", 24.0, [(0, 40.0), (100, 30.0), (200, 24.0)]),
        "d_full": _trained("full", "distill", 22.0, [(0, 30.0), (100, 24.0), (200, 22.0)]),
        "a_zero_gate": _trained("zero_gate", "align", 35.0, nlu=0.2),
        "a_full": _trained("full", "align", 28.0, nlu=0.3),
        "ad_full": _trained("full", "align_distill", 21.0, nlu=0.4, tokens=(100, 300)),
    }
    for name, data in runs.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "results.json").write_text(json.dumps(data))
    main([str(tmp_path / "m"), "--out", str(tmp_path / "r")])
    zero_shot = _rows(tmp_path / "r" / "zero_shot.csv")
    assert zero_shot[1][5:7] == ["40.00", "30.00"]  # the stage-none runs
    efficiency = {row[4]: row[6:] for row in _rows(tmp_path / "r" / "token_efficiency.csv")[1:]}
    assert efficiency["1.20x teacher"] == ["200", "100", "2.00x"]  # target 24: zero_gate at 200, full at 100
    assert _rows(tmp_path / "r" / "after_training.csv")[1:] == [
        ["t1", "uniform", "0.5", "shakespeare", "zero_gate", "100", "35.00", "0.200", "-", "-", "-", "-", "-"],
        ["t1", "uniform", "0.5", "shakespeare", "full", "100", "28.00", "0.300", "-", "400", "21.00", "0.400", "-"],
    ]
    assert "duplicate" not in (tmp_path / "r" / "report.md").read_text()
    assert [p.name for p in (tmp_path / "r").glob("*.png")] == ["curve_t1_uniform_r0.5_shakespeare.png"]  # Stage 2


def _by_position(teacher, student, edges=(0, 512, 1024, 2048, 4096)):
    return [{"start": start, "end": end, "tokens": 4 * (end - start), "teacher_ppl": t, "student_ppl": s}
            for start, end, t, s in zip(edges, edges[1:], teacher, student)]


def test_position_table_and_plot(tmp_path):
    """Per bucket: the teacher's PPL, each init's PPL and its ratio to the teacher's; an init without buckets and a
    trained run are left out; one ratio-against-position PNG per group and eval set."""
    teacher = (30.0, 20.0, 16.0, 15.0)
    runs = {"naive": _result("uniform", "naive", 500.0), "full": _result("uniform", "full", 25.0),
            "zero_gate": _result("uniform", "zero_gate", 40.0),
            "full_trained": _trained("full", "distill", 21.0)}
    runs["naive"]["metrics"]["shakespeare"]["by_position"] = _by_position(teacher, (300.0, 400.0, 800.0, 1500.0))
    runs["full"]["metrics"]["shakespeare"]["by_position"] = _by_position(teacher, (33.0, 24.0, 24.0, 30.0))
    runs["full_trained"]["metrics"]["shakespeare"]["by_position"] = _by_position(teacher, (1.0, 1.0, 1.0, 1.0))
    for name, data in runs.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "results.json").write_text(json.dumps(data))
    main([str(tmp_path / "m"), "--out", str(tmp_path / "r")])
    head = ["t1", "uniform", "0.5", "shakespeare"]
    assert _rows(tmp_path / "r" / "by_position.csv") == [
        ["teacher", "policy", "ratio", "eval set", "positions", "teacher PPL", "naive PPL", "naive/teacher",
         "full PPL", "full/teacher"],
        head + ["0-511", "30.00", "300.00", "10.00x", "33.00", "1.10x"],
        head + ["512-1023", "20.00", "400.00", "20.00x", "24.00", "1.20x"],
        head + ["1024-2047", "16.00", "800.00", "50.00x", "24.00", "1.50x"],
        head + ["2048-4095", "15.00", "1,500.0", "100.00x", "30.00", "2.00x"],
    ]
    plot = tmp_path / "r" / "position_t1_uniform_r0.5_shakespeare.png"
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert f"]({plot.name})" in (tmp_path / "r" / "report.md").read_text()


def test_a_damaged_record_is_named_and_the_good_run_reported(tmp_path, capsys):
    """One good run, one record with a field of the wrong type and one of a newer schema version: the good run is
    in the tables, each other one is named with its field and why, in report.md and on stderr."""
    wrong_type = _result("uniform", "naive", 30.0)
    wrong_type["keep_layers"] = "0,2"
    records = {"good": _result("uniform", "full", 25.0), "wrong_type": wrong_type,
               "newer": {**_result("uniform", "zero_gate", 40.0), "schema_version": 99}}
    for name, data in records.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "results.json").write_text(json.dumps(data))
    assert main([str(tmp_path / "m"), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr()
    assert _rows(tmp_path / "r" / "zero_shot.csv") == [
        ["teacher", "policy", "ratio", "eval set", "teacher PPL", "full"],
        ["t1", "uniform", "0.5", "shakespeare", "20.00", "25.00"]]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "1 complete runs, 0 failed, 0 incomplete, 2 damaged." in md
    assert md.split("## Damaged records")[1].strip().splitlines() == [
        "- `newer/results.json`: field 'schema_version': version 99 is not one this tcal reads (0, 1, 2); written by "
        "another version of tcal?",
        "- `wrong_type/results.json`: field 'keep_layers': expected a list, got '0,2'"]
    assert printed.err.splitlines() == [
        f"tcal-report: not read: {tmp_path / 'm' / 'newer' / 'results.json'}: field 'schema_version': version 99 is "
        f"not one this tcal reads (0, 1, 2); written by another version of tcal?",
        f"tcal-report: not read: {tmp_path / 'm' / 'wrong_type' / 'results.json'}: field 'keep_layers': expected a "
        f"list, got '0,2'"]
    assert printed.out.strip() == md.strip()


def test_runs_of_one_init_that_differ_in_a_setting_are_told_apart(tmp_path):
    """Two full_plus runs calibrated on other windows, and a third evaluated on longer windows, each get a column,
    named by the settings that differ (a setting only the newer record holds does not count); a run that differs
    from one of them only in output settings is a duplicate, listed and ignored."""
    def run(ppl, seq_len, **other):
        config = {"seed": 0, "calibration": {"seq_len": seq_len, "lr": 0.001}, "eval": {"seq_len": 512},
                  "paths": {"output_dir": "a"}}
        for key, value in other.items():
            config[key] = {**config.get(key, {}), **value}
        return _result("uniform", "full_plus", ppl, config=config)

    runs = {"short": run(25.0, 256), "long": run(24.0, 2048, teacher={"trust_remote_code": False}),
            "short_longer_eval": run(26.0, 256, eval={"seq_len": 4096}),
            "short_again": run(25.0, 256, paths={"output_dir": "b"})}
    for name, data in runs.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "results.json").write_text(json.dumps(data))
    assert main([str(tmp_path / "m"), "--out", str(tmp_path / "r")]) == 0
    assert _rows(tmp_path / "r" / "zero_shot.csv") == [
        ["teacher", "policy", "ratio", "eval set", "teacher PPL",
         "full_plus (calibration.seq_len=256, eval.seq_len=512)", "full_plus (calibration.seq_len=256, "
         "eval.seq_len=4096)", "full_plus (calibration.seq_len=2048, eval.seq_len=512)"],
        ["t1", "uniform", "0.5", "shakespeare", "20.00", "25.00", "26.00", "24.00"]]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "- `short_again/results.json`: duplicate of" in md and str(tmp_path / "m" / "short" / "results.json") in md


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a folder no user can write in")
@pytest.mark.parametrize("flags,named", [
    (["--out", "/proc/tcal-report"], "--out /proc/tcal-report cannot be written"),
    (["--calibrated", "full,,phase2"], "argument --calibrated: 'full,,phase2'"),
    (["--calibrated", ""], "argument --calibrated: ''"),
    (["--baseline", " "], "argument --baseline: ' '"),
], ids=["out_unwritable", "calibrated_empty_item", "calibrated_empty", "baseline_empty"])
def test_arguments_that_cannot_mean_anything_are_one_line_before_any_record_is_read(flags, named, multirun, capsys,
                                                                                   monkeypatch):
    """An --out no user can write (once: every record was read and the tables built, then a traceback), an
    --calibrated with an empty init, an empty --baseline: one line, exit code 2, before any record is read."""
    from tcal.tools import report

    def read(*args, **kwargs):
        raise AssertionError("records were read")

    monkeypatch.setattr(report, "collect", read)
    with pytest.raises(SystemExit) as stopped:
        main([str(multirun), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and named in err[-1] and "Traceback" not in "\n".join(err), err
