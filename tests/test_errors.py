"""Bad input fails early with an error that names the bad value, and the run directory stays empty (the table of
every configuration check is in test_validate.py)."""

from __future__ import annotations

import pytest
from conftest import make_teacher, repo_cache_dir
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

from tcal.pipeline import run
from tcal.retention.uniform import uniform_layers
from tcal.settings.retention import num_kept
from tcal.student.convert import build_student, validate_keep_layers
from tcal.teachers import adapter_for

SUPPORTED = r"supported: llama, qwen2, qwen3"


def assert_nothing_written(run_dir):
    assert not (run_dir / "results.json").exists()
    assert not (run_dir / "student").exists()
    assert not run_dir.exists() or not any(run_dir.iterdir()), f"files written: {list(run_dir.rglob('*'))}"


def run_fails(compose_cfg, tmp_path, exc, match, *overrides):
    """`tcal experiment=smoke <overrides>` as the entry runs it (compose, convert, run) fails with `exc` before
    anything is written."""
    run_dir = tmp_path / "run"
    with pytest.raises(exc, match=match) as info:
        run(compose_cfg("experiment=smoke", f"paths.cache_dir={repo_cache_dir()}", *overrides), run_dir)
    assert_nothing_written(run_dir)
    return info.value


# ----------------------------------------------------------------------------------------------------------
# Unknown architecture


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()


def tiny_mistral():
    return MistralForCausalLM(MistralConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_mistral], ids=["gpt2", "mistral"])
def test_unknown_architecture_in_conversion(make):
    model = make()
    name = model.config.model_type
    with pytest.raises(ValueError, match=rf"unsupported teacher architecture '{name}'.*{SUPPORTED}"):
        adapter_for(model.config)
    with pytest.raises(ValueError, match=rf"'{name}'.*{SUPPORTED}"):
        build_student(model, [0])


def test_unknown_architecture_in_pipeline_from_config(compose_cfg, tmp_path):
    run_fails(compose_cfg, tmp_path, ValueError, r"^teacher.config.model_type='mistral'; expected one of llama, qwen2, "
              r"qwen3$", "teacher.config.model_type=mistral")


def test_unknown_architecture_in_pipeline_from_folder(compose_cfg, tmp_path):
    folder = tmp_path / "gpt2"
    tiny_gpt2().save_pretrained(folder)
    run_fails(compose_cfg, tmp_path, ValueError, rf"'gpt2'.*{SUPPORTED}", f"+teacher.path={folder}")


# ----------------------------------------------------------------------------------------------------------
# Keep lists and ratios


@pytest.mark.parametrize("keep, match, run_match", [
    ([0, 4], r"keep_layers \[4\] out of range.*4 layers", r"^retention.keep=\[0, 4\]: \[4\] out of range.*4 layers"),
    ([-1, 2], r"keep_layers \[-1\] out of range", r"retention.keep=\[-1, 2\] holds \[-1\], not layer indices"),
    ([1, 1, 3], r"keep_layers repeats \[1\]", r"^retention.keep=\[1, 1, 3\]: repeats \[1\]"),
    ([], r"keep_layers is empty", r"^retention.keep=\[\]: is empty"),
])
def test_bad_keep_lists(keep, match, run_match, compose_cfg, tmp_path):
    with pytest.raises(ValueError, match=match):
        validate_keep_layers(keep, 4)
    with pytest.raises(ValueError, match=match):
        build_student(make_teacher("llama"), keep)
    keep_arg = "[" + ",".join(map(str, keep)) + "]"
    run_fails(compose_cfg, tmp_path, ValueError, run_match or match, "retention=explicit", f"retention.keep={keep_arg}")


@pytest.mark.parametrize("ratio", ["0", "-0.1", "1.5"])
def test_ratio_outside_unit_interval(ratio, compose_cfg, tmp_path):
    shown = str(float(ratio))
    with pytest.raises(ValueError, match=rf"retention.ratio={shown} must lie in \(0, 1\]"):
        num_kept(float(ratio), 4)
    run_fails(compose_cfg, tmp_path, ValueError, rf"ratio={shown}", f"retention.ratio={ratio}")


def test_ratio_one_and_small_ratios_are_allowed():
    assert uniform_layers(4, 1.0) == [0, 1, 2, 3]
    assert uniform_layers(4, 0.5) == [0, 2]
    assert uniform_layers(28, 0.25) == [0, 4, 8, 12, 16, 20, 24]  # the paper's Qwen2.5-1.5B example
    assert uniform_layers(4, 0.01) == [0]  # at least one layer stays softmax
