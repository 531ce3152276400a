"""Determinism: the same seed and config on the CPU give a bit-identical init for every init
mode and an identical Stage 2 curve; a different seed gives a different init (so the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, isolated_cache_dir
from safetensors.torch import load_file

from tcal.init import init_student
from tcal.pipeline import Run, run
from tcal.store.fingerprint import weights_digest
from tcal.student.convert import build_student

MODES = ("naive", "zero_gate", "small_gate", "phase1", "phase2", "full")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """The smoke run's context with the calibration cache off: every init is computed, none read back."""
    root = tmp_path_factory.mktemp("determinism")
    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(root / 'cache')}", "calibration.cache=false")
    return Run.build(cfg, run_dir=root / "run")


def initialized(ctx, mode: str, seed: int) -> dict[str, torch.Tensor]:
    """The student's state dict after conversion and `mode`, as the pipeline builds it (seeded the same way)."""
    torch.manual_seed(seed)
    student = build_student(ctx.teacher, [0, 2], seed=seed)
    init_student(student, compose(f"init={mode}").init, ctx)
    return student.state_dict()


def bit_identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_gives_a_bit_identical_init(ctx, mode):
    first, second = initialized(ctx, mode, seed=0), initialized(ctx, mode, seed=0)
    assert bit_identical(first, second)
    if mode != "zero_gate":  # zero_gate also zeroes the seeded output gate; the other seeded weights still differ
        assert not bit_identical(first, initialized(ctx, mode, seed=1))


def test_same_seed_gives_an_identical_stage2_curve(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")  # shares the token stream only: calibration is recomputed

    def distill(name: str) -> dict:
        cfg = compose("experiment=smoke", f"paths.cache_dir={cache}", "calibration.cache=false", "init=phase1", "eval.num_windows=2", "stage=distill", "stage.batch_size=2", "stage.seq_len=32",
                      "stage.max_tokens=256", "stage.eval_every_tokens=128", "logger=none")
        return run(cfg, tmp_path / name / "run")

    first, second = distill("a"), distill("b")
    assert first["stages"]["distill"]["cached"] is False and first["calibration"]["layers"]["1"]["cached"] is False
    assert [p["tokens"] for p in first["curve"]["shakespeare"]] == [0, 128, 256]
    assert first["init_weights_digest"] == second["init_weights_digest"]
    assert first["curve"] == second["curve"]  # exact floats, not approximately
    assert first["stages"]["distill"]["loss_last"] == second["stages"]["distill"]["loss_last"]
    a, b = (load_file(tmp_path / name / "run" / "student" / "model.safetensors") for name in ("a", "b"))
    assert bit_identical(a, b)


def test_weights_digest_changes_with_one_ulp_of_one_weight():
    """`init_weights_digest` in results.json compares runs across processes, so it must see the smallest change."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    before = weights_digest(module)
    assert weights_digest(module) == before
    with torch.no_grad():
        module.weight[1, 2] = torch.nextafter(module.weight[1, 2], torch.tensor(float("inf")))
    assert weights_digest(module) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_streamed_weights_digest_hashes_the_whole_float32_byte_stream(monkeypatch, dtype):
    """The digest is hashed piece by piece, but over the same bytes as one sha256 of every tensor's float32 values
    in state-dict order (the definition earlier results.json files used): pieces smaller than a tensor, a
    non-contiguous (transposed) tensor and a tensor shorter than a piece give that digest."""
    import hashlib

    import tcal.store.fingerprint as fingerprint

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.randn(7, 5).to(dtype))
    module.register_buffer("b", torch.randn(5, 9).to(dtype).t())  # non-contiguous
    module.c = torch.nn.Parameter(torch.randn(3).to(dtype))
    whole = hashlib.sha256(b"".join(t.detach().float().contiguous().numpy().tobytes()
                                    for t in module.state_dict().values())).hexdigest()[:20]
    for piece in (4, 11, 1000):
        monkeypatch.setattr(fingerprint, "DIGEST_CHUNK_ELEMENTS", piece)
        assert fingerprint.weights_digest(module) == whole, f"pieces of {piece} elements"
