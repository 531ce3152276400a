"""The Stage 1 cache sees content, and a Stage 1 taken from it is logged like one computed: an eval file edited
between two runs is measured again (the curve is never the old text's), and the second run's metrics.csv holds the
cached stage's curve panels."""

from __future__ import annotations

import csv
import json

from conftest import compose, isolated_cache_dir

from tcal.pipeline import run

ALIGN = ("experiment=smoke", "init=naive", "eval.num_windows=2", "save_student=false", "stage=align",
         "stage.batch_size=2", "stage.seq_len=32", "stage.max_tokens=128", "stage.eval_every_tokens=64")


def logged_curve(run_dir) -> list[tuple[str, str]]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        return [(row["align/tokens_seen"], row["align/ppl/extra"]) for row in csv.DictReader(handle)
                if row.get("align/ppl/extra")]


def test_an_edited_eval_file_is_measured_again_and_a_cached_stage_is_logged(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    extra = tmp_path / "extra.txt"
    extra.write_text("The quality of mercy is not strained; it droppeth as the gentle rain from heaven. " * 60)
    settings = compose(*ALIGN, f"data.eval_files=[{extra}]", f"paths.cache_dir={cache}")
    first = run(settings, tmp_path / "first")
    again = run(settings, tmp_path / "again")
    assert not first["stages"]["align"]["cached"] and again["stages"]["align"]["cached"]
    assert logged_curve(tmp_path / "again") == logged_curve(tmp_path / "first") and logged_curve(tmp_path / "first")
    extra.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 60)
    edited = run(settings, tmp_path / "edited")
    assert not edited["stages"]["align"]["cached"]
    assert edited["curve"]["extra"] != first["curve"]["extra"]
    # the curve's last point is the stage's end, measured on the text the run evaluates
    record = json.loads((tmp_path / "edited" / "results.json").read_text())
    assert record["stages"]["align"]["curve"]["extra"][-1] == edited["curve"]["extra"][-1]
