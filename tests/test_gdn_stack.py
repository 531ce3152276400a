"""The GPU stack check (`tcal.student.stack`, docs/gpu.md "The stack check") on this CPU, with faked stacks: every
stack a row of the table names is refused in one line naming the fix, before any work; `gdn_kernel=torch` is accepted
on all of them; a stack no row names runs fla."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import repo_cache_dir
from test_errors import assert_nothing_written

from tcal import api
from tcal.errors import ConfigError
from tcal.pipeline import run
from tcal.run import Run
from tcal.settings import DataSettings, RunSettings, TrainerSettings, init_settings, tiny_teacher
from tcal.student import gdn
from tcal.student.stack import FLA_RULES, Stack, gdn_kernel_for, read_stack, version_tuple

H200 = dict(capability=(9, 0), device_name="NVIDIA H200")
A100 = dict(capability=(8, 0), device_name="NVIDIA A100-SXM4-80GB")

# (stack, the fix its refusal names, whether fla itself refuses it: `hard`)
REFUSED = [
    (Stack("2.11.0+cu130", "3.6.0", "0.6.0", **H200), "torch >= 2.12.1 (it ships Triton 3.7.1), Triton >= 3.7.1, or "
                                                       "TileLang installed", True),
    (Stack("2.8.0+cu128", "3.4.0", "0.6.0", **H200), "Triton >= 3.7.1", True),
    (Stack("2.12.0+cu130", "3.7.0", "0.6.0", **H200), "Triton >= 3.7.1", True),
    (Stack("2.12.1+cu130", None, None, **A100), "fla-core==0.6.0 installed", True),
    (Stack("2.13.0+cu130", "3.7.1", "0.7.2", **H200), "fla-core==0.6.0, trainer.gdn_kernel=fla to run this fla "
                                                      "unchecked", False),
    (Stack("2.6.0+cu124", "3.2.0", "0.6.0", **A100), "torch >= 2.7.0 with the Triton it ships", False),
    # stacks the table's rows do not spell out, decided as fla decides them:
    (Stack("2.12.0+cu130", "3.7.1rc1", "0.6.0", **H200), "Triton >= 3.7.1", True),  # a pre-release is below 3.7.1
    (Stack("2.9.0+cu128", "3.5.0+git1234abcd", "0.6.0", capability=(9, 0), device_name="NVIDIA GH200 480GB"),
     "Triton >= 3.7.1", True),  # a pytorch-triton build on a Hopper whose name lacks "NVIDIA H"
    (Stack("2.12.1+cu130", None, "0.6.0", **A100), "the Triton your torch ships", True),
    (Stack("2.12.1+cu130", "3.7.1-custom", "0.6.0", **A100), "a Triton whose __version__ is a PEP 440 version", True),
    (Stack("2.11.0+cu130", "3.6.0", "0.6.0", flash_qla=True, **H200),
     "trainer.gdn_kernel=fla where every GDN layer is 16-bit with head_dim 128", False),
    (Stack("2.7.0a0+nv25.03", "3.3.0", "0.6.0", **A100), "torch >= 2.7.0 with the Triton it ships", False),
]
ACCEPTED = [
    Stack("2.12.1+cu130", "3.7.1", "0.6.0", **H200),
    Stack("2.13.0+cu130", "3.9.0", "0.6.0", **H200),
    Stack("2.11.0+cu130", "3.6.0", "0.6.0", tilelang=True, **H200),  # fla routes the backward to TileLang
    Stack("2.11.0+cu130", "3.6.0", "0.6.0", **A100),  # the Triton bug is Hopper's
    Stack("2.10.0+cu128", "3.6.0", "0.6.0", capability=(10, 0), device_name="NVIDIA B200"),
    Stack("2.8.0+cu128", "3.4.0rc1", "0.6.0", **H200),  # below 3.4.0 as fla compares: its guard does not fire
    Stack("2.12.1+cu130", "3.7.1+gitabc12345", "0.6.0", **H200),  # a local build of 3.7.1 is not below it
    Stack("2.11.0+rocm6.4", "3.6.0", "0.6.0", capability=(9, 4), device_name="AMD Instinct MI300X", platform="hip"),
]

# a refusal names the row that matched as its cause, not a neighbour's
CAUSES = [
    (Stack("2.12.1+cu130", None, "0.6.0", **A100), "Triton is not importable", "fla is not installed"),
    (Stack("2.12.1+cu130", "3.7.1", None, **A100), "fla is not installed", "Triton is not importable"),
    (Stack("2.12.1+cu130", "3.7.1-custom", "0.6.0", **A100), "fla cannot read this Triton's version",
     "below fla-core 0.6.0's CUDA requirements"),
    (Stack("2.12.0+cu130", "3.7.1rc1", "0.6.0", **H200), "a pre-release of 3.7.1 is below it", "FlashQLA"),
]


@pytest.mark.parametrize("stack,fix,hard", REFUSED, ids=[s.describe() for s, _, _ in REFUSED])
def test_a_stack_the_table_names_is_refused_in_one_line_naming_the_fix(stack, fix, hard, caplog):
    with pytest.raises(ConfigError) as info:
        gdn_kernel_for("auto", True, stack)
    message = str(info.value)
    assert "\n" not in message and message.startswith("trainer.gdn_kernel=auto: ") and stack.describe() in message
    assert fix in message and message.endswith("or trainer.gdn_kernel=torch (tcal's torch chunk path on CUDA: "
                                                "correct, slower)")
    if hard:  # fla would refuse it at the first backward: asking for fla is refused now too
        with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel=fla: "):
            gdn_kernel_for("fla", True, stack)
    else:  # outside what the table checked: fla runs where asked, saying so
        assert gdn_kernel_for("fla", True, stack) == "fla" and "running fla as asked" in caplog.text
    assert gdn_kernel_for("torch", True, stack) == "torch"


@pytest.mark.parametrize("stack", ACCEPTED, ids=[s.describe() for s in ACCEPTED])
def test_a_stack_no_row_names_runs_fla(stack):
    assert gdn_kernel_for("auto", True, stack) == gdn_kernel_for("fla", True, stack) == "fla"
    assert gdn_kernel_for("torch", True, stack) == "torch"


@pytest.mark.parametrize("stack,cause,other", CAUSES, ids=[s.describe() for s, _, _ in CAUSES])
def test_a_refusal_names_its_own_cause(stack, cause, other):
    with pytest.raises(ConfigError) as info:
        gdn_kernel_for("auto", True, stack)
    assert cause in str(info.value) and other not in str(info.value)


def test_every_row_of_the_table_is_exercised():
    for rule in FLA_RULES:
        assert any(rule.applies(stack) for stack, _, _ in REFUSED), rule.problem
        assert not any(rule.applies(stack) for stack in ACCEPTED), rule.problem


def test_off_cuda_the_torch_path_runs_and_fla_is_refused():
    assert gdn_kernel_for("auto", False) == gdn_kernel_for("torch", False) == "torch"
    with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel='fla' needs a CUDA device .*; expected "
                                          r"trainer.gdn_kernel=auto or torch here$"):
        gdn_kernel_for("fla", False)
    with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel='triton'; expected one of auto, fla, torch$"):
        gdn_kernel_for("triton", False)


def test_versions_are_read_with_local_and_dev_parts():
    assert version_tuple("2.11.0+cu130") == (2, 11, 0) and version_tuple("3.7.1") == (3, 7, 1)
    assert version_tuple("3.4.0rc1") == (3, 4, 0) and version_tuple("3.7.0.dev20260101") == (3, 7, 0)
    assert version_tuple(None) == ()
    here = read_stack()
    assert here.torch == torch.__version__ and (here.capability is None) == (not torch.cuda.is_available())


@pytest.fixture
def fake_cuda_stack(monkeypatch):
    """A GPU as `tcal`'s checks see it (one device with bfloat16) on a refused stack: an H200 with Triton 3.6.0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr("tcal.student.stack.read_stack", lambda *a: REFUSED[0][0])


@pytest.fixture
def no_teacher_load(monkeypatch):
    def refused_load(*args, **kwargs):
        raise AssertionError("the teacher was loaded: work started before the stack was checked")

    monkeypatch.setattr("tcal.run.load_teacher", refused_load)


def test_a_run_on_a_refused_stack_stops_before_any_work(compose_cfg, tmp_path, fake_cuda_stack, no_teacher_load):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel=auto: NVIDIA H200 .*Triton 3.6.0.*; expected torch "
                                          r">= 2.12.1 .*or trainer.gdn_kernel=torch"):
        run(compose_cfg("experiment=smoke", "trainer=gpu", f"paths.cache_dir={tmp_path / 'cache'}"), run_dir)
    assert_nothing_written(run_dir)
    assert not (tmp_path / "cache").exists()  # nothing made, not even the cache folder


def test_gdn_kernel_torch_is_accepted_on_a_refused_stack_and_named_as_the_path(compose_cfg, fake_cuda_stack):
    from tcal.preflight import check_machine

    kernel = check_machine(compose_cfg("experiment=smoke", "trainer=gpu", "trainer.gdn_kernel=torch"))
    assert kernel == "torch" and gdn.kernel_path("cuda", kernel) == gdn.kernel_path("cpu", kernel) == "torch-chunk"


def test_a_layer_outside_any_run_decides_auto_at_its_first_cuda_call(fake_cuda_stack, monkeypatch):
    """No run chose its kernel: its first multi-token call on CUDA decides `auto`, with the same refusal."""
    layer = gdn.GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))
    with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel=auto: NVIDIA H200"):
        layer(torch.randn(1, 3, 32))
    assert layer.kernel is None


def gdn_kernels(student) -> set:
    return {module.kernel for module in student.modules() if isinstance(module, gdn.GatedDeltaNet)}


@pytest.fixture(scope="module")
def tiny_api():
    """A tiny teacher and its documents, loaded through the Python API."""
    return api.load_teacher(tiny_teacher(), repo_cache_dir()), api.load_data(DataSettings())


def test_the_api_runs_the_kernel_its_trainer_names_on_a_refused_stack(tiny_api, fake_cuda_stack):
    teacher, splits = tiny_api
    student = api.build_student(teacher, [0, 2])  # `trainer=cpu`: the torch path, no stack to check
    on_gpu = {"accelerator": "gpu", "precision": "32-true"}
    with pytest.raises(ConfigError, match=r"^trainer.gdn_kernel=auto: NVIDIA H200 .*Triton 3.6.0"):
        api.initialize(student, teacher, splits, init_settings("naive"), trainer=TrainerSettings(**on_gpu))
    api.initialize(student, teacher, splits, init_settings("naive"),
                   trainer=TrainerSettings(**on_gpu, gdn_kernel="torch"))
    assert {gdn.kernel_path("cuda", kernel) for kernel in gdn_kernels(student)} == {"torch-chunk"}


def test_two_runs_in_one_process_keep_their_own_kernels(tiny_api, fake_cuda_stack, monkeypatch):
    monkeypatch.setattr("tcal.student.stack.read_stack", lambda *a: ACCEPTED[0])  # a stack fla runs on
    teacher, splits = tiny_api
    runs = {choice: Run.build(RunSettings(teacher=teacher.settings, trainer=TrainerSettings(
        accelerator="gpu", precision="32-true", gdn_kernel=choice)), ("build",), teacher, splits)
        for choice in ("torch", "auto")}
    students = {choice: this_run.build_student([0]) for choice, this_run in runs.items()}
    assert {choice: this_run.gdn_kernel for choice, this_run in runs.items()} == {"torch": "torch", "auto": "fla"}
    assert {choice: gdn_kernels(student) for choice, student in students.items()} == {"torch": {"torch"},
                                                                                      "auto": {"fla"}}
    assert gdn.kernel_path("cuda", runs["torch"].gdn_kernel) == "torch-chunk"
    assert gdn.kernel_path("cuda", runs["auto"].gdn_kernel) == "fla-triton-chunk"


@pytest.fixture
def fresh_stack():
    read_stack.cache_clear()
    yield
    read_stack.cache_clear()


def test_triton_is_the_module_fla_imports_whatever_installed_it(monkeypatch, fresh_stack):
    """A pytorch-triton or triton-nightly build: no distribution named `triton`, the module's own version."""
    fake = types.ModuleType("triton")
    fake.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    fake.__version__ = "3.5.0+git1234abcd"
    monkeypatch.setitem(sys.modules, "triton", fake)
    real_version = importlib.metadata.version

    def no_triton_distribution(name):
        if name == "triton":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", no_triton_distribution)
    assert read_stack().triton == "3.5.0+git1234abcd"


def test_rocm_is_read_as_fla_reads_it(monkeypatch, fresh_stack):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert read_stack().platform == "hip"


def test_tilelang_counts_as_fla_counts_it(monkeypatch, tmp_path):
    """fla's own test: the package, enabled, dispatch on, and an nvcc in CUDA_HOME (CUDA_PATH only without it)."""
    from tcal.student import stack as stack_module

    for folder in ("good", "bad"):
        (tmp_path / folder / "bin").mkdir(parents=True)
    (tmp_path / "good" / "bin" / "nvcc").touch()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(name, None)
                        if name == "tilelang" else real_find_spec(name, *a))
    monkeypatch.setattr(stack_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(stack_module.importlib.metadata, "files", lambda name: [])
    monkeypatch.setattr(stack_module, "Path", lambda p: tmp_path / "bad" if str(p) == "/usr/local/cuda" else Path(p))
    for name in ("FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "good"))
    assert stack_module._tilelang_usable()
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    assert not stack_module._tilelang_usable()  # fla's dispatch is off: the Triton backward runs, and raises
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH")
    monkeypatch.setenv("FLA_TILELANG", "0")
    assert not stack_module._tilelang_usable()
    monkeypatch.delenv("FLA_TILELANG")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "bad"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "good"))
    assert not stack_module._tilelang_usable()  # fla reads CUDA_PATH only where CUDA_HOME is unset
