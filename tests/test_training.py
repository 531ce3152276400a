"""Training stages (docs/method.md, sections "Stage 1: alignment" and "Stage 2: distillation"): the chunked KL
against a direct computation, the data module's batches and splits, Stage 1 / Stage 2 lowering their loss, curves,
the Stage 1 cache, kill-and-resume, DDP, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, compose, isolated_cache_dir, make_teacher
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

import tcal.data.documents
from tcal.cli.app import recorded_run
from tcal.data.documents import Document, forget_token_streams, load_splits, token_stream, tokenize_documents
from tcal.errors import ConfigError
from tcal.pipeline import Run, run
from tcal.student.convert import build_student
from tcal.training import data as data_module
from tcal.training.data import StepSampler, pack
from tcal.training.kd import chunked_kd_loss
from tcal.training.stages import AlignStage, DistillStage

TINY_STAGE = ("stage.batch_size=2", "stage.seq_len=32")


# ----------------------------------------------------------------------------------------------------------
# Chunked KL


def direct_kd(student_hidden, teacher_hidden, student_head, teacher_head, input_ids, mask, ce_weight):
    """The plain computation: full-batch logits of both models, per-token KL, masked means."""
    s_logp = F.log_softmax(student_head(student_hidden).float(), -1)
    t_logp = F.log_softmax(teacher_head(teacher_hidden).float(), -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    valid = mask.bool()
    loss = kl[valid].mean()
    if ce_weight:
        ce = F.nll_loss(s_logp[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
        pairs = valid[:, :-1] & valid[:, 1:]
        loss = loss + ce_weight * ce[pairs].mean()
    return loss


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1000])
@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
def test_chunked_kl_equals_direct_computation(chunk_size, ce_weight):
    gen = torch.Generator().manual_seed(0)
    B, T, D, V = 3, 7, 8, 11
    student_head, teacher_head = torch.nn.Linear(D, V, bias=False), torch.nn.Linear(D, V, bias=False)
    student_hidden = torch.randn(B, T, D, generator=gen, requires_grad=True)
    teacher_hidden = torch.randn(B, T, D, generator=gen)
    input_ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    mask[2, :2] = 0  # left padding

    expected = direct_kd(student_hidden, teacher_hidden, student_head, teacher_head, input_ids, mask, ce_weight)
    expected_grads = torch.autograd.grad(expected, [student_hidden, student_head.weight])
    loss, parts = chunked_kd_loss(student_hidden, teacher_hidden, student_head, teacher_head, input_ids, mask,
                                  chunk_size, ce_weight)
    grads = torch.autograd.grad(loss, [student_hidden, student_head.weight])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert parts["kl"] > 0
    assert teacher_head.weight.grad is None  # the teacher never receives gradients


def test_chunked_kl_is_zero_for_identical_models_and_rejects_bad_input():
    head = torch.nn.Linear(4, 9, bias=False)
    hidden = torch.randn(2, 5, 4)
    loss, _ = chunked_kd_loss(hidden, hidden, head, head, torch.zeros(2, 5, dtype=torch.long), chunk_size=3)
    assert abs(loss.item()) < 1e-6
    with pytest.raises(ValueError, match=r"stage.kl_chunk_size=0"):
        chunked_kd_loss(hidden, hidden, head, head, torch.zeros(2, 5, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="no valid"):
        chunked_kd_loss(hidden, hidden, head, head, torch.zeros(2, 5, dtype=torch.long),
                        mask=torch.zeros(2, 5, dtype=torch.long))


def test_checkpointed_gdn_mixer_gives_the_same_output_and_gradients():
    from tcal.student.gdn import GatedDeltaNet

    torch.manual_seed(0)
    plain = GatedDeltaNet(32, 2, 16).train()
    recomputed = GatedDeltaNet(32, 2, 16).train()
    recomputed.load_state_dict(plain.state_dict())
    recomputed.checkpoint_training = True
    x = torch.randn(2, 70, 32)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :5] = 0
    outs = [m(x, linear_attention_mask=mask)[0] for m in (plain, recomputed)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for out in outs:
        out.square().mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8, msg=name)


# ----------------------------------------------------------------------------------------------------------
# Data


def test_step_sampler_positions_by_hand():
    """Step s of rank r reads samples (s * world + r) * batch ...; a restart at step 2 continues exactly."""
    rank0 = StepSampler(batch_size=2, total_steps=3, rank=0, world_size=2)
    rank1 = StepSampler(batch_size=2, total_steps=3, rank=1, world_size=2)
    assert list(rank0) == [0, 1, 4, 5, 8, 9]
    assert list(rank1) == [2, 3, 6, 7, 10, 11]
    resumed = StepSampler(batch_size=2, total_steps=3, rank=1, world_size=2, start_step=lambda: 2)
    assert list(resumed) == [10, 11] and len(resumed) == 2


def test_pack_and_epochs():
    stream = torch.arange(23)
    windows = pack(stream, 5)
    assert windows.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    dataset = data_module.EpochWindows(windows, seed=3)
    epoch0 = {tuple(dataset[i].tolist()) for i in range(4)}
    epoch1 = {tuple(dataset[i].tolist()) for i in range(4, 8)}
    assert epoch0 == epoch1 == {tuple(w) for w in windows.tolist()}  # every window once per epoch
    with pytest.raises(ValueError, match=r"fewer than one sequence of stage.seq_len=30"):
        pack(stream, 30)


def test_token_cache_tokenizes_once(tmp_path, monkeypatch):
    from conftest import repo_cache_dir

    from tcal.teachers.load import load_tokenizer

    tokenizer = load_tokenizer(compose("teacher=tiny_llama").teacher, repo_cache_dir())
    docs = [Document("a", "To be, or not to be: that is the question."), Document("b", "All the world's a stage.")]
    first = token_stream(docs, tokenizer, tmp_path)
    assert torch.equal(first, tokenize_documents(docs, tokenizer))
    monkeypatch.setattr(tcal.data.documents, "tokenize_documents", lambda *a: pytest.fail("tokenized again"))
    assert torch.equal(token_stream(list(docs), tokenizer), first)  # this process remembers the stream
    forget_token_streams()
    assert torch.equal(token_stream(docs, tokenizer, tmp_path), first)  # another process: read from disk
    (next((tmp_path / "tokens").iterdir())).write_bytes(b"truncated")  # a damaged entry is rebuilt
    monkeypatch.setattr(tcal.data.documents, "tokenize_documents", tokenize_documents)
    assert torch.equal(token_stream(docs, tokenizer, tmp_path), first)


def occurs_in(windows: torch.Tensor, stream: torch.Tensor) -> list[bool]:
    """Whether each row of `windows` [W, n] occurs in `stream` as n consecutive tokens. Candidates come from a hash
    of every n-gram of the stream, computed at once (a set of its million n-grams as bytes took seconds); each is
    confirmed token by token, so a hash collision cannot decide."""
    n = windows.shape[1]
    grams = stream.unfold(0, n, 1)
    powers = torch.tensor([(1_000_003 ** i) % 2 ** 64 for i in range(n)], dtype=torch.uint64).view(torch.int64)
    keys = (grams * powers).sum(1)  # wraps around: int64 arithmetic modulo 2**64
    order = torch.argsort(keys)
    keys = keys[order]
    window_keys = (windows * powers).sum(1)
    found = []
    for window, key, at in zip(windows, window_keys.tolist(), torch.searchsorted(keys, window_keys).tolist()):
        while at < len(keys) and keys[at] == key and not torch.equal(grams[order[at]], window):
            at += 1
        found.append(bool(at < len(keys) and keys[at] == key))
    return found


def test_training_batches_never_hold_calibration_or_evaluation_windows(tmp_path):
    cfg = compose("experiment=smoke", f"paths.cache_dir={isolated_cache_dir(tmp_path / 'cache')}", "stage=distill",
                  "stage.batch_size=4", "stage.seq_len=16", "stage.max_tokens=4096", "stage.eval_every_tokens=4096")
    ctx = Run.build(cfg, run_dir=tmp_path / "run")
    (plan,) = ctx.plans
    batches = torch.cat(list(plan.data.train_dataloader()))
    assert batches.shape == (4096 // 16, 16)
    train = token_stream(ctx.splits.train, ctx.tokenizer)
    held_out = token_stream(ctx.splits.calibration + ctx.splits.evaluation, ctx.tokenizer)
    assert all(occurs_in(batches, train))
    assert not any(occurs_in(batches, held_out))


def test_occurs_in_finds_exactly_the_windows_of_a_stream():
    stream = torch.randint(0, 50, (500,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([stream[7:23], stream[480:496], stream[100:116].flip(0), torch.full((16,), 60)])
    assert occurs_in(windows, stream) == [True, True, False, False]


# ----------------------------------------------------------------------------------------------------------
# Stages on the tiny teacher


def _stage_module(kind, init_steps, cfg_overrides):
    teacher = make_teacher("llama")
    student = build_student(teacher, [0, 2], seed=0)
    cfg = compose(f"stage={kind}", *cfg_overrides).stage
    return (AlignStage if kind == "align" else DistillStage)(student, teacher, cfg, init_steps), teacher


@pytest.mark.parametrize("kind,overrides", [("align", ["stage.lr=3e-3"]),
                                            ("distill", ["stage.lr_mixer=3e-3", "stage.lr_rest=1e-3"])])
def test_each_stage_lowers_its_loss_on_a_fixed_batch(kind, overrides):
    import lightning as L
    from torch.utils.data import DataLoader

    steps = 30
    module, teacher = _stage_module(kind, steps, overrides)
    gen = torch.Generator().manual_seed(1)
    batches = torch.randint(3, teacher.config.vocab_size, (steps * 2, 24), generator=gen)
    probe = batches[:2]
    with torch.no_grad():
        before = module.loss(probe)[0].item()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(module, DataLoader(batches, batch_size=2))
    with torch.no_grad():
        after = module.loss(probe)[0].item()
    assert module.tokens_seen == steps * 2 * 24
    assert after < 0.9 * before, (kind, before, after)


def test_align_trains_only_gdn_parameters():
    module, _ = _stage_module("align", 2, [])
    trainable = {n for n, p in module.student.named_parameters() if p.requires_grad}
    assert trainable and all(".self_attn." in n and int(n.split(".")[2]) in (1, 3) for n in trainable)
    grouped = {id(p) for g in module.parameter_groups() for p in g["params"]}
    assert grouped == {id(p) for p in module.student.parameters() if p.requires_grad}


def test_distill_parameter_groups():
    module, _ = _stage_module("distill", 2, [])
    mixers, rest = module.parameter_groups()
    assert (mixers["lr"], rest["lr"]) == (1e-4, 7e-6)
    gdn = {id(p) for i in (1, 3) for p in module.student.gdn(i).parameters()}
    assert {id(p) for p in mixers["params"]} == gdn
    assert {id(p) for p in rest["params"]} == {id(p) for p in module.student.parameters()} - gdn


# ----------------------------------------------------------------------------------------------------------
# End to end: curves, Stage 1 cache, kill and resume


def smoke_cfg(cache, *overrides):
    return compose("experiment=smoke", f"paths.cache_dir={cache}", "init=zero_gate", "eval.num_windows=2",
                   *overrides)


def read_results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def test_distill_run_writes_a_token_curve(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    cfg = smoke_cfg(cache, "stage=distill", *TINY_STAGE, "stage.max_tokens=512", "stage.eval_every_tokens=200")
    results = run(cfg, tmp_path / "run")
    record = results["stages"]["distill"]
    assert record["tokens_per_step"] == 64 and record["steps"] == 8 and record["tokens_seen"] == 512
    curve = read_results(tmp_path / "run")["curve"]["shakespeare"]
    # every round(200 / 64) = 3 steps (192 tokens), at 0 and at the end
    assert [p["tokens"] for p in curve] == [0, 192, 384, 512]
    assert curve[-1]["ppl"] == pytest.approx(results["metrics"]["shakespeare"]["student_ppl"], rel=1e-6)
    metrics = (tmp_path / "run" / "logs" / "metrics.csv").read_text().splitlines()
    assert "distill/loss" in metrics[0] and "distill/ppl/shakespeare" in metrics[0]
    assert (tmp_path / "run" / "checkpoints" / "distill" / "last.ckpt").is_file()


def test_stage1_result_is_reused(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    overrides = ("stage=align", *TINY_STAGE, "stage.max_tokens=256", "stage.eval_every_tokens=128", "save_student=true")
    first = run(smoke_cfg(cache, *overrides), tmp_path / "a")
    second = run(smoke_cfg(cache, *overrides), tmp_path / "b")
    assert not first["stages"]["align"]["cached"] and second["stages"]["align"]["cached"]
    assert second["curve"] == first["curve"]
    a, b = (load_file(tmp_path / run_dir / "student" / "model.safetensors") for run_dir in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    changed = run(smoke_cfg(cache, *overrides, "stage.lr=2e-3"), tmp_path / "c")
    assert not changed["stages"]["align"]["cached"]


class Killed(RuntimeError):
    pass


class KillAfter(Callback):
    """Raises (like a kill: nothing after it runs) once `step` optimizer steps are done."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def test_kill_and_resume_gives_the_uninterrupted_run(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    overrides = ("stage=align_distill", "stage.align.batch_size=2", "stage.align.seq_len=32",
                 "stage.align.max_tokens=128", "stage.align.eval_every_tokens=128", "stage.distill.batch_size=2",
                 "stage.distill.seq_len=32", "stage.distill.max_tokens=448", "stage.distill.eval_every_tokens=128",
                 "stage.distill.lr_mixer=3e-3", "stage.distill.lr_rest=1e-3")
    straight = run(smoke_cfg(cache, *overrides), tmp_path / "straight")

    killed_dir = tmp_path / "killed"
    with pytest.raises(Killed):
        run(smoke_cfg(cache, *overrides), killed_dir, callbacks=[KillAfter(3)])
    interrupted = read_results(killed_dir)
    assert (interrupted["status"], interrupted["failed_after"]) == ("failed", "trained_align")
    assert interrupted["error"] == "Killed: killed at step 3"
    assert (killed_dir / "checkpoints" / "distill" / "last.ckpt").is_file()
    resumed = run(recorded_run(killed_dir), killed_dir, resume=True)
    assert resumed["stages"]["distill"]["resumed"] and resumed["stages"]["align"]["cached"]
    assert resumed["curve"] == straight["curve"]
    tokens = [p["tokens"] for p in resumed["curve"]["shakespeare"]]
    assert tokens == [0, 128, 256, 384, 448]
    a, b = (load_file(tmp_path / d / "student" / "model.safetensors") for d in ("straight", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_results(killed_dir)["status"] == "complete" and "error" not in read_results(killed_dir)


# ----------------------------------------------------------------------------------------------------------
# DDP on two CPU processes


@pytest.mark.slow  # the same run and checks, in the default set: test_distributed.py's two ranks of batch 2
def test_ddp_two_processes_count_both_ranks_and_end_identical(tmp_path):
    cache = isolated_cache_dir(tmp_path / "cache")
    run_dir = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "tcal.cli.app", "experiment=smoke", f"paths.cache_dir={cache}", "init=zero_gate",
           "eval.num_windows=2", "stage=distill", *TINY_STAGE, "stage.max_tokens=384", "stage.eval_every_tokens=128",
           "trainer=ddp", f"hydra.run.dir={run_dir}", "save_student=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = read_results(run_dir)["stages"]["distill"]
    assert record["world_size"] == 2
    assert record["tokens_per_step"] == 2 * 2 * 32 and record["steps"] == 3 and record["tokens_seen"] == 384
    digests = record["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert [p["tokens"] for p in read_results(run_dir)["curve"]["shakespeare"]] == [0, 128, 256, 384]


# ----------------------------------------------------------------------------------------------------------
# Bad input: a clear error before any work, and no results.json


def _fails(tmp_path, match, *overrides, exc=ValueError):
    with pytest.raises(exc, match=match):
        run(smoke_cfg(isolated_cache_dir(tmp_path / "cache"), *overrides), tmp_path / "run")
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.parametrize("overrides,match", [
    (("stage=distill", "stage.seq_len=8192"), r"stage.seq_len=8192 is beyond the teacher's context of 4096"),
    (("stage=distill", "stage.max_tokens=0"), r"stage.max_tokens=0; expected a positive integer"),
    (("stage=distill", "stage.max_tokens=-5"), r"stage.max_tokens=-5; expected a positive integer"),
    (("stage=distill", "stage.eval_every_tokens=200000"), r"stage.eval_every_tokens=200000 is larger than "
                                                          r"stage.max_tokens=100000"),
    (("stage=distill", "stage.max_tokens=100", "stage.eval_every_tokens=100"),
     r"stage.max_tokens=100 is less than one step of 2048 tokens"),
    (("stage=align", "stage.lr=0"), r"stage.lr=0.0; expected a learning rate > 0"),
    (("stage=align_distill", "stage.distill.batch_size=0"), r"stage.distill.batch_size=0; expected a positive"),
])
def test_bad_stage_settings(tmp_path, overrides, match):
    _fails(tmp_path, match, *overrides)


def test_unknown_stage_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^stage='bogus': no such option in config group 'stage'"):
        compose("stage=bogus")


def test_missing_and_empty_training_data(tmp_path):
    missing = tmp_path / "nope.txt"
    _fails(tmp_path / "a", r"data.files: '.*nope.txt' does not exist", "data.source=files", f"data.files=[{missing}]",
           "stage=distill", exc=ConfigError)
    paths = [tmp_path / f"doc{i}.txt" for i in range(3)]
    for path in paths:
        path.write_text("Words and more words. " * 200)
    data = ("data.source=files", f"data.files=[{','.join(map(str, paths))}]", "data.calibration_docs=1",
            "data.evaluation_docs=1")
    (train_doc,) = load_splits(compose(*data).data).train
    (tmp_path / f"{train_doc.name}.txt").write_text("Hi.")  # shorter than one sequence (empty files: test_bad_data)
    _fails(tmp_path / "b", r"training split has \d tokens, fewer than one sequence of stage.seq_len=32", *data,
           "stage=distill", *TINY_STAGE, "stage.max_tokens=64", "stage.eval_every_tokens=64", "eval.num_windows=1",
           "calibration.check=false")


def test_wandb_logger_offline_gets_the_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = smoke_cfg(isolated_cache_dir(tmp_path / "cache"), "logger=wandb", "stage=distill", *TINY_STAGE,
                    "stage.max_tokens=128", "stage.eval_every_tokens=64", "save_student=false")
    run(cfg, tmp_path / "run")
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    history = b"".join(p.read_bytes() for p in offline.glob("*.wandb"))
    for key in (b"distill/ppl/shakespeare", b"distill/tokens_seen", b"eval/metrics/shakespeare/student_ppl"):
        assert key in history
    config = (offline / "files" / "config.yaml").read_text() if (offline / "files" / "config.yaml").exists() else ""
    assert "zero_gate" in config or b"zero_gate" in history
    kept = json.loads((tmp_path / "run" / "results.json").read_text())["wandb"]
    assert offline.name.endswith(kept["id"]) and kept["group"] == "zero_gate"  # grouped by the run's own init


def test_a_resumed_wandb_run_logs_to_the_recorded_run_and_group(tmp_path, monkeypatch):
    """The W&B run a record keeps is the one a resume logs to, in the recorded group, whatever init the resume
    command's defaults name."""
    from tcal.tracking import make_logger, wandb_identity

    monkeypatch.setenv("WANDB_MODE", "offline")
    settings = compose("experiment=smoke", "init=naive", "logger=wandb")
    first = wandb_identity(settings)
    assert first["group"] == "naive" and wandb_identity(settings, {"wandb": first}) == first
    logger = make_logger(settings, tmp_path, wandb_identity(settings, {"wandb": first}))
    assert (logger._wandb_init["id"], logger._wandb_init["resume"], logger._wandb_init["group"]) == (
        first["id"], "allow", "naive")


@pytest.mark.parametrize("data", ["wikitext", "fineweb_edu"])
def test_hub_datasets_fail_with_a_clear_offline_message(data, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = compose(f"data={data}").data
    with pytest.raises(ConnectionError, match=rf"data.dataset='{cfg.dataset}' could not be loaded.*data.source=files"):
        load_splits(cfg)


@pytest.mark.slow
def test_sigkill_and_resume_from_the_command_line(tmp_path):
    """A real kill (SIGKILL of the `tcal` process after its first checkpoint), then `tcal resume=RUN_DIR`."""
    import signal
    import time

    cache = isolated_cache_dir(tmp_path / "cache")
    overrides = ["experiment=smoke", f"paths.cache_dir={cache}", "init=zero_gate", "eval.num_windows=2", "stage=distill",
                 *TINY_STAGE, "stage.max_tokens=1280", "stage.eval_every_tokens=128"]
    straight = run(compose(*overrides), tmp_path / "straight")
    run_dir = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cwd = REPO
    proc = subprocess.Popen([sys.executable, "-m", "tcal.cli.app", *overrides, f"hydra.run.dir={run_dir}"], cwd=cwd,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / "distill" / "last.ckpt"
    deadline = time.time() + 300
    while not checkpoint.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.is_file() and read_results(run_dir)["status"] != "complete"
    done = subprocess.run([sys.executable, "-m", "tcal.cli.app", f"resume={run_dir}",
                           f"hydra.run.dir={tmp_path / 'resume_log'}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = read_results(run_dir)
    assert resumed["status"] == "complete" and resumed["stages"]["distill"]["resumed"]
    assert resumed["curve"] == straight["curve"]
    a, b = (load_file(d / "student" / "model.safetensors") for d in (tmp_path / "straight", run_dir))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("trainer", ["gpu", "fsdp"])
def test_gpu_trainers_fail_before_any_work_without_a_gpu(tmp_path, trainer):
    _fails(tmp_path, r"trainer.accelerator='gpu' .*no GPU is visible", f"trainer={trainer}", "stage=distill")
