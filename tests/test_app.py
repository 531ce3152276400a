"""The main job end to end on a tiny teacher: results.json, the saved student, extra eval sets; (slow) every
named experiment through the `tcal` console script."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose, compose_config, example_record, isolated_cache_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from tcal.cli.app import earlier_run, run_in
from tcal.data.documents import Splits, eval_sets, load_splits, token_windows
from tcal.errors import ConfigError, FolderInUse
from tcal.evaluate.perplexity import perplexity
from tcal.pipeline import run
from tcal.store.record import COPIES, recorded_setting
from tcal.student.hybrid import HybridForCausalLM

EXTRA_TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, and the {i}th sheep counts its blessings."
    for i in range(60)
)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke run (tiny random Llama teacher, short windows) with an extra local eval file."""
    root = tmp_path_factory.mktemp("smoke")
    extra = root / "extra.txt"
    extra.write_text(EXTRA_TEXT)
    cache = isolated_cache_dir(root / "cache")  # computes everything; the shared cache only lends the tokenizer
    cfg = compose("experiment=smoke", f"paths.cache_dir={cache}", f"paths.output_dir={root / 'outputs'}",
                  f"data.eval_files=[{extra}]")
    run_dir = root / "run"
    returned = run(cfg, run_dir)
    return cfg, run_dir, returned


def test_results_json(smoke_run):
    cfg, run_dir, returned = smoke_run
    results = json.loads((run_dir / "results.json").read_text())
    assert results == json.loads(json.dumps(returned))  # what run() returns is what it wrote
    assert results["status"] == "complete"
    assert (recorded_setting(results, "teacher.name"), results["num_layers"]) == ("tiny_llama", 4)
    assert recorded_setting(results, "retention.name") == "uniform"
    assert results["keep_layers"] == [0, 2]  # ratio 0.5 of 4 layers
    assert recorded_setting(results, "init.name") == cfg.init.name  # the config's default init
    assert results["config"] == json.loads(json.dumps(cfg.tree())) and not set(COPIES.values()) & set(results)
    assert set(results["metrics"]) == {"shakespeare", "extra"}
    for name, metrics in results["metrics"].items():
        for key in ("teacher_ppl", "student_ppl"):
            value = metrics[key]
            assert isinstance(value, float) and math.isfinite(value) and value > 1, (name, key, value)
    timings = results["timings"]
    assert {"load_teacher", "retention", "convert", "init", "evaluate", "save"} <= set(timings)
    assert all(isinstance(t, (int, float)) and t >= 0 for t in timings.values())
    assert results["kernel_path"] == "torch-chunk"
    # Written atomically: no temporary files left behind.
    assert {"results.json", "student"} <= {p.name for p in run_dir.iterdir()}
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]


def test_rerun_into_the_same_folder_skips_a_complete_run_and_continues_an_unfinished_one(smoke_run, tmp_path,
                                                                                          monkeypatch, capsys):
    cfg, run_dir, _ = smoke_run
    results = run_dir / "results.json"
    before = (results.read_bytes(), results.stat().st_mtime_ns)
    assert earlier_run(cfg, run_dir) == "complete"
    run_in(cfg, run_dir)
    assert "already holds this run, complete; nothing to do" in capsys.readouterr().out
    assert (results.read_bytes(), results.stat().st_mtime_ns) == before

    calls = []
    monkeypatch.setattr("tcal.pipeline.run", lambda cfg, folder, resume=False, ranks=None: calls.append((folder, resume)))
    data = json.loads(results.read_text())
    other = {**data["config"], "seed": data["config"]["seed"] + 1}
    elsewhere = {**data["config"], "paths": {**data["config"]["paths"], "cache_dir": str(tmp_path / "elsewhere")}}
    for name, record in [("unfinished", {**data, "status": "trained_distill"}),
                         ("cache_moved", {**data, "status": "initialized", "config": elsewhere}),
                         ("failed_before_work", example_record("failed", config=other)),
                         ("damaged", None), ("empty", None)]:
        folder = tmp_path / name
        folder.mkdir()
        if record:
            (folder / "results.json").write_text(json.dumps(record))
        elif name == "damaged":
            (folder / "results.json").write_text(results.read_text()[:100])
        run_in(cfg, folder)
    assert calls == [(tmp_path / "unfinished", True), (tmp_path / "cache_moved", True),
                     (tmp_path / "failed_before_work", False), (tmp_path / "damaged", False),
                     (tmp_path / "empty", False)]
    assert "holds this run, unfinished; continuing it" in capsys.readouterr().out


@pytest.mark.parametrize("status", ["complete", "trained_distill", "failed"])
def test_a_folder_holding_a_run_of_another_config_is_refused(smoke_run, tmp_path, monkeypatch, status):
    cfg, run_dir, _ = smoke_run
    monkeypatch.setattr("tcal.pipeline.run", lambda *args, **kwargs: pytest.fail("ran into a used folder"))
    data = json.loads((run_dir / "results.json").read_text())
    config = {**data["config"], "seed": 7, "retention": {**data["config"]["retention"], "ratio": 0.75}}
    folder = tmp_path / "used"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(example_record(status, "initialized", config=config)))
    before = (folder / "results.json").read_bytes()
    with pytest.raises(FolderInUse, match=rf"^{folder} holds a run of another config \(retention.ratio=0.5 \(that run: "
                                          rf"0.75\), seed=0 \(that run: 7\)\); expected an empty folder"):
        run_in(cfg, folder)
    assert (folder / "results.json").read_bytes() == before


def test_saved_student_reproduces_the_run(smoke_run):
    cfg, run_dir, _ = smoke_run
    results = json.loads((run_dir / "results.json").read_text())
    folder = run_dir / "student"
    student = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(student, HybridForCausalLM)
    assert student.config.keep_layers == results["keep_layers"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    splits = load_splits(cfg.data)
    for name, docs in eval_sets(cfg.data, splits).items():
        windows = token_windows(docs, tokenizer, int(cfg.eval.seq_len), int(cfg.eval.num_windows))
        ppl = perplexity(student, windows, int(cfg.eval.batch_size))
        expected = results["metrics"][name]["student_ppl"]
        assert math.isclose(ppl, expected, rel_tol=1e-4), (name, ppl, expected)
    with torch.no_grad():
        out = student.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_default_config_is_the_main_job():
    """`tcal` with no arguments: SmolLM2 teacher, uniform retention at 0.5, 512-token windows, >= 16 of them."""
    cfg = compose()
    assert cfg.teacher.name == "smollm2_135m"
    assert cfg.retention.name == "uniform" and cfg.retention.ratio == 0.5
    assert cfg.eval.seq_len == 512 and cfg.eval.num_windows >= 16
    assert cfg.data.eval_name() == "shakespeare" and list(cfg.data.eval_files) == []
    assert cfg.save_student


@pytest.mark.parametrize("overrides,name", [
    ([], "shakespeare"),
    (["data.source=files", "data.files=[/data/plays.txt]"], "plays"),
    (["data.source=files", "data.files=[/data/a.jsonl,/data/b.txt,/data/c.txt]"], "a+2"),
    (["data.source=files", "data.files=[/data/plays.txt]", "data.name=held_out"], "held_out"),
    (["data=wikitext"], "wikitext"),
    (["data=fineweb_edu"], "fineweb_edu"),
    (["data=wikitext", "data.dataset=json", "data.data_files={train:/data/notes.jsonl}"], "notes"),
    (["data=fineweb_edu", "data.dataset=parquet", "data.data_files={train:'/data/fw/10BT/*.parquet'}"], "10BT"),
])
def test_the_held_out_eval_set_is_named_by_its_source(overrides, name, tmp_path):
    """A run of local files or of another dataset does not record its held-out perplexity as `shakespeare` or as
    the option it started from: the set is named by what was read, unless `data.name` names it."""
    data = compose(*overrides).data
    assert list(eval_sets(data, Splits([], [], []))) == [name]  # the one place eval sets are named
    assert data.eval_name() == name


def test_a_file_named_like_the_held_out_set_is_refused_by_its_source_s_name():
    with pytest.raises(ConfigError, match=r"data.eval_files: eval set name 'plays' is used twice"):
        compose("data.source=files", "data.files=[/data/plays.txt]", "data.eval_files=[/other/plays.txt]")


def experiment_names() -> list[str]:
    folder = REPO / "experiments"
    return sorted(p.stem for p in folder.glob("*.yaml"))


def test_every_experiment_composes():
    names = experiment_names()
    assert "smoke" in names
    for name in names:
        cfg = compose(f"experiment={name}")
        assert cfg.teacher.name and cfg.retention.name and cfg.init.name


PAPER_EXPERIMENTS = [f"{t}_uniform_r025_align_distill" for t in ("qwen2_5_1_5b", "qwen2_5_3b", "llama3_2_3b", "qwen3_8b")]


@pytest.mark.parametrize("name", PAPER_EXPERIMENTS)
def test_paper_experiments_hold_the_paper_settings(name):
    cfg = compose(f"experiment={name}")
    assert cfg.teacher.name == name.split("_uniform")[0]
    assert (cfg.retention.name, cfg.retention.ratio) == ("uniform", 0.25)
    assert (cfg.data.eval_name(), cfg.logger.name, cfg.trainer.strategy) == ("fineweb_edu", "wandb", "fsdp")
    align, distill, gpus = cfg.stage.align, cfg.stage.distill, cfg.trainer.devices
    assert list(cfg.stage.sequence) == ["align", "distill"]
    assert (align.max_tokens, align.seq_len, align.batch_size * gpus) == (100_000_000, 512, 96)
    assert (align.lr, align.schedule, list(align.betas), align.grad_clip) == (1e-3, "cosine", [0.9, 0.95], 1.0)
    assert (distill.max_tokens, distill.seq_len, distill.batch_size * gpus) == (600_000_000, 4096, 32)
    assert (distill.lr_mixer, distill.lr_rest, distill.schedule) == (1e-4, 7e-6, "constant")
    assert align.eval_every_tokens == distill.eval_every_tokens == 32_768_000


def sweep_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("name", sweep_names())
def test_every_sweep_composes(name):
    cfg = compose_config(f"+sweep={name}", return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params and cfg.task_name == name
    assert cfg.hydra.sweep.dir.startswith(f"outputs/multirun/{name}/")


# Tiny overrides for every experiment: small teacher, few short windows, nothing saved. An experiment that
# needs more (a training budget, ...) adds its own entry here.
TINY = ["teacher=tiny_llama", "eval.seq_len=32", "eval.num_windows=2", "eval.batch_size=2", "save_student=false"]
TINY_PAPER = ["data=shakespeare", "trainer=cpu", "trainer.devices=1", "eval/harness=none", "eval/ruler=none",
              "calibration.batch_size=2", "calibration.seq_len=64", "calibration.phase2.steps=3",
              *(f"stage.{kind}.{key}={value}" for kind in ("align", "distill") for key, value in
                (("max_tokens", 128), ("eval_every_tokens", 64), ("batch_size", 2), ("seq_len", 32)))]
TINY_STAGE = [f"stage.{key}={value}" for key, value in (("max_tokens", 128), ("eval_every_tokens", 64),
                                                         ("batch_size", 2), ("seq_len", 32))]
EXTRA_TINY: dict[str, list[str]] = {**{name: TINY_PAPER for name in PAPER_EXPERIMENTS},
                                    "smollm2_135m_uniform_r050_distill": ["init=zero_gate", *TINY_STAGE],
                                    "smollm2_135m_position_ppl": ["init=naive", "eval.position_buckets=[0,8,16]"]}


def tcal_command() -> list[str]:
    script = Path(sys.executable).parent / "tcal"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tcal.cli.app"]


@pytest.mark.slow
@pytest.mark.parametrize("name", experiment_names())
def test_experiment_runs_from_the_command_line(name, tmp_path):
    run_dir = tmp_path / name
    cache = isolated_cache_dir(tmp_path / "cache")
    command = tcal_command() + [f"experiment={name}", f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}",
                                f"paths.output_dir={tmp_path / 'outputs'}", *TINY, *EXTRA_TINY.get(name, [])]
    threads = os.environ.get("TCAL_TEST_THREADS", "1")  # tiny models: one thread (see conftest)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "complete"
    assert recorded_setting(results, "teacher.name") == "tiny_llama"
    for metrics in results["metrics"].values():
        assert math.isfinite(metrics["teacher_ppl"]) and math.isfinite(metrics["student_ppl"])
    assert all(name in proc.stdout for name in results["metrics"])  # the printed table names each eval set


def test_datasets_source_splits_local_text_by_document(tmp_path):
    """`data.source=datasets` reads rows through `datasets` (here the offline `text` builder)."""
    from tcal.data.documents import load_splits

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line number {i} of the corpus" for i in range(20)) + "\n")
    cfg = compose("data=wikitext", "data.dataset=text", f"data.data_files={{train:{corpus}}}", "data.subset=null",
                  "data.calibration_docs=3", "data.evaluation_docs=5").data
    splits = load_splits(cfg)
    names = [d.name for part in (splits.train, splits.calibration, splits.evaluation) for d in part]
    assert (len(splits.calibration), len(splits.evaluation), len(splits.train)) == (3, 5, 12)
    assert len(set(names)) == 20
    assert {d.text for d in splits.evaluation} <= {f"line number {i} of the corpus" for i in range(20)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sweep_names())
def test_sweep_runs_from_the_command_line(name, tmp_path):
    """Each sweep with -m, every swept parameter narrowed to one tiny value, runs to a complete results.json."""
    params = compose_config(f"+sweep={name}", return_hydra_config=True).hydra.sweeper.params
    narrowed = [f"{key}=tiny_llama" if key == "teacher" else f"{key}={str(values).split(',')[0]}"
                for key, values in params.items()]
    cache = isolated_cache_dir(tmp_path / "cache")
    stage = compose(f"+sweep={name}", *narrowed).stage
    prefixes = [f"stage.{kind}" for kind in stage.sequence] if hasattr(stage, "sequence") else \
        [] if stage.name == "none" else ["stage"]
    tiny_stage = [f"{prefix}.{key}={value}" for prefix in prefixes for key, value in
                  (("max_tokens", 128), ("eval_every_tokens", 64), ("batch_size", 2), ("seq_len", 32))]
    command = tcal_command() + ["-m", f"+sweep={name}", *narrowed, f"paths.cache_dir={cache}",
                                f"paths.output_dir={tmp_path / 'outputs'}", "teacher=tiny_llama", "eval.seq_len=32",
                                "eval.num_windows=2", "eval/harness=none", "eval/ruler=none", "calibration.seq_len=64",
                                "calibration.batch_size=2", "calibration.phase2.steps=3", *tiny_stage]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (results,) = (tmp_path / "outputs" / "multirun").rglob("results.json")
    assert json.loads(results.read_text())["status"] == "complete"
