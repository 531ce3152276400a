"""The one cache (`tcal.store.cache`): one INFO line per build and per reuse, damaged or foreign entries rebuilt with a
warning, an entry written as soon as it is built, and two processes that need the same calibrated layers from a
cold cache build each layer once and end with the same weights."""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import compose, isolated_cache_dir
from safetensors.torch import save_file

from tcal.store.cache import get_or_build, get_or_build_each, key_lock, tensor_codec

TENSORS = tensor_codec(lambda value: ({"w": value["w"]}, value["record"]),
                       lambda tensors, record: {"w": tensors["w"], "record": record})


def cache_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("cache ")]


def test_a_build_and_each_reuse_log_one_line_naming_kind_and_key(tmp_path, caplog):
    value = {"w": torch.arange(6.0).view(2, 3), "record": {"loss": [1.5, 0.25]}}
    with caplog.at_level(logging.INFO, logger="tcal.store.cache"):
        built = get_or_build("calibration", "k1", lambda: value, folder=tmp_path, codec=TENSORS)
        again = get_or_build("calibration", "k1", lambda: pytest.fail("built twice"), folder=tmp_path, codec=TENSORS)
        scores = get_or_build("retention", "ar-k2", lambda: {"1": 2.0}, folder=tmp_path / "r")
        assert get_or_build("retention", "ar-k2", lambda: pytest.fail("built twice"), folder=tmp_path / "r") == scores
    assert built is value and torch.equal(again["w"], value["w"]) and again["record"] == value["record"]
    assert cache_lines(caplog) == ["cache calibration: built k1", "cache calibration: reused k1",
                                   "cache retention: built ar-k2", "cache retention: reused ar-k2"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == ["k1.safetensors"]
    assert json.loads((tmp_path / "r" / "ar-k2.json").read_text()) == {"value": {"1": 2.0}, "tcal_key": "ar-k2"}


def test_no_folder_builds_every_time_and_writes_nothing(tmp_path):
    calls = []
    for _ in range(2):
        assert get_or_build("tokens", "k", lambda: calls.append(1) or 7, folder=None) == 7
    assert len(calls) == 2 and not list(tmp_path.iterdir())


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def no_record(path: Path) -> None:
    save_file({"w": torch.ones(1)}, str(path))  # a safetensors file, but not a tcal entry


def refused(path: Path) -> None:
    """A whole entry of the right key whose content `decode` refuses (here: no tensor `w`)."""
    from tcal.store.cache import save_tensors

    save_tensors(path, {"other": torch.ones(1)}, {}, path.stem)


@pytest.mark.parametrize("damage,why", [(truncate, "is unreadable"), (no_record, "is unreadable"),
                                        (refused, "is unreadable (KeyError: 'w')")])
def test_a_damaged_entry_is_rebuilt_with_a_warning(damage, why, tmp_path, caplog):
    first = {"w": torch.ones(3), "record": {"n": 1}}
    get_or_build("stage1", "k", lambda: first, folder=tmp_path, codec=TENSORS)
    damage(tmp_path / "k.safetensors")
    second = {"w": torch.full((3,), 2.0), "record": {"n": 2}}
    with caplog.at_level(logging.INFO, logger="tcal.store.cache"):
        assert get_or_build("stage1", "k", lambda: second, folder=tmp_path, codec=TENSORS) is second
        read = get_or_build("stage1", "k", lambda: pytest.fail("rebuilt twice"), folder=tmp_path, codec=TENSORS)
    assert torch.equal(read["w"], second["w"]) and read["record"] == {"n": 2}
    warning, built, reused = cache_lines(caplog)
    assert warning.startswith(f"cache stage1: {tmp_path / 'k.safetensors'} {why}") and warning.endswith("; rebuilding it")
    assert (built, reused) == ("cache stage1: built k", "cache stage1: reused k")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_entry_under_another_key_is_rebuilt_not_trusted(tmp_path, caplog):
    get_or_build("calibration", "aaaa", lambda: {"w": torch.ones(2), "record": {}}, folder=tmp_path, codec=TENSORS)
    (tmp_path / "bbbb.safetensors").write_bytes((tmp_path / "aaaa.safetensors").read_bytes())
    with caplog.at_level(logging.WARNING, logger="tcal.store.cache"):
        value = get_or_build("calibration", "bbbb", lambda: {"w": torch.zeros(2), "record": {}}, folder=tmp_path,
                             codec=TENSORS)
    assert torch.equal(value["w"], torch.zeros(2))
    assert cache_lines(caplog) == [
        f"cache calibration: {tmp_path / 'bbbb.safetensors'} is not the entry of its key: it was written under the "
        f"key 'aaaa', not 'bbbb' (copied or renamed); rebuilding it"]


def test_several_entries_are_built_together_and_each_written_as_it_is_done(tmp_path):
    get_or_build("calibration", "layer1", lambda: 10, folder=tmp_path)
    keys = {1: "layer1", 2: "layer2", 3: "layer3"}
    asked = []

    def killed_at_3(items):
        asked.append(list(items))
        for item in items:
            if item == 3:
                raise RuntimeError("killed while building layer 3")
            yield item, item * 10

    with pytest.raises(RuntimeError, match="layer 3"):
        get_or_build_each("calibration", keys, killed_at_3, folder=tmp_path)
    assert asked == [[2, 3]]  # the cached layer is not built again; the others in one call
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["layer1", "layer2"]  # layer 2 was kept
    asked.clear()
    values = get_or_build_each("calibration", keys, lambda items: asked.append(list(items)) or {i: i * 100 for i in items},
                               folder=tmp_path)
    assert asked == [[3]] and values == {1: 10, 2: 20, 3: 300}


def test_an_entry_being_built_by_another_process_is_waited_for_and_reused(tmp_path, caplog):
    """Two builders of one key (threads here: flock locks of separately opened files exclude each other as
    between processes): the second waits for the first, then reads its entry."""
    started, results = threading.Event(), []

    def slow_build():
        started.set()
        time.sleep(1.0)
        return 5

    first = threading.Thread(target=lambda: results.append(get_or_build("retention", "k", slow_build,
                                                                        folder=tmp_path)))
    with caplog.at_level(logging.INFO, logger="tcal.store.cache"):
        first.start()
        assert started.wait(timeout=60)
        results.append(get_or_build("retention", "k", lambda: pytest.fail("built twice"), folder=tmp_path))
        first.join()
    assert results == [5, 5]
    assert cache_lines(caplog) == ["cache retention: built k", "cache retention: reused k"]
    with key_lock(tmp_path / "k.json") as held, key_lock(tmp_path / "k.json", wait=False) as other:
        assert held and not other


def test_an_entry_of_a_batched_build_is_read_by_another_builder_as_soon_as_it_is_written(tmp_path):
    """One builder takes layers 1 and 2 and is still on layer 2; a second that needs layer 1 only reads it at once
    (it does not wait for the whole build)."""
    keys = {1: "layer1", 2: "layer2"}
    one_written, may_finish, results = threading.Event(), threading.Event(), {}

    def layer_by_layer(items):
        for item in items:
            if item == 2:
                one_written.set()
                assert may_finish.wait(timeout=60)
            yield item, item * 10

    first = threading.Thread(target=lambda: results.update(
        get_or_build_each("calibration", keys, layer_by_layer, folder=tmp_path)))
    first.start()
    assert one_written.wait(timeout=60)
    try:
        with key_lock(tmp_path / "layer1.json", wait=False) as free, key_lock(tmp_path / "layer2.json", wait=False) as busy:
            assert free and not busy
        assert get_or_build("calibration", "layer1", lambda: pytest.fail("built twice"), folder=tmp_path) == 10
    finally:
        may_finish.set()
        first.join()
    assert results == {1: 10, 2: 20}


# ----------------------------------------------------------------------------------------------------------
# Two processes, one cold cache


SMOKE_FULL = ("experiment=smoke", "init=full", "calibration.phase2.steps=2", "eval.num_windows=2", "save_student=false",
              "logger=none")


def calibrate_in_a_process(cache: str, run_dir: str, log_file: str, start) -> None:
    """One job of a sweep: the smoke run with `full` calibration, started together with the other job (`start`,
    a barrier, just before the layers are calibrated), each layer slowed so the two overlap. Its `tcal.store.cache`
    lines go to `log_file`, its weights digest to `<run_dir>/digest`."""
    from tcal.init.calibration import calibrate as calibrate_module
    from tcal.pipeline import run

    handler = logging.FileHandler(log_file)
    logging.getLogger("tcal.store.cache").addHandler(handler)
    logging.getLogger("tcal.store.cache").setLevel(logging.INFO)
    shared, one = calibrate_module.calibrate_shared, calibrate_module.calibrate_stack

    def together(*args, **kwargs):
        start.wait(timeout=300)
        return shared(*args, **kwargs)

    def slowly(*args, **kwargs):
        time.sleep(1.0)
        return one(*args, **kwargs)

    calibrate_module.calibrate_shared, calibrate_module.calibrate_stack = together, slowly
    results = run(compose(*SMOKE_FULL, f"paths.cache_dir={cache}"), Path(run_dir))
    (Path(run_dir) / "digest").write_text(results["init_weights_digest"])


def test_two_processes_on_a_cold_cache_build_each_calibrated_layer_once(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    logs, runs = [tmp_path / f"job{i}.log" for i in range(2)], [tmp_path / f"job{i}" for i in range(2)]
    jobs = [context.Process(target=calibrate_in_a_process, args=(cache, str(runs[i]), str(logs[i]), start))
            for i in range(2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=900)
    assert [job.exitcode for job in jobs] == [0, 0]
    digests = [(run_dir / "digest").read_text() for run_dir in runs]
    assert digests[0] == digests[1]
    layers = sorted(p.stem for p in (Path(cache) / "calibration").rglob("*.safetensors"))
    assert len(layers) == 2  # the smoke student's two GDN layers
    lines = "\n".join(line for log in logs for line in log.read_text().splitlines())
    built = sorted(re.findall(r"cache calibration: built (\w+)", lines))
    reused = sorted(re.findall(r"cache calibration: reused (\w+)", lines))
    assert built == layers and reused == layers, lines  # each built by one process, reused by the other
