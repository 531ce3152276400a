"""tcal-report never skips or crashes on a readable record: run folders reached through symlinks are reported (each
record once, however many links reach it, a link looping back followed once), and a schema-valid record whose
curve or position buckets hold null (a non-finite value) is reported beside the others."""

from __future__ import annotations

import json
import os

from conftest import example_record

from tcal.store.record import recorded_setting, write_record
from tcal.tools.figures import collect
from tcal.tools.report import main


def result(init: str, ppl: float, curve=None, **extra) -> dict:
    fields = {"init_mode": init, "metrics": {"shakespeare": {"teacher_ppl": 20.0, "student_ppl": ppl}}}
    if curve is not None:
        fields["curve"] = {"shakespeare": [{"tokens": t, "ppl": p} for t, p in curve]}
    return example_record(**fields, **extra)


def put(folder, data) -> None:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(data))


def test_runs_reached_through_symlinks_are_reported_once(tmp_path):
    put(tmp_path / "scratch" / "sweep_a" / "0", result("naive", 30.0))
    put(tmp_path / "scratch" / "sweep_b" / "0", result("full", 25.0))
    put(tmp_path / "project" / "local" / "0", result("zero_gate", 40.0))
    (tmp_path / "project" / "a").symlink_to(tmp_path / "scratch" / "sweep_a", target_is_directory=True)
    (tmp_path / "project" / "b").symlink_to(tmp_path / "scratch" / "sweep_b", target_is_directory=True)
    (tmp_path / "project" / "b_again").symlink_to(tmp_path / "scratch" / "sweep_b", target_is_directory=True)
    (tmp_path / "scratch" / "sweep_a" / "loop").symlink_to(tmp_path / "project", target_is_directory=True)
    found = collect(tmp_path / "project")
    assert sorted(run.init for run in found.runs) == ["full", "naive", "zero_gate"]
    assert not found.incomplete and not found.damaged and not found.failed
    main([str(tmp_path / "project"), "--out", str(tmp_path / "report")])
    assert "3 complete runs" in (tmp_path / "report" / "report.md").read_text()


def test_a_symlinked_record_file_is_reported(tmp_path):
    put(tmp_path / "elsewhere", result("full", 25.0))
    (tmp_path / "m" / "run").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere" / "results.json", tmp_path / "m" / "run" / "results.json")
    assert [run.init for run in collect(tmp_path / "m").runs] == ["full"]


def test_null_values_in_a_curve_or_buckets_are_reported_beside_the_other_runs(tmp_path):
    diverged_curve = result("zero_gate", 40.0, [(0, 40.0), (100, float("nan")), (200, float("inf"))],
                            stage="distill", stages={})
    nulls = result("full", 25.0, [(0, 30.0), (100, float("nan")), (200, 25.0)], stage="distill", stages={})
    buckets = result("naive", 30.0)
    buckets["metrics"]["shakespeare"]["by_position"] = [
        {"start": 0, "end": 32, "tokens": 64, "teacher_ppl": 20.0, "student_ppl": float("inf")},
        {"start": 32, "end": 64, "tokens": 64, "teacher_ppl": 20.0, "student_ppl": 31.0}]
    for name, data in {"diverged_curve": diverged_curve, "nulls": nulls, "buckets": buckets}.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        write_record(tmp_path / "m" / name / "results.json", data)  # as a run writes it: strict JSON, nulls
    written = json.loads((tmp_path / "m" / "nulls" / "results.json").read_text())
    assert written["curve"]["shakespeare"][1]["ppl"] is None
    assert main([str(tmp_path / "m"), "--out", str(tmp_path / "r")]) == 0
    found = collect(tmp_path / "m")
    assert sorted(run.init for run in found.runs) == ["full", "naive", "zero_gate"]
    curves = {run.init: run.curve for run in found.runs}
    assert curves["full"] == [(0, {"shakespeare": 30.0}), (200, {"shakespeare": 25.0})]  # the null point left out
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert "3 complete runs" in markdown and "non-finite" in markdown  # the infinite bucket, shown as such


def test_a_record_the_report_cannot_use_is_listed_and_the_others_reported(tmp_path, monkeypatch):
    """Whatever a single record trips in the report's reading, that record is named and the others reported."""
    import tcal.tools.figures as figures

    put(tmp_path / "m" / "good", result("full", 25.0))
    put(tmp_path / "m" / "odd", result("naive", 30.0))
    normalize = figures._normalize
    monkeypatch.setattr(figures, "_normalize", lambda path, data: normalize(path, data)
                        if recorded_setting(data, "init.name") == "full"
                        else (_ for _ in ()).throw(TypeError("something unexpected")))
    found = collect(tmp_path / "m")
    assert [run.init for run in found.runs] == ["full"]
    assert found.incomplete == [(tmp_path / "m" / "odd" / "results.json",
                                 "cannot be reported (TypeError: something unexpected)")]
