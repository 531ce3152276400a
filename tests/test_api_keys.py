"""The Python API and `tcal` derive every cache key from the same complete settings: under the same settings, each
step of `tcal.api` keys its cached products (calibrated layers, retention scores, Stage 1, the teacher's figures)
exactly as `tcal` does, on any trainer and precision, so a notebook and the CLI share one cache."""

from __future__ import annotations

import inspect

import pytest
from conftest import compose, isolated_cache_dir

from tcal import api
from tcal.pipeline import run
from tcal.settings.relevance import KEYED_BY, cache_settings
from tcal.settings.run import GROUPS

# each step of the API and the cached products whose keys it derives (kind, products a policy adds)
STEP_PRODUCTS = {
    api.select_layers: [("retention", ()), ("retention", ("init",))],
    api.initialize: [("calibration", ())],
    api.distill: [("stage1", ())],
    api.evaluate: [("ppl", ()), ("ppl_by_position", ()), ("harness", ()), ("ruler", ())],
}

SETTINGS = [
    (),
    ("trainer=gpu", "trainer.precision=bf16-mixed"),
    ("trainer=gpu", "trainer.precision=bf16-mixed", "init=full_plus", "retention=ga_s2", "stage=align_distill",
     "data.split_seed=3", "data.calibration_docs=3", "eval/ruler=default", "eval/harness=local", "seed=5"),
    ("trainer=fsdp", "trainer.precision=bf16-mixed", "retention=recall", "retention.probe=gdn", "init=phase2",
     "stage=distill", "data.retrieval_mix=0.25", "eval.position_buckets=[0,128,256]", "teacher=tiny_qwen3"),
    ("experiment=qwen3_8b_uniform_r025_align_distill", "init=zero_gate"),
]


def step_groups(step, settings) -> dict:
    """The settings groups (and the seed) `step` takes, as `tcal` passes them."""
    names = inspect.signature(step).parameters
    return {name: getattr(settings, name) for name in names if name in GROUPS and name != "teacher" or name == "seed"}


def test_every_cached_product_is_keyed_alike_by_the_api_and_tcal():
    assert {kind for products in STEP_PRODUCTS.values() for kind, _ in products} == set(KEYED_BY)
    for overrides in SETTINGS:
        settings = compose(*overrides)
        teacher = api.Teacher(model=None, tokenizer=None, settings=settings.teacher)
        for step, products in STEP_PRODUCTS.items():
            stepped = api.step_settings(teacher, **step_groups(step, settings))
            for kind, also in products:
                assert cache_settings(kind, stepped, also) == cache_settings(kind, settings, also), (
                    overrides, step.__name__, kind)


def test_the_api_reads_the_layers_tcal_calibrated(tmp_path):
    """A run of `tcal`, then its steps through the API with its settings: every layer comes from the cache."""
    settings = compose("experiment=smoke", "init=phase2", "data.split_seed=1", "trainer.precision=bf16-mixed",
                       "eval.num_windows=2", "save_student=false",
                       f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}")
    recorded = run(settings, tmp_path / "run")
    assert not any(layer["cached"] for layer in recorded["calibration"]["layers"].values())
    cache = settings.paths.cache_dir
    teacher = api.load_teacher(settings.teacher, cache)
    splits = api.load_data(settings.data)
    selection = api.select_layers(teacher, splits, settings.retention, settings.init, settings.calibration,
                                  settings.seed, cache, data=settings.data, trainer=settings.trainer)
    student = api.build_student(teacher, selection.keep_layers, settings.init.gqa_expansion, settings.seed)
    record = api.initialize(student, teacher, splits, settings.init, settings.calibration, settings.seed, cache,
                            data=settings.data, trainer=settings.trainer)
    assert record["layers"].keys() == recorded["calibration"]["layers"].keys()
    assert all(layer["cached"] for layer in record["layers"].values())
