"""Shared fixtures: tiny random teachers of each family, Hydra composition of the app's configs, and example
records (results.json) checked against the schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
# The suite reads and writes nothing of the user's, whatever their environment: not the cache $TCAL_CACHE_DIR names
# (the tests' shared cache is the repo's own .cache/tcal), not a W&B account, not the folder pytest was started from
# (relative paths resolve in the repo, as under `make test`).
for _name in ("TCAL_CACHE_DIR", "WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID",
              "WANDB_RESUME", "WANDB_RUN_GROUP"):
    os.environ.pop(_name, None)
os.environ["WANDB_MODE"] = "offline"
os.chdir(REPO)

# Every model in the tests is tiny: with 2 OpenMP threads on a busy 2-core machine each small matmul waits
# on thread sync (about 15 ms for a 64x64 linear, against 6 us on one thread). One thread is faster here, and in
# every process a test starts (`tcal` runs, ranks, the xdist workers): they inherit OMP_NUM_THREADS, whatever the
# caller's (a `tcal` smoke run took 2-3x the CPU time and wall time with OpenMP's default of 2 threads).
os.environ["OMP_NUM_THREADS"] = os.environ.get("TCAL_TEST_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

FAMILY_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
FAMILIES = tuple(FAMILY_CLASSES)

TINY_VOCAB = 101
TINY_SIZES = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaked, head-dependent attention instead of near-uniform
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_teacher(family: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A tiny random teacher of `family` (llama, qwen2, qwen3) in float32 eval mode, built offline."""
    config_cls, model_cls = FAMILY_CLASSES[family]
    sizes = {**TINY_SIZES, **overrides}
    if family == "qwen2":
        sizes.setdefault("use_sliding_window", False)
    config = config_cls(**sizes)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config)
    if family == "qwen2":
        # Biases start at zero; make them non-zero so dropping them is a real change.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if family == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_teachers():
    """Session-wide tiny teachers keyed by family; do not modify them in a test."""
    return {name: make_teacher(name) for name in FAMILIES}


def compose(*overrides: str):
    """The run settings of `tcal <overrides>` (composed by Hydra and converted, as the entry does): every test
    composes here or with `compose_config`."""
    from tcal.settings.compose import settings_for

    return settings_for(*overrides)


def compose_config(*overrides: str, return_hydra_config: bool = False):
    """The composed DictConfig itself (with its `hydra` node when asked: a sweep's `hydra.sweeper.params`)."""
    from tcal.settings.compose import compose as compose_hydra

    return compose_hydra(*overrides, return_hydra_config=return_hydra_config)


def repo_cache_dir() -> str:
    """The repo's cache (`.cache/tcal`), where the SmolLM2 teacher and tokenizer are converted once."""
    return str(REPO / ".cache" / "tcal")


_SHARED_STORE: list[Path] = []


def default_token_store() -> Path:
    """The folder of the default training split's token store (Shakespeare's training plays, the packaged tokenizer,
    no cap) in the repo cache, prepared there once (about 1.3M tokens: seconds of tokenizing that every training run
    in a fresh cache would repeat)."""
    if not _SHARED_STORE:
        from tcal.data.documents import load_splits
        from tcal.data.token_store import open_store
        from tcal.teachers.load import load_tokenizer

        settings = compose("experiment=smoke")
        tokenizer = load_tokenizer(settings.teacher, repo_cache_dir())
        _SHARED_STORE.append(open_store(load_splits(settings.data).train, tokenizer, repo_cache_dir(),
                                        settings.data).folder)
    return _SHARED_STORE[0]


def isolated_cache_dir(folder: Path) -> str:
    """A fresh cache folder for a run (nothing cached: calibrations and selections are computed) that shares
    the repo cache's converted SmolLM2 teacher/tokenizer and the default training split's token store
    (`default_token_store`) through symlinks (made there once if missing). A run on other training data or another
    `data.max_tokens` prepares its own store here."""
    from tcal.teachers.load import load_tokenizer

    shared = Path(repo_cache_dir())
    load_tokenizer(compose("teacher=tiny_llama").teacher, shared)  # converts the packaged GGUF's tokenizer once
    folder = Path(folder)
    for kind in ("teachers", "tokenizers"):
        (folder / kind).mkdir(parents=True, exist_ok=True)
        for converted in (shared / kind).iterdir() if (shared / kind).is_dir() else ():
            link = folder / kind / converted.name
            if not converted.name.endswith(".tmp") and not link.is_symlink():  # a folder asked for again keeps its links
                link.symlink_to(converted.resolve(), target_is_directory=True)
    store = default_token_store()
    (folder / "token_store").mkdir(exist_ok=True)
    if not (folder / "token_store" / store.name).is_symlink():
        (folder / "token_store" / store.name).symlink_to(store.resolve(), target_is_directory=True)
    return str(folder)


@pytest.fixture
def compose_cfg():
    """`compose_cfg("experiment=smoke", "paths.cache_dir=...")` -> the run's settings."""
    return compose


@pytest.fixture
def one_rank_group():
    """Lightning's strategy joins a one-process gloo group and sets LOCAL_RANK, NODE_RANK and MASTER_* in the
    environment (a later `trainer=ddp` subprocess would take itself for an externally launched rank): both undone."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


# --- example records: results.json as the pipeline writes it ---

def _stage_config(stage: str) -> dict:
    if stage == "none":
        return {"name": "none"}
    if stage == "align_distill":
        return {"name": stage, "sequence": ["align", "distill"]}
    return {"name": stage, "kind": stage}


def example_stage(kind: str = "distill", tokens_seen: int = 64, curve: dict | None = None) -> dict:
    """A stage record as the training runner writes it (`results.json` `stages.<kind>`), for tests."""
    return {"kind": kind, "settings": {"name": kind}, "steps": 1, "tokens_seen": tokens_seen,
            "tokens_per_step": tokens_seen, "world_size": 1, "seconds_this_process": 0.5, "loss_first": 2.0,
            "loss_last": 1.5, "rank_weight_digests": ["0" * 15], "curve": curve or {}, "resumed": False,
            "cached": False}


EXAMPLE_SETTINGS = {"teacher.name": "t1", "retention.name": "uniform", "retention.ratio": 0.5, "init.name": "full",
                    "init.gqa_expansion": "whole_head", "stage": "none"}


def example_record(status: str = "complete", failed_after: str | None = None, **fields) -> dict:
    """A record as the pipeline writes it, checked against the schema, for tests: a 4-layer teacher "t1" with
    layers 0 and 2 kept (uniform, ratio 0.5), init `full`, zero-shot, one eval set (shakespeare). The settings are
    given by the names version 1 copied them under (`retention`, `ratio`, `init_mode`, `gqa_expansion`, `stage`,
    `teacher`; ratio None: none) and go into its config, as do the defaults of those not given (a `config` given
    keeps its own values). `fields` replace or add fields; a record short of "complete" holds only the fields of its
    status (and those given)."""
    from tcal.store.record import COPIES, check_record, new_record, required_fields

    settings = {**EXAMPLE_SETTINGS, **{key: fields.pop(copy) for key, copy in COPIES.items() if copy in fields}}
    config = json.loads(json.dumps(fields.get("config", {"seed": 0})))
    for key, value in settings.items():
        group, _, name = key.rpartition(".")
        if key == "stage":
            config.setdefault("stage", _stage_config(value))
        elif value is not None:
            config.setdefault(group, {}).setdefault(name, value)
    record = new_record(config, 4, [0, 2], {}, "torch-chunk", {"convert": 0.1})
    record.update(calibration={}, init_weights_digest="0" * 16,
                  metrics={"shakespeare": {"teacher_ppl": 20.0, "student_ppl": 25.0}})
    record.update(fields, config=config)
    record["status"] = status
    if status == "failed":
        record.update(failed_after=failed_after, error=fields.get("error", "RuntimeError: an example failure"))
    kept = {"schema_version", *required_fields(status, failed_after), *fields}
    return check_record({k: v for k, v in record.items() if k in kept}, "example record")


def as_version_1(record: dict) -> dict:
    """`record` as schema version 1 wrote it: its settings also copied to the top level (`COPIES`; the teacher's
    copy with its depth, which replaces `num_layers`)."""
    from tcal.store.record import COPIES, check_record, recorded_setting

    old = {key: value for key, value in record.items() if key != "num_layers"}
    if "num_layers" in record:
        old.update({copy: recorded_setting(record, key) for key, copy in COPIES.items()})
        old["teacher"] = {"name": old["teacher"], "num_layers": record["num_layers"]}
    return check_record({**old, "schema_version": 1}, "example record of version 1")
