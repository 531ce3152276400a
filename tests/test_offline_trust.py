"""Offline and trust: offline, a run from local files never opens a network connection;
`trust_remote_code` reaches transformers as false unless the teacher config turns it on; no pickle loads
(`torch.load` only with weights_only=True)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest
from conftest import REPO, compose, isolated_cache_dir, make_teacher, repo_cache_dir

from tcal.pipeline import run
from tcal.teachers import load as load_module


class NetworkUsed(RuntimeError):
    pass


@pytest.fixture
def no_network(monkeypatch):
    """HF_HUB_OFFLINE=1, and any socket connection fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise NetworkUsed(f"network connection to {address}")
        return real_connect(self, address, *args)

    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    """The tiny Llama teacher saved as a local model folder (what `teacher.path=/local/folder` loads)."""
    folder = tmp_path_factory.mktemp("teacher") / "tiny_llama"
    make_teacher("llama", vocab_size=49152, max_position_embeddings=4096).save_pretrained(folder)
    return folder


def test_the_guard_catches_a_connection(no_network):
    with pytest.raises(NetworkUsed):
        socket.create_connection(("192.0.2.1", 443), timeout=1)


def test_offline_run_from_a_local_teacher_folder_never_uses_the_network(no_network, teacher_folder, tmp_path):
    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "init=naive",
                  f"teacher.path={teacher_folder}", "eval.num_windows=2", "save_student=false", "logger=none")
    results = run(cfg, tmp_path / "run")
    assert results["status"] == "complete" and results["num_layers"] == 4


class Spy:
    """Stands in for a transformers Auto class: records the keyword arguments of each from_pretrained."""

    def __init__(self, real, calls: list):
        self.real, self.calls = real, calls

    def from_pretrained(self, *args, **kwargs):
        self.calls.append((self.real.__name__, kwargs.get("trust_remote_code")))
        return self.real.from_pretrained(*args, **kwargs)


@pytest.mark.parametrize("setting,expected", [([], False), (["teacher.trust_remote_code=true"], True)])
def test_trust_remote_code_is_off_unless_the_teacher_config_turns_it_on(setting, expected, teacher_folder,
                                                                          monkeypatch):
    calls: list = []
    for name in ("AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(load_module, name, Spy(getattr(load_module, name), calls))
    cfg = compose("experiment=smoke", f"teacher.path={teacher_folder}", *setting)
    load_module.load_teacher(cfg.teacher, repo_cache_dir())
    assert calls == [("AutoConfig", expected), ("AutoModelForCausalLM", expected)]


def test_no_pickle_loads_anywhere():
    """Every torch.load in the code and tests passes weights_only=True (cache entries are safetensors + JSON)."""
    root = REPO
    unsafe = []
    for path in [*root.joinpath("src").rglob("*.py"), *root.joinpath("tests").rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btorch\.load\(", line) and "weights_only=True" not in line:
                unsafe.append(f"{path.relative_to(root)}:{number}")
    assert not unsafe, unsafe
