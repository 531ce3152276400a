"""The paper teachers' shipped architectures and `tcal-plan`: whole models on the meta device against the published
sizes, the activation trace against the tensors autograd really keeps, the strategies' sharding, and configuration
errors as one line with exit code 2."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import pytest
import torch
from conftest import compose, make_teacher

from tcal.errors import ConfigError
from tcal.retention.uniform import uniform_layers
from tcal.runtime.distributed import world_size
from tcal.settings.fields import TRAIN, setting
from tcal.settings.stage import DistillSettings
from tcal.student.convert import build_student, meta_student
from tcal.teachers.load import meta_model, parameter_count, teacher_architecture
from tcal.tools.plan import main, make_plan
from tcal.tools.plan.cost import stage_flops
from tcal.tools.plan.memory import build_model, stage_memory
from tcal.tools.plan.output import format_plan
from tcal.tools.plan.trace import SavedTensors, trace_alignment, trace_decoder

# Parameter counts published with the paper teachers (model cards).
PUBLISHED = {"qwen2_5_1_5b": 1.54e9, "qwen2_5_3b": 3.09e9, "llama3_2_3b": 3.21e9, "qwen3_8b": 8.19e9}
PAPER_EXPERIMENTS = {teacher: f"{teacher}_uniform_r025_align_distill" for teacher in PUBLISHED}


def architecture(*overrides: str):
    cfg = compose(*overrides)
    return teacher_architecture(cfg.teacher, cfg.paths.cache_dir)


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_teacher_built_on_meta_has_its_published_size(teacher):
    model = meta_model(architecture(f"teacher={teacher}"))
    assert all(p.is_meta for p in model.parameters())
    assert parameter_count(model) == pytest.approx(PUBLISHED[teacher], rel=0.01)


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_teacher_has_its_family_features(teacher):
    config = architecture(f"teacher={teacher}")
    attention = meta_model(config).model.layers[0].self_attn
    family = config.model_type
    assert (attention.q_proj.bias is not None) == (family == "qwen2")  # Qwen2.5: q/k/v biases
    assert hasattr(attention, "q_norm") == (family == "qwen3")  # Qwen3: per-head q/k norms
    assert config.num_attention_heads % config.num_key_value_heads == 0 < config.num_key_value_heads
    assert (config.rope_parameters["rope_type"] == "llama3") == (family == "llama")  # Llama-3.2: llama3 scaling
    assert config.tie_word_embeddings == (teacher != "qwen3_8b")


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_student_on_meta_trades_converted_attention_for_gdn(teacher):
    config = architecture(f"teacher={teacher}")
    keep = uniform_layers(config.num_hidden_layers, 0.5)
    converted = config.num_hidden_layers - len(keep)
    teacher_model, student = meta_model(config), meta_student(config, keep)
    heads, head_dim, width = config.num_attention_heads, student.gdn(student.config.gdn_layers[0]).head_dim, \
        config.hidden_size
    attention = parameter_count(teacher_model.model.layers[0].self_attn)
    gdn = 5 * width * heads * head_dim + 2 * width * heads + 2 * heads + head_dim  # q k v g o; a b; A, dt; o_norm
    assert parameter_count(student) == parameter_count(teacher_model) + converted * (gdn - attention)
    assert (student.lm_head.weight is student.model.embed_tokens.weight) == config.tie_word_embeddings


def test_local_folder_config_takes_the_place_of_the_shipped_architecture(tmp_path):
    make_teacher("qwen2").config.save_pretrained(tmp_path)
    config = architecture("teacher=qwen2_5_1_5b", f"teacher.path={tmp_path}")
    assert (config.model_type, config.hidden_size) == ("qwen2", 64)


def test_a_hub_teacher_without_an_architecture_cannot_be_planned():
    cfg = compose("teacher=qwen2_5_1_5b", "teacher.architecture=null")
    with pytest.raises(ConfigError, match="is a hub id and no architecture ships with it"):
        teacher_architecture(cfg.teacher, cfg.paths.cache_dir)


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_experiment_plan_json(teacher, capsys):
    main([f"experiment={PAPER_EXPERIMENTS[teacher]}", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    plan = json.loads(lines[0])
    assert plan["teacher_params"] == pytest.approx(PUBLISHED[teacher], rel=0.01)
    assert plan["student_params"] > plan["teacher_params"]  # GDN mixers project to every query head
    assert plan["retention"]["converted"] == plan["num_layers"] - round(0.25 * plan["num_layers"])
    for kind in ("calibration", "align", "distill"):
        stage = plan["stages"][kind]
        assert plan["per_device_gb"][kind] == stage["peak_gb"] > stage["teacher_gb"] > 0
    assert plan["fits"] == all(s["fits"] for s in plan["stages"].values())
    assert plan["stages"]["distill"]["world_size"] == 8
    assert plan["stages"]["distill"]["tokens_per_step"] == 4 * 4096 * 8  # the paper's global Stage 2 batch
    assert plan["fits"] and plan["device_gb"] == 80 and plan["headroom_gb"] == 8  # as shipped, on 8 x 80 GB


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_experiment_fits_under_fsdp(teacher, capsys):
    main([f"experiment={PAPER_EXPERIMENTS[teacher]}", "trainer=fsdp", "trainer.devices=8", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"], {k: s["peak_gb"] for k, s in plan["stages"].items()}
    assert {plan["stages"][k]["strategy"] for k in ("align", "distill")} == {"fsdp"}
    # bf16-mixed FSDP gathers bfloat16 parameters: autocast has nothing to copy
    assert plan["stages"]["distill"]["gathered_gb"] > 0 and plan["stages"]["distill"]["autocast_gb"] == 0


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    from tcal.settings.compose import hydra_configs, planned_jobs

    with hydra_configs():
        return planned_jobs(overrides)


def test_group_sweeps_expand_as_hydra_reads_them():
    assert expand_sweeps(["init=naive,full", "retention.ratio=0.5", "+stage=choice(align,distill)"]) == [
        [f"init={init}", "retention.ratio=0.5", f"+stage={stage}"] for init in ("naive", "full")
        for stage in ("align", "distill")]
    assert expand_sweeps(["init=[naive,full]", "retention=glob(*,exclude=explicit)"]) == [
        ["init=[naive,full]", f"retention={name}"] for name in ("ar", "ga_s2", "recall", "uniform")]


def test_a_sweep_files_jobs_expand_and_the_command_line_sets_its_keys():
    jobs = expand_sweeps(["+sweep=recall_table"])
    assert len(jobs) == 3 * 3 * 2 and len({tuple(job) for job in jobs}) == 18
    assert {job[-1] for job in jobs} == {"+sweep=recall_table"}
    assert {o for job in jobs for o in job if o.startswith("retention=")} == {
        f"retention={name}" for name in ("uniform", "ar", "recall")}
    fixed = expand_sweeps(["+sweep=recall_table", "init=phase2", "retention.ratio=0.25,0.5"])
    assert len(fixed) == 3 * 2 and all("init=phase2" in job for job in fixed)
    assert {o for job in fixed for o in job if o.startswith("retention.ratio=")} == {
        "retention.ratio=0.25", "retention.ratio=0.5"}


def test_plan_text_names_every_stage_and_the_converted_layers(capsys):
    main([f"experiment={PAPER_EXPERIMENTS['qwen2_5_1_5b']}"])
    out = capsys.readouterr().out
    assert "keep [0, 4, 8, 12, 16, 20, 24]" in out and "21 converted to Gated DeltaNet" in out
    for word in ("calibration", "align", "distill", "fsdp", "peak GB", "fits"):
        assert word in out


TINY_DISTILL = ["teacher=tiny_llama", "stage=distill", "stage.batch_size=2", "stage.seq_len=128", "stage.max_tokens=4096",
                "stage.eval_every_tokens=1024"]


def tiny_plan(*overrides, device_gb: float = 80.0) -> dict:
    return make_plan(compose(*TINY_DISTILL, *overrides), device_gb)


def distill_memory(*overrides):
    """Stage 2's per-device bytes on the tiny teacher (two of four layers kept)."""
    cfg = compose(*TINY_DISTILL, *overrides)
    return stage_memory(cfg.stage, cfg, build_model(cfg, [0, 2]), world_size(cfg.trainer), "cuda")


def test_strategies_shard_what_they_say():
    ddp = distill_memory("trainer=ddp", "trainer.devices=8", "trainer.precision=bf16-mixed")
    fsdp = distill_memory("trainer=fsdp", "trainer.devices=8")
    params, trainable = ddp.weights // 4, ddp.settings["trainable_params"]
    # DDP under autocast: float32 weights, gradients and two moments, the bucket copy, the weights' bf16 copies
    assert (ddp.weights, ddp.gradients, ddp.optimizer, ddp.buffers) == (4 * params, 4 * trainable, 8 * trainable,
                                                                        4 * trainable)
    assert ddp.autocast["none"] > 0 and ddp.gathered == 0
    # FSDP2: the DDP run's float32 state in eight shards, plus the gathered root and two layer units; under
    # bf16-mixed (trainer=fsdp's) they are gathered in bfloat16 with bfloat16 unsharded gradients, one unit's
    # gradients reduce-scattered from a float32 copy, and autocast copies nothing
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (ddp.weights // 8, ddp.gradients // 8,
                                                              ddp.optimizer // 8)
    assert fsdp.buffers == 0 and set(fsdp.autocast) == set(ddp.autocast) and not any(fsdp.autocast.values())
    student = build_model(compose(*TINY_DISTILL), [0, 2]).student
    root = sum(p.numel() for n, p in student.named_parameters() if not n.startswith("model.layers."))
    layer = max(sum(p.numel() for p in l.parameters()) for l in student.get_decoder().layers)
    assert fsdp.gathered == 2 * root + 2 * 4 * layer + 4 * layer
    full = distill_memory("trainer=fsdp", "trainer.devices=8", "trainer.precision=32-true")
    assert full.gathered == 4 * root + 2 * 8 * layer and not any(full.autocast.values())  # no policy in float32
    assert ddp.teacher == fsdp.teacher  # the frozen teacher is whole on every device


@dataclass
class MixersOnlyDistill(DistillSettings):
    """A stage kind tcal-plan has never heard of: Stage 2's KL on the logits, training only the GDN mixers."""

    name: str = setting("mixers_only_distill", affects=[TRAIN])
    kind: str = setting("mixers_only_distill", affects=[TRAIN])

    trains = "mixers"

    def check(self) -> None:
        """Not one of the kinds tcal runs (tcal.settings.stage.KINDS): a plan's, nothing to check."""


def test_a_stage_kind_s_terms_come_from_its_settings():
    """The plan asks a stage's settings what it trains, runs and costs, never its kind: a new kind whose settings
    train only the mixers is planned with the mixers' gradients, optimizer states and FLOPs, the same student run
    and the same KL as Stage 2, and is listed under its own name."""
    cfg = compose(*TINY_DISTILL)
    toy = MixersOnlyDistill(**{f.name: getattr(cfg.stage, f.name) for f in fields(DistillSettings)
                               if f.name not in ("name", "kind")})
    model = build_model(cfg, [0, 2])
    distill, mixers_only = (stage_memory(node, cfg, model, 1, "cuda") for node in (cfg.stage, toy))
    assert mixers_only.settings["trainable_params"] == model.gdn_params < model.student_params \
        == distill.settings["trainable_params"]
    for part in ("gradients", "optimizer"):  # the same bytes per trained parameter, of fewer parameters
        assert getattr(mixers_only, part) * model.student_params == getattr(distill, part) * model.gdn_params > 0
    assert (mixers_only.weights, mixers_only.teacher, mixers_only.kl) == (distill.weights, distill.teacher, distill.kl)
    assert set(mixers_only.activations) == set(distill.activations)  # the student's decoder runs in both
    distill_flops, toy_flops = (stage_flops(node, model, 1)["flops_per_token_parts"] for node in (cfg.stage, toy))
    assert toy_flops["teacher_forward"] == distill_flops["teacher_forward"]
    assert 0 < toy_flops["trained"] < distill_flops["trained"]
    cfg.stage = toy
    plan = make_plan(cfg)
    assert set(plan["stages"]) == {"calibration", "mixers_only_distill"}
    assert set(plan["hours"]["stages"]) == {"mixers_only_distill"}
    assert plan["stages"]["mixers_only_distill"]["trainable_params"] == plan["gdn_params"]
    assert "mixers_only_distill" in format_plan(plan, "toy").splitlines()[7]  # the table's head


def test_optimizer_and_weight_bytes_follow_the_precision():
    fp32, mixed, bf16 = (distill_memory(f"trainer.precision={p}") for p in ("32-true", "bf16-mixed", "bf16-true"))
    trainable = fp32.settings["trainable_params"]
    assert (fp32.optimizer, mixed.optimizer, bf16.optimizer) == (8 * trainable, 8 * trainable, 4 * trainable)
    assert (fp32.gradients, mixed.gradients, bf16.gradients) == (4 * trainable, 4 * trainable, 2 * trainable)
    assert fp32.weights == mixed.weights == 2 * bf16.weights
    assert not any(fp32.autocast.values()) and not any(bf16.autocast.values())


def test_autocast_copies_are_the_linear_weights_the_graph_keeps():
    """bf16-mixed on one device: each trainable Linear parameter's bfloat16 copy (2 bytes) without checkpointing;
    checkpointed mixers keep all but the mixers' (one is recomputed); checkpointed layers one layer's and the head's."""
    memory = distill_memory("trainer.precision=bf16-mixed")
    student = build_model(compose(*TINY_DISTILL), [0, 2]).student.requires_grad_(True)

    def linear(modules):
        return sum(p.numel() for m in modules if isinstance(m, torch.nn.Linear) for p in m.parameters(False))

    every, mixers = linear(student.modules()), [linear(student.gdn(i).modules()) for i in (1, 3)]
    layers = [linear(layer.modules()) for layer in student.get_decoder().layers]
    assert memory.autocast == {"none": 2 * every, "checkpoint_mixers": 2 * (every - sum(mixers) + max(mixers)),
                               "activation_checkpointing": 2 * (max(layers) + linear([student.lm_head]))}
    assert memory.peak == (memory.weights + memory.gradients + memory.optimizer + memory.teacher + memory.buffers
                           + memory.activations["checkpoint_mixers"] + memory.kl + memory.autocast["checkpoint_mixers"])


def test_checkpointing_lowers_the_activations_and_the_configured_one_counts():
    plan = tiny_plan("stage.seq_len=1024", "stage.max_tokens=8192", "stage.eval_every_tokens=2048",
                     "stage.checkpoint_mixers=false")["stages"]["distill"]
    acts = plan["activations_gb_by_checkpointing"]
    assert acts["none"] > acts["checkpoint_mixers"] > acts["activation_checkpointing"] > 0
    assert plan["activations_gb"] == acts["none"] and plan["checkpointing"] == "none"
    layers = tiny_plan("stage.activation_checkpointing=true")["stages"]["distill"]
    assert layers["checkpointing"] == "activation_checkpointing"


def test_fits_keeps_the_headroom_free():
    plan = make_plan(compose(*TINY_DISTILL), 80.0, 0.0)
    peak = max(part["peak_gb"] for part in [*plan["stages"].values(), *plan["moments"].values()])
    device = round(peak + 0.5, 2)
    assert make_plan(compose(*TINY_DISTILL), device, 0.4)["fits"]
    tight = make_plan(compose(*TINY_DISTILL), device, 0.6)
    assert not tight["fits"] and tight["headroom_gb"] == 0.6
    for parts in (tight["stages"], tight["moments"]):
        assert [k for k, s in parts.items() if not s["fits"]] == [k for k, s in parts.items()
                                                                  if s["peak_gb"] + 0.6 > device]
    with pytest.raises(ConfigError, match="--headroom-gb 90: expected 0 <= headroom < the device's 80 GB"):
        make_plan(compose(*TINY_DISTILL), 80.0, 90.0)


def test_host_figure_is_the_largest_host_holding_of_each_rank():
    cfg = compose(*TINY_DISTILL, "trainer=ddp", "trainer.devices=4", "trainer.accelerator=cpu")
    plan = make_plan(cfg)
    host, parts = plan["host"], plan["host"]["parts_gb"]
    assert host["ranks"] == 4
    assert parts["teacher_load"] == round(plan["teacher_params"] * 4 / 2**30, 2)  # tiny_llama is float32
    assert parts["export_rank0"] == round(plan["student_params"] * 4 / 2**30, 2)
    whole_checkpoint = plan["student_params"] * (4 + 8)  # Stage 2 trains every parameter: weights and Adam's states
    assert parts["checkpoint_rank0"] == round(whole_checkpoint / 2**30, 2) and parts["checkpoint_per_rank"] == 0
    per_rank = max(parts["teacher_load"], parts["statistics"], parts["checkpoint_per_rank"]) + parts["data_per_rank"] \
        + parts["process"]
    rank0 = max(parts["teacher_load"], parts["statistics"], parts["export_rank0"], parts["checkpoint_rank0"]) \
        + parts["data_rank0"] + parts["process"]
    assert host["per_node_gb"] == pytest.approx(rank0 + 3 * per_rank, abs=0.03)
    assert host["slurm_mem_gb"] >= host["per_node_gb"] + plan["headroom_gb"] > host["slurm_mem_gb"] - 1


def test_the_host_figure_counts_checkpoint_and_data_staging():
    """A paper run's ranks stage a checkpoint (FSDP: each its shard) and hold each stage's reading plan of the token
    store (rank 0 also the shard it prepares): `--slurm-env` asks for them."""
    plan = make_plan(compose("experiment=qwen3_8b_uniform_r025_align_distill"))
    parts = plan["host"]["parts_gb"]
    shard = round(plan["student_params"] * 12 / 8 / 2**30, 2)
    assert parts["checkpoint_rank0"] == parts["checkpoint_per_rank"] == shard
    windows = 2_000_000_000 // 512
    assert parts["data_per_rank"] == round(windows * 24 / 2**30, 2)
    assert parts["data_rank0"] == round((windows * 24 + 50_000_000 * 8) / 2**30, 2)
    ddp = make_plan(compose("experiment=qwen3_8b_uniform_r025_align_distill", "trainer=ddp", "trainer.devices=8"))
    assert ddp["host"]["parts_gb"]["checkpoint_rank0"] == round(plan["student_params"] * 12 / 2**30, 2)
    assert ddp["host"]["slurm_mem_gb"] > plan["host"]["slurm_mem_gb"]


@pytest.mark.parametrize("policy,kept_known", [("uniform", True), ("ar", False), ("ga_s2", False)])
def test_retention_policy_in_the_plan(policy, kept_known):
    plan = tiny_plan(f"retention={policy}", "retention.ratio=0.5")
    retention = plan["retention"]
    assert retention["kept"] == 2 and retention["converted"] == 2
    assert (retention["keep_layers"] == [0, 2]) if kept_known else (retention["keep_layers"] is None
                                                                      and "scoring" in retention["note"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_meta_trace_equals_what_autograd_keeps_on_the_cpu(family):
    """The meta-device trace with the flash-attention stand-in keeps exactly the bytes the real CPU kernels keep."""
    teacher = make_teacher(family, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    real = build_student(teacher, [0, 2]).train().requires_grad_(True)
    meta = meta_student(teacher.config, [0, 2]).train().requires_grad_(True)
    assert trace_decoder(meta, 2, 128, "cpu") == trace_decoder(real, 2, 128, "cpu")
    gdn = 1
    assert trace_alignment(meta.gdn(gdn), 2, 128, torch.float32, "cpu") == \
        trace_alignment(real.gdn(gdn), 2, 128, torch.float32, "cpu")


def test_saved_tensors_count_what_the_graph_still_holds_once_and_skip_parameters():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors([weight]).recording() as saved:
        y = x @ weight
        loss = (y * y).sum()  # y is saved twice (both operands of the product): counted once
        (x.exp() * 2).sum()  # a dropped branch: what it saved is freed before the block ends
    assert saved.outside_bytes == x.numel() * 4 + y.numel() * 4
    assert loss.requires_grad


@pytest.mark.parametrize("args,message", [
    (["stage=distill", "stage.batch_size=0"], "stage.batch_size=0; expected a positive integer"),
    (["trainer=nonesuch"], "trainer='nonesuch': no such option in config group 'trainer'"),
    (["experiment=no_such_experiment"], "experiment='no_such_experiment': no such option in config group "
                                        "'experiment'; expected one of "),
    (["stage.nonexistent=1"], "stage.nonexistent=1: Key 'nonexistent' not in 'StageSettings'"),
    (["trainer.strategy=deepspeed_stage_3"], "trainer.strategy='deepspeed_stage_3': DeepSpeed is not supported"),
    (["teacher=qwen3_8b", "teacher.architecture.model_type=gpt2"],
     "teacher.architecture.model_type='gpt2'; expected one of llama, qwen2, qwen3"),
])
def test_bad_override_is_one_line_and_exit_code_2(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert len(err) == 1 and err[0].startswith("tcal: configuration error: ") and message in err[0], err


MOMENTS = {"step", "stage_end_gather", "final_evaluation"}


@pytest.fixture(scope="module")
def paper_plans() -> dict:
    """The plan of each paper experiment as shipped (8 x 80 GB, the default headroom), computed once."""
    return {teacher: json.loads(json.dumps(make_plan(compose(f"experiment={run}"))))
            for teacher, run in PAPER_EXPERIMENTS.items()}


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_experiment_fits_at_each_of_the_three_moments(teacher, paper_plans):
    """The training step, the stage-end gather of the full student and the final evaluation are each planned, and
    each fits 80 GB with the default headroom."""
    plan = paper_plans[teacher]
    moments = plan["moments"]
    assert set(moments) == MOMENTS
    for name, moment in moments.items():
        assert moment["fits"] and moment["peak_gb"] + plan["headroom_gb"] <= plan["device_gb"] == 80, name
        assert moment["peak_gb"] == pytest.approx(sum(moment["parts_gb"].values()), abs=0.02)
    assert moments["step"]["peak_gb"] == max(v for v in plan["per_device_gb"].values() if v is not None)
    assert plan["fits"] == all(part["fits"] for part in [*plan["stages"].values(), *moments.values()])


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_the_stage_end_gather_holds_the_full_float32_student_and_the_shards_only(teacher, paper_plans):
    """FSDP over 8 ranks, bf16-mixed: the full float32 student on every rank, its float32 shards (which the gather
    reads) and the teacher; no optimizer state, gradient, gathered unit or activation (all freed before it)."""
    plan = paper_plans[teacher]
    gather = plan["moments"]["stage_end_gather"]
    full = round(plan["student_params"] * 4 / 2**30, 2)
    assert set(gather["parts_gb"]) == {"teacher", "weight_shards", "gathered_student"}
    assert gather["parts_gb"]["gathered_student"] == full
    assert gather["parts_gb"]["weight_shards"] == pytest.approx(full / 8, abs=0.01)
    assert gather["parts_gb"]["teacher"] == plan["stages"]["calibration"]["teacher_gb"]


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_the_final_evaluation_s_logits_are_bounded_by_a_chunk(teacher, paper_plans):
    """The paper's harness (batch 8 x 2048) and RULER are planned with the largest working set counted; the harness's
    whole working set is below one [batch, length, vocab] float32 tensor, two of which lm-eval's own scoring makes
    (the logits and their log-softmax)."""
    plan = paper_plans[teacher]
    final = plan["moments"]["final_evaluation"]
    assert set(final["work_gb"]) == {"perplexity", "harness", "ruler"}
    assert final["parts_gb"][f"{final['largest']}_work"] == max(final["work_gb"].values())
    assert final["parts_gb"]["student"] == round(plan["student_params"] * 4 / 2**30, 2)  # float32 after training
    batch_logits = 8 * 2048 * architecture(f"teacher={teacher}").vocab_size * 4 / 2**30
    assert final["work_gb"]["harness"] < batch_logits


def test_a_moment_that_does_not_fit_makes_the_plan_not_fit():
    cfg = compose(*TINY_DISTILL)
    plan = make_plan(cfg, 80.0, 0.0)
    final = plan["moments"]["final_evaluation"]["peak_gb"]
    stages = max(stage["peak_gb"] for stage in plan["stages"].values())
    if final > stages:  # a device between the two: every stage fits, the final evaluation does not
        tight = make_plan(cfg, round((final + stages) / 2, 4), 0.0)
        assert all(s["fits"] for s in tight["stages"].values()) and not tight["moments"]["final_evaluation"]["fits"]
        assert not tight["fits"]
    assert not make_plan(cfg, round(final - 0.001, 4) if final > 0.001 else final / 2, 0.0)["fits"]


def test_the_gather_moment_follows_the_strategy():
    ddp = make_plan(compose(*TINY_DISTILL, "trainer=ddp", "trainer.devices=4", "trainer.accelerator=cpu"))
    fsdp = make_plan(compose(*TINY_DISTILL, "trainer=fsdp", "trainer.devices=4"))
    student = round(ddp["student_params"] * 4 / 2**30, 2)
    assert set(ddp["moments"]["stage_end_gather"]["parts_gb"]) == {"teacher", "student"}  # nothing gathered
    assert ddp["moments"]["stage_end_gather"]["parts_gb"]["student"] == student
    assert fsdp["moments"]["stage_end_gather"]["parts_gb"]["gathered_student"] == student
    assert set(make_plan(compose("teacher=tiny_llama", "stage=none"))["moments"]) == {"step", "final_evaluation"}


def hours_of(*overrides) -> dict:
    return make_plan(compose(*TINY_DISTILL, *overrides))["hours"]


def test_hours_are_positive_linear_in_tokens_and_shorter_on_h100():
    one = hours_of("stage.max_tokens=4096")
    two = hours_of("stage.max_tokens=8192")
    assert two["stages"]["distill"]["tokens"] == 2 * one["stages"]["distill"]["tokens"]
    assert two["total_flops"] == 2 * one["total_flops"]
    for gpus in ("8 x H100", "8 x A100"):
        assert one["gpus"][gpus]["hours"] >= 0 and one["total_flops"] > 0
    rates = one["gpus"]
    seconds = {g: one["total_flops"] / (8 * r["peak_bf16_tflops"] * 1e12 * r["mfu"]) for g, r in rates.items()}
    assert seconds["8 x H100"] < seconds["8 x A100"]
    assert all(0 < r["mfu"] < 1 and r["peak_bf16_tflops"] > 0 for r in rates.values())


@pytest.mark.parametrize("teacher", PUBLISHED)
def test_paper_experiment_hours_on_h100_and_a100(teacher, paper_plans):
    """Each experiment's predicted hours: positive, fewer on 8 x H100 than on 8 x A100, from both stages' tokens
    (Stage 1's 100M and Stage 2's 600M budgets, whole steps) and per-token FLOPs at least 6 x the trained and 2 x
    the teacher's parameters."""
    plan = paper_plans[teacher]
    hours = plan["hours"]
    assert 0 < hours["gpus"]["8 x H100"]["hours"] < hours["gpus"]["8 x A100"]["hours"]
    assert set(hours["stages"]) == {"align", "distill"}
    assert 0.99e8 < hours["stages"]["align"]["tokens"] <= 1e8 and 5.99e8 < hours["stages"]["distill"]["tokens"] <= 6e8
    distill = hours["stages"]["distill"]
    assert distill["flops_per_token"] > 6 * 0.9 * plan["student_params"] + 2 * 0.9 * plan["teacher_params"]
    assert hours["total_flops"] == sum(stage["flops"] for stage in hours["stages"].values())
    assert "MFU" in hours["formula"] and "6 N_trained" in hours["formula"]


def test_plan_text_prints_the_moments_and_the_hours(capsys):
    main(TINY_DISTILL)
    out = capsys.readouterr().out
    assert "moments  training step (distill)" in out and "stage-end gather" in out and "final evaluation" in out
    assert "8 x H100 (989 TFLOPs bf16 peak, MFU 0.35)" in out and "8 x A100 (312 TFLOPs bf16 peak, MFU 0.45)" in out
    assert "note (hours): per training token: 6 N_trained" in out


@pytest.mark.parametrize("flag,value", [("--device-gb", "nan"), ("--device-gb", "inf"), ("--headroom-gb", "-1"),
                                        ("--device-gb", "eighty")])
def test_memory_flags_take_finite_gigabytes(flag, value, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([flag, value])
    assert stopped.value.code == 2 and f"argument {flag}: '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [
    (["--device-gb", "0"], "argument --device-gb: '0': expected a finite number of GB > 0"),
    (["--device-gb", "4", "--headroom-gb", "8"], "--headroom-gb 8: expected 0 <= headroom < the device's 4 GB"),
])
def test_memory_flags_that_plan_nothing_are_refused_before_any_plan(flags, named, capsys, monkeypatch):
    """A device of 0 GB, or a headroom the device cannot keep free: one line, exit code 2, before any settings are
    composed (once: each plan of a sweep was composed first)."""
    from tcal.settings import compose

    def composed(*args, **kwargs):
        raise AssertionError("settings were composed")

    monkeypatch.setattr(compose, "compose_here", composed)
    with pytest.raises(SystemExit) as stopped:
        main(["teacher=tiny_llama", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and named in err[-1], err


def ruler_work(*overrides) -> float:
    """GB of the final evaluation's RULER working set for Qwen2.5-1.5B's paper experiment (FSDP over 8 ranks) at
    32k tokens, where one example's KV cache and states are about 0.2 GB."""
    cfg = compose(f"experiment={PAPER_EXPERIMENTS['qwen2_5_1_5b']}", "eval/ruler=default", "eval.ruler.lengths=[32768]",
                  *overrides)
    return make_plan(cfg)["moments"]["final_evaluation"]["work_gb"]["ruler"]


def test_ruler_is_planned_with_the_examples_a_rank_decodes_together():
    """A cell holds `eval.ruler.n` examples, shared round robin over the ranks: a rank decodes at most its share at
    once, however large `eval.ruler.batch_size` is."""
    one = ("trainer.devices=1",)
    assert ruler_work(*one, "eval.ruler.n=2", "eval.ruler.batch_size=64") == ruler_work(*one, "eval.ruler.n=2",
                                                                                        "eval.ruler.batch_size=2")
    assert ruler_work(*one, "eval.ruler.n=64", "eval.ruler.batch_size=64") > ruler_work(*one, "eval.ruler.n=2",
                                                                                       "eval.ruler.batch_size=64")
    # 20 examples over the experiment's 8 ranks: the first rank holds 3
    assert ruler_work("eval.ruler.n=20", "eval.ruler.batch_size=64") == ruler_work("eval.ruler.n=20",
                                                                                   "eval.ruler.batch_size=3")
    assert ruler_work("eval.ruler.n=20", "eval.ruler.batch_size=64") > ruler_work("eval.ruler.n=20",
                                                                                  "eval.ruler.batch_size=2")


def test_more_tokenizing_workers_than_a_rank_s_cpus_is_said_in_the_plan(capsys):
    """The plan is for another machine, so its CPUs are the SLURM job's: more workers than those is a note."""
    from tcal.tools.plan.staging import HOST_CPUS_PER_RANK

    assert not [n for n in tiny_plan(f"data.workers={HOST_CPUS_PER_RANK}")["notes"] if "data.workers" in n]
    main(["teacher=tiny_llama", "data.workers=100000"])
    assert (f"note: data.workers=100000: more tokenizing processes than the {HOST_CPUS_PER_RANK} CPUs this plan's "
            f"SLURM job asks a rank") in capsys.readouterr().out
