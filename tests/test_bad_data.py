"""Bad data: empty files, non-UTF-8 bytes, jsonl lines that are not JSON or lack the text
field fail with a DataError naming the file and line; jsonl lines with empty text are skipped and counted in
the log. (Files shorter than the windows they must fill: test_validate.py and test_training.py.)"""

from __future__ import annotations

import json
import logging

import pytest
from conftest import repo_cache_dir

from tcal.data.documents import file_documents
from tcal.errors import ConfigError, DataError
from tcal.pipeline import run

GOOD = "A line of good text.\n"


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", b"", r"empty.txt: the file is empty"),
    ("blank.txt", b" \n\n\t\n", r"blank.txt: the file is empty"),
    ("latin1.txt", GOOD.encode() + "caf\xe9 au lait\n".encode("latin-1"),
     r"latin1.txt: line 2: bytes that are not UTF-8 \(b'\\xe9' at byte 24\)"),
    ("latin1.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl: line 2: bytes that are not UTF-8"),
    ("broken.jsonl", b'{"text": "fine"}\n\n{"text": "cut', r"broken.jsonl: line 3: not JSON \(Unterminated string"),
    ("nofield.jsonl", b'{"text": "fine"}\n{"body": "no text field"}\n',
     r"nofield.jsonl: line 2: no string field 'text' \(found \['body'\]\)"),
    ("number.jsonl", b'{"text": 42}\n', r"number.jsonl: line 1: no string field 'text' \(found \['text'\]\)"),
    ("list.jsonl", b'["text"]\n', r"list.jsonl: line 1: no string field 'text' \(found list\)"),
    ("only_empty.jsonl", b'{"text": ""}\n{"text": "  "}\n', r"only_empty.jsonl: no line holds text"),
])
def test_bad_file_is_named_with_its_line(name, content, match, tmp_path):
    fine, path = tmp_path / "fine.txt", tmp_path / name
    fine.write_text(GOOD)
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        file_documents([fine, path])  # the good file before it changes nothing
    assert str(path) in str(info.value) and isinstance(info.value, ConfigError)


def test_empty_jsonl_texts_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "rows.jsonl"
    rows = [{"text": "first"}, {"text": ""}, None, {"text": "third", "id": 3}, {"text": "   "}]
    path.write_text("\n".join("" if r is None else json.dumps(r) for r in rows) + "\n")
    with caplog.at_level(logging.WARNING):
        docs = file_documents([path])
    assert [(d.name, d.text) for d in docs] == [("rows:0", "first"), ("rows:3", "third")]
    assert f"{path}: skipped 2 lines whose text is empty" in caplog.text


def test_bad_training_file_stops_the_run_before_anything_is_written(compose_cfg, tmp_path):
    files = [tmp_path / f"doc{i}.txt" for i in range(3)]
    for path in files:
        path.write_text("Words and more words. " * 200)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"}\nnot json\n')
    cfg = compose_cfg("experiment=smoke", f"paths.cache_dir={repo_cache_dir()}", "data.source=files",
                      f"data.files=[{','.join(map(str, [*files, bad]))}]", "data.calibration_docs=1",
                      "data.evaluation_docs=1")
    with pytest.raises(DataError, match=r"bad.jsonl: line 3: not JSON"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
