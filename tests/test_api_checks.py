"""The library is the CLI's equal: each step of `tcal.api` refuses a wrong argument by the settings' own checks (one
line naming the key, never an internal AttributeError) and makes `tcal`'s checks of the settings it reads, also
against the loaded teacher's context (eval.seq_len, RULER lengths, stage and calibration lengths)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import repo_cache_dir

from tcal import api
from tcal.errors import ConfigError
from tcal.settings import (
    DataSettings,
    DistillSettings,
    EvalSettings,
    NeedleRulerSettings,
    RetentionSettings,
    TrainerSettings,
    init_settings,
    tiny_teacher,
)


@pytest.fixture(scope="module")
def loaded():
    """A tiny random teacher of 4,096 tokens of context, its data and a student keeping layers 0 and 2."""
    teacher = api.load_teacher(tiny_teacher(), repo_cache_dir())
    assert teacher.model.config.max_position_embeddings == 4096
    splits = api.load_data(DataSettings())
    return teacher, splits, api.build_student(teacher, [0, 2])


@pytest.mark.parametrize("call,match", [
    (lambda t, s, m: api.load_teacher("tiny_llama"), r"^teacher='tiny_llama'; expected TeacherSettings$"),
    (lambda t, s, m: api.load_data("shakespeare"), r"^data='shakespeare'; expected DataSettings$"),
    (lambda t, s, m: api.select_layers(t, s, 0.5), r"^retention=0.5; expected PolicySettings$"),
    (lambda t, s, m: api.select_layers(t.model, s, RetentionSettings()), r"^teacher: a LlamaForCausalLM; expected a "
                                                                         r"Teacher \(api.load_teacher\)$"),
    (lambda t, s, m: api.build_student(t, 2), r"^keep_layers=2; expected a list of layer indices$"),
    (lambda t, s, m: api.initialize(m, t, s, "full"), r"^init='full'; expected InitSettings$"),
    (lambda t, s, m: api.initialize(m, t, s, init_settings("naive"), seed="0"), r"^seed='0'; expected an integer"),
    (lambda t, s, m: api.initialize(m, t, s, init_settings("naive"), seed=True), r"^seed=True; expected an integer"),
    (lambda t, s, m: api.distill(m, t, s, tokens="100"), r"^DistillSettings.max_tokens='100'; expected a positive "
                                                         r"integer$"),
    (lambda t, s, m: api.distill(m, s, t), r"^teacher: a Splits; expected a Teacher"),
    (lambda t, s, m: api.evaluate(m, t, s, eval={"seq_len": 64}), r"^eval=\{'seq_len': 64\}; expected EvalSettings$"),
    (lambda t, s, m: api.distill(m, t, s, stage=init_settings("naive")),
     r"^stage=InitSettings\(.*\); expected StageSettings or StageSequenceSettings$"),
], ids=lambda value: None)
def test_a_wrong_argument_is_refused_by_the_settings_naming_the_key(call, match, loaded):
    """The API's arguments are the run's settings, checked by their own classes: a wrong one is one line naming it."""
    with pytest.raises(ConfigError, match=match) as info:
        call(*loaded)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("call,match", [
    (lambda t, s, m: api.load_teacher(tiny_teacher(), cache_dir=3), r"expected str, bytes or os.PathLike object, not "
                                                                    r"int"),
    (lambda t, s, m: api.save(m, t.tokenizer, None), r"expected str, bytes or os.PathLike object, not NoneType"),
    (lambda t, s, m: api.evaluate(m, t, s, EvalSettings(), wrong=1), r"evaluate\(\) got an unexpected keyword "
                                                                     r"argument 'wrong'"),
], ids=["cache_dir", "folder", "unknown_argument"])
def test_a_path_or_an_argument_of_no_settings_is_a_type_error(call, match, loaded):
    with pytest.raises(TypeError, match=match):
        call(*loaded)


@pytest.mark.parametrize("call,match", [
    (lambda t, s, m: api.evaluate(m, t, s, EvalSettings(seq_len=8192)),
     r"eval.seq_len=8192 is beyond the teacher's context of 4096 tokens"),
    (lambda t, s, m: api.evaluate(m, t, s, EvalSettings(seq_len=64, ruler=NeedleRulerSettings(lengths=[512, 8192]))),
     r"eval.ruler.lengths=8192 is beyond the teacher's context of 4096 tokens"),
    (lambda t, s, m: api.distill(m, t, s, DistillSettings(seq_len=8192, batch_size=1, max_tokens=8192,
                                                          eval_every_tokens=8192)),
     r"stage.seq_len=8192 is beyond the teacher's context"),
    (lambda t, s, m: api.distill(m, t, s, DistillSettings(batch_size=2, seq_len=32), tokens=64,
                                 eval=EvalSettings(seq_len=5000)),
     r"eval.seq_len=5000 is beyond the teacher's context"),
    (lambda t, s, m: api.initialize(m, t, s, init_settings("phase2"), dataclasses.replace(
        __import__("tcal.settings", fromlist=["CalibrationSettings"]).CalibrationSettings(), seq_len=6000)),
     r"calibration.seq_len=6000 is beyond the teacher's context"),
    (lambda t, s, m: api.select_layers(t, s, RetentionSettings(ratio=1.5)), r"RetentionSettings.ratio=1.5"),
    (lambda t, s, m: api.distill(m, t, s, DistillSettings(batch_size=2, seq_len=32), tokens=64,
                                 trainer=TrainerSettings(devices=0)), r"TrainerSettings.devices=0"),
    (lambda t, s, m: api.initialize(m, t, s, init_settings("naive"), seed=2 ** 64), r"seed=18446744073709551616"),
    # what the splits cannot hold: the CLI's message naming the key, not a bare ValueError mid-step
    (lambda t, s, m: api.initialize(m, t, s, init_settings("phase2"), __import__(
        "tcal.settings", fromlist=["CalibrationSettings"]).CalibrationSettings(batch_size=4000)),
     r"^calibration.batch_size=4000 windows of calibration.seq_len=256 .* need \d+ tokens, but the calibration "
     r"split has \d+"),
    (lambda t, s, m: api.select_layers(t, s, __import__("tcal.settings", fromlist=["ScoredRetentionSettings"])
                                       .ScoredRetentionSettings(num_windows=4000)),
     r"^retention.num_windows=4000 windows of retention.seq_len=256 need \d+ tokens"),
    (lambda t, s, m: api.evaluate(m, t, s, EvalSettings(num_windows=4000)),
     r"^eval.num_windows=4000 windows of eval.seq_len=512 need \d+ tokens, but the evaluation split has"),
], ids=["eval_seq_len", "ruler_lengths", "stage_seq_len", "distill_eval_seq_len", "calibration_seq_len",
        "retention_ratio", "devices_0", "seed_beyond_64_bits", "calibration_tokens", "retention_tokens",
        "eval_tokens"])
def test_the_library_makes_the_cli_s_checks_against_the_loaded_teacher(call, match, loaded):
    with pytest.raises(ConfigError, match=match):
        call(*loaded)
