"""The results.json schema (`tcal.store.record`): what is written is what is read back, and a damaged record, a field of
the wrong type or an unknown schema version is refused with the file and the field named."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from conftest import as_version_1, example_record, example_stage

from tcal.cli.app import recorded_run
from tcal.errors import ConfigError, FolderInUse
from tcal.store.record import (
    FIELDS,
    SCHEMA_VERSION,
    RecordError,
    check_record,
    is_stage_record,
    load_record,
    read_record,
    record_failure,
    recorded_num_layers,
    recorded_setting,
    write_record,
)


def _write(tmp_path, data) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _refused(path) -> RecordError:
    with pytest.raises(RecordError) as caught:
        load_record(path)
    return caught.value


def test_a_written_record_reads_back_whole(tmp_path):
    curve = {"shakespeare": [{"tokens": 0, "ppl": 40.0}, {"tokens": 64, "ppl": 30.0}]}
    bucket = {"start": 0, "end": 16, "tokens": 32, "teacher_ppl": 20.0, "student_ppl": 22.0}
    record = example_record(
        stage="distill", stages={"distill": example_stage("distill", 64, curve)}, curve=curve,
        metrics={"shakespeare": {"teacher_ppl": 20.0, "student_ppl": 25.0, "by_position": [bucket]}},
        harness={"teacher": {"tcal_cloze": {"acc": 0.5}}, "student": {"tcal_cloze": {"acc": 0.25}}},
        ruler={"teacher": {"512": {"niah_single": 1.0}}, "student": {"512": {"niah_single": 0.5}}},
        student_path="run/student")
    path = tmp_path / "results.json"
    write_record(path, json.loads(json.dumps(record)))
    assert load_record(path) == record
    assert record["schema_version"] == SCHEMA_VERSION == 2
    assert record["config"]["stage"] == {"name": "distill", "kind": "distill"}
    running = example_record("trained_align", stage="align_distill", curve=curve,
                             stages={"align": example_stage("align", 64, curve), "distill": {"curve": curve}})
    write_record(path, running)  # the record while Stage 2 trains: its stage holds only its curve so far
    assert load_record(path)["stages"]["distill"] == {"curve": curve}


def test_damaged_json_names_the_file(tmp_path):
    text = json.dumps(example_record())
    err = _refused(_write(tmp_path, text[:100]))
    assert (err.path, err.field) == (tmp_path / "results.json", None)
    assert str(err).startswith(f"{tmp_path / 'results.json'}: not valid JSON (")
    assert _refused(_write(tmp_path, "[1, 2]")).why == "not a JSON object"
    nan = _refused(_write(tmp_path, text.replace('"student_ppl": 25.0', '"student_ppl": NaN')))
    assert nan.why == "not valid JSON (NaN is not strict JSON)"


@pytest.mark.parametrize("change, field, why", [
    (lambda r: r.update(ratio="half"), "ratio", "expected a number (null for NaN or infinite), got 'half'"),
    (lambda r: r.update(num_layers=4.0), "num_layers", "expected an integer, got 4.0"),
    (lambda r: r.update(keep_layers=[0, True]), "keep_layers[1]", "expected an integer, got True"),
    (lambda r: r.update(stages={"distill": {**example_stage(), "tokens_seen": "64"}}), "stages.distill.tokens_seen",
     "expected an integer, got '64'"),
    (lambda r: r.update(stages={"distill": {"curve": {}, "steps": 1}}), "stages.distill.kind", "missing"),
    (lambda r: r["metrics"]["shakespeare"].pop("teacher_ppl"), "metrics.shakespeare.teacher_ppl", "missing"),
    (lambda r: r["metrics"]["shakespeare"].update(ppl=1.0), "metrics.shakespeare.ppl", "not a field of this object"),
    (lambda r: r.pop("num_layers"), "num_layers", "missing (a record with status 'complete' holds it)"),
    (lambda r: r.update(status="running"), "status",
     "'running' is not a status (converted, initialized, trained_<stage>, complete, failed)"),
    (lambda r: r.update(error="boom"), "error", "only a failed record holds it (status is 'complete')"),
    (lambda r: r.update(accuracy=0.5), "accuracy", "not a field of a results.json record"),
])
def test_a_field_that_does_not_fit_is_named(tmp_path, change, field, why):
    record = example_record()
    change(record)
    err = _refused(_write(tmp_path, record))
    assert (err.field, err.why) == (field, why)
    assert str(err) == f"{tmp_path / 'results.json'}: field {field!r}: {why}"


@pytest.mark.parametrize("version", [3, 99, "1", True, None])
def test_an_unknown_schema_version_is_named(tmp_path, version):
    err = _refused(_write(tmp_path, {**example_record(), "schema_version": version}))
    assert err.field == "schema_version"
    assert err.why == (f"version {json.dumps(version)} is not one this tcal reads (0, 1, 2); written by another "
                       f"version of tcal?")


def test_a_record_without_a_version_is_read_as_version_0_and_rewritten_as_version_2(tmp_path):
    old = as_version_1(example_record("initialized"))
    del old["schema_version"]
    path = _write(tmp_path, old)
    assert load_record(path) == old
    for field in ("calibration", "init_mode", "teacher"):  # version 0 has version 1's fields
        assert _refused(_write(tmp_path, {k: v for k, v in old.items() if k != field})).field == field
    path = _write(tmp_path, old)
    write_record(path, example_record("complete"), earlier=load_record(path))
    continued = load_record(path)
    assert continued["schema_version"] == 2 and continued["num_layers"] == 4 and continued["status"] == "complete"
    assert not {"teacher", "retention", "ratio", "init_mode", "gqa_expansion", "stage"} & set(continued)


def test_the_settings_of_a_record_of_any_version_are_read_alike(tmp_path):
    """Version 2 holds the settings in `config` alone; versions 0 and 1 also copied six to the top level, and an
    old config may lack a key: its copy is read then. A version 1 record marked failed is rewritten as version 2."""
    trained = example_record(retention="explicit", ratio=None, init_mode="phase2", gqa_expansion="row_repeat",
                             stage="align_distill")
    expected = {"teacher.name": "t1", "retention.name": "explicit", "retention.ratio": None, "init.name": "phase2",
                "init.gqa_expansion": "row_repeat", "stage": "align_distill"}
    old = as_version_1(trained)
    older_config = {**old, "config": {"seed": 0}}
    for record in (trained, old, older_config, {**older_config, "schema_version": 0}):
        assert {key: recorded_setting(record, key) for key in expected} == expected
        assert recorded_num_layers(record) == 4
    assert old["teacher"] == {"name": "t1", "num_layers": 4} and "num_layers" not in old
    with pytest.raises(KeyError):
        recorded_setting({"config": {"seed": 0}}, "init.name")
    path = _write(tmp_path, old)
    record_failure(tmp_path, RuntimeError("boom"))
    failed = load_record(path)
    assert failed["schema_version"] == 2 and failed["num_layers"] == 4 and failed["failed_after"] == "complete"
    assert recorded_setting(failed, "init.name") == "phase2"


def test_the_fields_required_grow_with_the_status():
    converted = example_record("converted")
    assert "calibration" not in converted and "metrics" not in converted
    with pytest.raises(RecordError, match=r"field 'calibration': missing \(a record with status 'initialized'"):
        check_record({**converted, "status": "initialized"}, "x")
    failed = example_record("failed", "initialized")
    assert {"calibration", "init_weights_digest", "error"} <= set(failed) and "metrics" not in failed
    assert set(example_record("failed")) == {"schema_version", "status", "failed_after", "error"}


def test_a_record_that_does_not_fit_is_never_written(tmp_path):
    path = _write(tmp_path, example_record())
    before = path.read_bytes()
    bad = example_record()
    bad["timings"] = {"init": "slow"}
    with pytest.raises(RecordError, match=r"field 'timings.init': expected a number"):
        write_record(path, bad)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_resume_or_rerun_names_a_damaged_record_or_an_unknown_version(tmp_path, caplog):
    record = example_record("initialized")
    record["teacher"] = "t1"
    path = _write(tmp_path, record)
    with caplog.at_level(logging.WARNING, logger="tcal.store.record"):
        assert read_record(tmp_path) is None  # a rerun into the folder starts again, and says why
    assert caplog.messages == [f"results of an earlier run cannot be used: {path}: field 'teacher': expected a "
                               f"JSON object, got 't1'; starting again"]
    with pytest.raises(ConfigError, match=rf"^resume='{tmp_path}': {path}: field 'teacher': expected a JSON object"):
        recorded_run(tmp_path)
    newer = _write(tmp_path, {**example_record(), "schema_version": 3})
    kept = newer.read_bytes()
    with pytest.raises(FolderInUse, match=rf"^{newer}: field 'schema_version': version 3 is not one this tcal reads"):
        read_record(tmp_path)  # maybe a newer tcal's results: the folder is refused, not run again
    assert newer.read_bytes() == kept
    _write(tmp_path, example_record("failed"))
    with pytest.raises(ConfigError, match=r"holds no config \(its run failed before any work\)"):
        recorded_run(tmp_path)


def test_the_method_document_lists_every_field():
    section = (Path(__file__).parents[1] / "docs" / "method.md").read_text().split("## 14. The record: results.json")[1]
    listed = {name for line in section.splitlines() if line.startswith("| `")
              for name in re.findall(r"`([a-z_]+)`", line.split(" | ")[0])}
    assert listed == set(FIELDS)


def test_a_stage_record_of_older_code_is_not_taken_from_the_stage1_cache():
    older = example_stage("align")
    del older["rank_weight_digests"]
    assert is_stage_record(example_stage("align"))
    assert not is_stage_record(older) and not is_stage_record({"curve": {}}) and not is_stage_record(None)
