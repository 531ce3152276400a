"""Every user-settable value checked before work starts, with an error naming the key, the bad value and what
is allowed (`ConfigError`; the `tcal` entry prints it on one line and exits with code 2).

A value's type is the schema's business (`tcal.config`: Hydra refuses `stage.lr=fast` while composing); here are
the checks a type cannot express: ranges, names from a registry, settings that depend on one another, and what
depends on the machine, the files or the loaded teacher.

`validate_config(cfg)` runs first in `pipeline.run`, before the teacher loads: names, budgets, learning rates,
lengths against the teacher's context when its config is known without loading it, devices, dtypes, paths.
`validate_loaded(ctx)` runs once the teacher and the documents are in memory and before anything is written:
the real teacher's layers and context, and whether each split holds the tokens its windows need.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from pathlib import Path

import torch
from omegaconf import ListConfig, OmegaConf

from tcal.calibration.calibrate import PHASES
from tcal.calibration.phase1 import PHASE1_RULES
from tcal.calibration.pool import pool_windows
from tcal.convert import GQA_EXPANSIONS, validate_keep_layers
from tcal.data import SOURCES, check_dataset_reachable, token_stream
from tcal.errors import ConfigError
from tcal.evaluate.ruler import TASKS as RULER_TASKS
from tcal.evaluate.ruler import make_ruler_examples
from tcal.hub import hub_model_cached, hub_offline, looks_local
from tcal.init import INIT_MODES
from tcal.retention import POLICIES, num_kept
from tcal.schedule import SCHEDULES
from tcal.settings import is_known, known_keys, leaf_keys, unknown_key_message
from tcal.teachers import ADAPTERS
from tcal.teachers.load import DTYPES
from tcal.training.run import BUDGET_KEYS, stages_of, world_size
from tcal.training.stages import STAGES


PRECISIONS = ("16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true", "64-true", "32", "16", "bf16", "64",
              "transformer-engine", "transformer-engine-float16")
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
LOGGERS = ("none", "csv", "wandb")
HARNESSES = ("none", "local", "paper")
RULERS = ("none", "default")
SCORED = ("ar", "ga_s2")  # policies that read scoring windows of the calibration split


@contextlib.contextmanager
def as_config_error():
    """Checks shared with the library (keep lists, ratios) raise ValueError; at the run's start they are
    configuration errors."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err


def one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}; expected one of {', '.join(map(str, allowed))}")


def positive_int(key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key}={value!r}; expected a positive integer")


def positive_number(key: str, value, what: str = "a number > 0") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"{key}={value!r}; expected {what}")


def in_range(key: str, value, low: float, high: float, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < high
    if not ok:
        raise ConfigError(f"{key}={value!r}; expected {what}")


def fraction(key: str, value, what: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
    if not ok:
        raise ConfigError(f"{key}={value!r}; expected {what}")


def non_negative(key: str, value) -> None:
    in_range(key, value, 0.0, math.inf, "a number >= 0")


def window_length(key: str, value) -> None:
    """A window the run predicts tokens in: at least 2 tokens (with 1 nothing is predicted, and a token budget
    becomes one step per token)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ConfigError(f"{key}={value!r}; expected an integer >= 2 (a window needs a next token to predict)")


# ------------------------------------------------------------------------------------------------ known keys

def check_known_keys(cfg) -> None:
    """No setting the run would never read: a misspelled key, or one added with `+` or `++`."""
    known = known_keys(cfg)
    for key in sorted(leaf_keys(OmegaConf.to_container(cfg, resolve=False))):
        if not is_known(key, known):
            raise ConfigError(unknown_key_message(f"{key}={OmegaConf.select(cfg, key)!r}", key, known))


# ------------------------------------------------------------------------------------------------ groups


def check_init(cfg) -> None:
    init = cfg.init
    one_of("init.name", init.name, INIT_MODES.names())
    one_of("init.gqa_expansion", init.get("gqa_expansion", "whole_head"), GQA_EXPANSIONS)
    if "phases" in init:
        phases = list(init.phases)
        unknown = [p for p in phases if p not in PHASES]
        if unknown or not phases or len(set(phases)) != len(phases):
            raise ConfigError(f"init.phases={phases}; expected a non-empty list without repeats of {', '.join(PHASES)}")
    if "gate_scale" in init:
        positive_number("init.gate_scale", init.gate_scale)
    if init.name == "full_plus":
        check_full_plus(init, cfg.calibration.seq_len)


def check_full_plus(init, seq_len) -> None:
    """The pool (`init.pool.tokens` in windows of `calibration.seq_len`), its held-out windows and the minibatch
    Phase 2 of `init=full_plus`."""
    rules = list(init.phase1_rules)
    if not rules or any(r not in PHASE1_RULES for r in rules) or len(set(rules)) != len(rules):
        raise ConfigError(f"init.phase1_rules={rules}; expected a non-empty list without repeats of "
                          f"{', '.join(PHASE1_RULES)}")
    pool, phase2 = init.pool, init.phase2
    positive_int("init.pool.tokens", pool.tokens)
    window_length("calibration.seq_len", seq_len)
    if pool.tokens % seq_len:
        raise ConfigError(f"init.pool.tokens={pool.tokens}; expected a multiple of calibration.seq_len={seq_len} "
                          f"(the pool is cut into whole windows of that length)")
    windows = pool_windows(pool.tokens, seq_len)
    every = pool.held_out_every
    if not isinstance(every, int) or isinstance(every, bool) or not 2 <= every <= windows:
        raise ConfigError(f"init.pool.held_out_every={every!r}; expected an integer from 2 to the {windows} windows "
                          f"of the pool (init.pool.tokens={pool.tokens} / calibration.seq_len={seq_len}; every n-th "
                          f"pool window is held out: at least one must be)")
    if pool.get("layers_per_pass") is not None:
        positive_int("init.pool.layers_per_pass", pool.layers_per_pass)
    for key in ("steps", "batch_size", "select_every"):
        positive_int(f"init.phase2.{key}", phase2[key])
    fit = windows - windows // every
    if phase2.batch_size > fit:
        raise ConfigError(f"init.phase2.batch_size={phase2.batch_size} is more than the {fit} fit windows of the pool "
                          f"({windows} windows of calibration.seq_len={seq_len}, one in "
                          f"init.pool.held_out_every={every} held out)")
    for key in ("lr_projections", "lr_dynamics"):
        positive_number(f"init.phase2.{key}", phase2[key], "a learning rate > 0")
    one_of("init.phase2.schedule", phase2.schedule, SCHEDULES)
    non_negative("init.phase2.weight_decay", phase2.weight_decay)
    positive_number("init.phase2.grad_clip", phase2.grad_clip)


def init_phases(cfg) -> list[str]:
    return list(cfg.init.get("phases") or [])


def check_calibration(cfg) -> None:
    cal = cfg.calibration
    for key in ("batch_size", "block_size"):
        positive_int(f"calibration.{key}", cal[key])
    window_length("calibration.seq_len", cal.seq_len)
    if "phase2" in init_phases(cfg):
        positive_int("calibration.phase2.steps", cal.phase2.steps)
        for key in ("lr_projections", "lr_dynamics"):
            positive_number(f"calibration.phase2.{key}", cal.phase2[key], "a learning rate > 0")
        positive_number("calibration.phase2.grad_clip", cal.phase2.grad_clip)
        non_negative("calibration.phase2.weight_decay", cal.phase2.weight_decay)
    p1 = cal.phase1
    for low, high in (("gamma_min", "gamma_max"), ("sigma_min", "sigma_max")):
        positive_number(f"calibration.phase1.{low}", p1[low])
        if not (isinstance(p1[high], (int, float)) and p1[high] >= p1[low]):
            raise ConfigError(f"calibration.phase1.{high}={p1[high]!r}; expected a number >= "
                              f"calibration.phase1.{low}={p1[low]}")
    top = p1.beta_low + p1.beta_span if isinstance(p1.beta_span, (int, float)) else None
    in_range("calibration.phase1.beta_low", p1.beta_low, 1e-9, 1.0, "a write-gate target in (0, 1)")
    if top is None or not 0.0 < top < 1.0:
        raise ConfigError(f"calibration.phase1.beta_span={p1.beta_span!r}; expected beta_low + beta_span in (0, 1)")


def check_retention(cfg, num_layers: int | None) -> None:
    ret = cfg.retention
    one_of("retention.name", ret.name, POLICIES.names())
    if ret.name == "explicit":
        keep = None if OmegaConf.is_missing(ret, "keep") else ret.keep
        if keep is None:
            raise ConfigError(f"retention.keep={keep!r}; expected a list of layer indices, e.g. retention.keep=[0,2]")
        bad = [i for i in keep if i < 0]
        if bad:
            raise ConfigError(f"retention.keep={list(keep)} holds {bad}, not layer indices; expected whole numbers "
                              f">= 0, e.g. retention.keep=[0,2]")
        with as_config_error():
            validate_keep_layers(list(keep), num_layers if num_layers is not None else 1 << 30)
        return
    with as_config_error():
        num_kept(ret.ratio, num_layers or 1)
    if ret.name in SCORED:
        for key in ("num_windows", "batch_size"):
            positive_int(f"retention.{key}", ret[key])
        window_length("retention.seq_len", ret.seq_len)
    if ret.name == "recall":
        check_recall(ret, num_layers)


def check_recall(ret, num_layers: int | None) -> None:
    """The probe of `retention=recall`: its size, its kind, and how the kept layers are split between the score and
    the fill."""
    from tcal.retention.recall import FILLS, MIN_SEQ_LEN, PROBES

    for key in ("num_prompts", "batch_size"):
        positive_int(f"retention.{key}", ret[key])
    if not isinstance(ret.seq_len, int) or isinstance(ret.seq_len, bool) or ret.seq_len < MIN_SEQ_LEN:
        raise ConfigError(f"retention.seq_len={ret.seq_len!r}; expected an integer >= {MIN_SEQ_LEN} (a probe "
                          f"sequence holds needles, a question and an answer besides its text)")
    if not isinstance(ret.probe_seed, int) or isinstance(ret.probe_seed, bool) or ret.probe_seed < 0:
        raise ConfigError(f"retention.probe_seed={ret.probe_seed!r}; expected an integer >= 0")
    one_of("retention.probe", ret.probe, PROBES)
    one_of("retention.fill", ret.fill, FILLS)
    scored = ret.get("scored")
    if scored is not None:
        if not isinstance(scored, int) or isinstance(scored, bool) or scored < 0:
            raise ConfigError(f"retention.scored={scored!r}; expected null (every kept layer chosen by the score) or "
                              f"an integer >= 0")
        if num_layers is not None and scored > num_kept(ret.ratio, num_layers):
            raise ConfigError(f"retention.scored={scored} is more than the {num_kept(ret.ratio, num_layers)} layers "
                              f"retention.ratio={ret.ratio} keeps of {num_layers}")


def check_data(cfg) -> None:
    data = cfg.data
    one_of("data.source", data.source, sorted(SOURCES))
    for key in ("calibration_docs", "evaluation_docs"):
        positive_int(f"data.{key}", data[key])
    mix = data.get("retrieval_mix", 0.0)
    in_range("data.retrieval_mix", mix, 0.0, 1.0, "a fraction in [0, 1) of training samples (0: no retrieval mix)")
    if mix > 0:
        from tcal.retention.recall import MIN_SEQ_LEN

        for _, node, prefix in stages_of(cfg.stage):
            if isinstance(node.seq_len, int) and node.seq_len < MIN_SEQ_LEN:
                raise ConfigError(f"{prefix}.seq_len={node.seq_len} is too short for data.retrieval_mix={mix}; "
                                  f"expected at least {MIN_SEQ_LEN} tokens (a retrieval sequence holds needles, a "
                                  f"question and an answer besides its text)")
    if data.source == "datasets":
        check_dataset_reachable(data)
    if data.source == "files":
        if not data.get("files"):
            raise ConfigError("data.files=[]; data.source=files needs at least one .txt or .jsonl file")
        for path in data.files:
            existing_file("data.files", path)
    stems = [data.name]
    for path in data.get("eval_files") or []:
        existing_file("data.eval_files", path)
        stems.append(Path(path).stem)
    repeated = sorted({s for s in stems if stems.count(s) > 1})
    if repeated:
        raise ConfigError(f"data.eval_files: eval set name {repeated[0]!r} is used twice (eval sets are named by "
                          f"file stem; the held-out split is {data.name!r})")


def existing_file(key: str, path) -> None:
    if not Path(str(path)).expanduser().is_file():
        raise ConfigError(f"{key}: {str(path)!r} does not exist (or is not a file); expected an existing .txt or "
                          f".jsonl file")


def check_eval(cfg) -> None:
    ev = cfg.eval
    for key in ("num_windows", "batch_size"):
        positive_int(f"eval.{key}", ev[key])
    window_length("eval.seq_len", ev.seq_len)
    one_of("eval.harness.name", ev.harness.name, HARNESSES)
    one_of("eval.ruler.name", ev.ruler.name, RULERS)
    if ev.ruler.name != "none":
        check_ruler(ev.ruler)
    buckets = ev.get("position_buckets")
    if buckets is not None:
        starts = list(buckets) if isinstance(buckets, (list, ListConfig)) else None
        ok = (isinstance(starts, list) and starts and starts[0] == 0
              and all(isinstance(s, int) and not isinstance(s, bool) for s in starts)
              and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < ev.seq_len)
        if not ok:
            raise ConfigError(f"eval.position_buckets={buckets}; expected null or increasing integers from 0, each "
                              f"below eval.seq_len={ev.seq_len} (the first position of each bucket)")


def check_ruler(ruler) -> None:
    if not ruler.lengths or not ruler.tasks:
        raise ConfigError(f"eval.ruler.lengths={list(ruler.lengths)}, eval.ruler.tasks={list(ruler.tasks)}; expected "
                          f"at least one of each (or eval/ruler=none)")
    for length in ruler.lengths:
        positive_int("eval.ruler.lengths entry", length)
    for task in ruler.tasks:
        one_of("eval.ruler.tasks entry", task, RULER_TASKS)
    positive_int("eval.ruler.n", ruler.n)


def check_stages(cfg) -> None:
    """Budgets, schedules and learning rates of every stage of `cfg.stage`."""
    for kind, node, prefix in stages_of(cfg.stage):
        one_of(f"{prefix}.kind", kind, sorted(STAGES))
        for key in BUDGET_KEYS:
            positive_int(f"{prefix}.{key}", node.get(key))
        window_length(f"{prefix}.seq_len", node.seq_len)
        if node.eval_every_tokens > node.max_tokens:
            raise ConfigError(f"{prefix}.eval_every_tokens={node.eval_every_tokens} is larger than "
                              f"{prefix}.max_tokens={node.max_tokens}")
        devices = world_size(cfg.trainer)
        tokens_per_step = node.batch_size * node.seq_len * devices
        if node.max_tokens < tokens_per_step:
            raise ConfigError(f"{prefix}.max_tokens={node.max_tokens} is less than one step of {tokens_per_step} "
                              f"tokens ({prefix}.batch_size x {prefix}.seq_len x {devices} devices)")
        for key in ("lr", "lr_mixer", "lr_rest"):
            if key in node:
                positive_number(f"{prefix}.{key}", node[key], "a learning rate > 0")
        one_of(f"{prefix}.schedule", node.schedule, SCHEDULES)
        if "min_lr_ratio" in node:
            fraction(f"{prefix}.min_lr_ratio", node.min_lr_ratio, "a number in [0, 1] (the floor of the cosine "
                                                                  "schedule, as a fraction of the learning rate)")
        non_negative(f"{prefix}.weight_decay", node.weight_decay)
        if "ce_weight" in node:
            non_negative(f"{prefix}.ce_weight", node.ce_weight)
        betas = list(node.betas)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"{prefix}.betas={betas}; expected two numbers in [0, 1)")
        positive_number(f"{prefix}.grad_clip", node.grad_clip)
        if "kl_chunk_size" in node:
            positive_int(f"{prefix}.kl_chunk_size", node.kl_chunk_size)
        if node.get("teacher_dtype") is not None:
            one_of(f"{prefix}.teacher_dtype", node.teacher_dtype, sorted(DTYPES))


def check_strategy(strategy: str) -> None:
    """A strategy this project does not run is refused by `tcal` and `tcal-plan` alike (the plan models only one
    device, DDP and FSDP)."""
    if strategy.startswith("deepspeed"):
        raise ConfigError(f"trainer.strategy={strategy!r}: DeepSpeed is not supported (its resume and export were "
                          f"never tested; docs/scale.md); expected trainer=fsdp for sharded training")


def check_trainer(cfg) -> None:
    trainer = cfg.trainer
    accelerator, strategy = str(trainer.accelerator), str(trainer.get("strategy", "auto"))
    one_of("trainer.accelerator", accelerator, ACCELERATORS)
    precision = str(trainer.precision)
    one_of("trainer.precision", precision, PRECISIONS)
    check_strategy(strategy)
    gpus = torch.cuda.device_count()
    wants_gpu = accelerator in ("gpu", "cuda")
    if wants_gpu and gpus == 0:
        raise ConfigError(f"trainer.accelerator={accelerator!r} (strategy {strategy!r}) needs a GPU, but no GPU is "
                          f"visible here (torch.cuda.device_count() == 0); expected trainer=cpu on this machine")
    devices = trainer.get("devices", 1)
    check_devices(devices)
    positive_int("trainer.num_nodes", trainer.get("num_nodes", 1))
    if wants_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(f"trainer.devices={devices}; only {gpus} GPUs are visible")
    if accelerator == "cpu" and precision in ("16-mixed", "16"):
        raise ConfigError(f"trainer.precision={precision!r} is not supported on the CPU; expected 32-true, "
                          f"bf16-mixed or bf16-true")
    if wants_gpu and "bf16" in precision and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"trainer.precision={precision!r}: this GPU has no bfloat16; expected 16-mixed or 32-true")


def check_devices(devices) -> None:
    """What Lightning takes for `devices`: a count >= 1, -1 or "auto" (all), or a non-empty list of device ids."""
    if isinstance(devices, str) and devices.strip() in ("auto", "-1"):
        return
    if isinstance(devices, str):
        parts = [p.strip() for p in devices.split(",") if p.strip()]
        ids = [int(p) for p in parts if p.isdigit()]
        ok = len(ids) == len(parts) > 0 and (len(ids) > 1 or devices.strip().endswith(",") or ids[0] >= 1)
    elif isinstance(devices, (list, tuple, ListConfig)):
        ids = list(devices)
        ok = bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) \
            and len(set(ids)) == len(ids)
    else:
        ok = isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or devices == -1)
    if not ok:
        raise ConfigError(f"trainer.devices={devices!r}; expected a number of devices >= 1, -1 or auto (every "
                          f"device), or a non-empty list of device ids such as [0,1]")


def check_teacher(cfg) -> None:
    teacher = cfg.teacher
    one_of("teacher.dtype", teacher.dtype, sorted(DTYPES))
    if not any(teacher.get(k) for k in ("path", "gguf_file", "config")):
        raise ConfigError(f"teacher {teacher.name!r} names no weights; expected one of teacher.path (a local model "
                          f"folder or hub id), teacher.gguf_file, teacher.config")
    check_architecture(teacher)
    if teacher.get("path"):
        check_pretrained_path("teacher.path", str(teacher.path), model=True)
    tokenizer = teacher.get("tokenizer")
    if tokenizer is not None and tokenizer.get("path"):
        check_pretrained_path("teacher.tokenizer.path", str(tokenizer.path), model=False)


ARCHITECTURE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_architecture(teacher) -> None:
    """`teacher.architecture` (a published config.json, no weights) names a supported family and its sizes."""
    arch = teacher.get("architecture")
    if arch is None:
        return
    if not OmegaConf.is_dict(arch):
        raise ConfigError(f"teacher.architecture={arch!r}; expected the keys of the teacher's config.json")
    one_of("teacher.architecture.model_type", arch.get("model_type"), sorted(ADAPTERS))
    for key in ARCHITECTURE_SIZES:
        positive_int(f"teacher.architecture.{key}", arch.get(key))


def check_pretrained_path(key: str, path: str, model: bool) -> None:
    """A local folder (a model folder holds config.json), or a hub id that is reachable or already cached."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        if model and not (folder / "config.json").is_file():
            raise ConfigError(f"{key}={path!r} is not a model folder (no config.json); expected a folder written by "
                              f"save_pretrained, or a hub id")
        return
    if folder.exists() or looks_local(path):
        raise ConfigError(f"{key}={path!r}: no such local folder; expected a model folder or a hub id (org/name)")
    if hub_offline() and not hub_model_cached(path):
        raise ConfigError(f"{key}={path!r} is a hub id, but HF_HUB_OFFLINE is set and it is not in the local hub "
                          f"cache; pass a local path: {key}=/local/folder")


def check_logger(cfg) -> None:
    one_of("logger.name", cfg.logger.name, LOGGERS)


def check_paths(cfg) -> None:
    """The cache folder is a folder this user can write (found now, not after calibration work started)."""
    key, value = "paths.cache_dir", str(cfg.paths.cache_dir)
    folder = Path(value).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{key}={value!r} is a file; expected a folder (or a path where one can be made)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"{key}={value!r} cannot be written ({err.strerror or err}); expected a folder this user "
                          f"can write") from None


SEED_LIMIT = 2 ** 64  # torch.manual_seed's range; the seeds derived from it are folded into it (tcal.config)


def check_seed(cfg) -> None:
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < SEED_LIMIT:
        raise ConfigError(f"seed={cfg.seed!r}; expected an integer in [0, 2**64)")


# ------------------------------------------------------------------------------------------------ teacher shape


def configured_shape(cfg) -> tuple[int | None, int | None]:
    """(layers, context) of the teacher when known without loading it: a local folder's config.json, the shipped
    `architecture` of a paper teacher, or a config teacher. (None, None) otherwise (GGUF, a hub id without an
    architecture): checked after loading instead."""
    teacher = cfg.teacher
    config_file = Path(str(teacher.path)).expanduser() / "config.json" if teacher.get("path") else None
    if config_file is not None and config_file.is_file():
        config = json.loads(config_file.read_text())
    else:
        config = dict(teacher.get("architecture") or teacher.get("config") or {})
    return config.get("num_hidden_layers"), config.get("max_position_embeddings")


def check_fit(lengths: list[tuple[str, int]], context: int | None) -> None:
    """Each (key, length) fits a teacher context of `context` tokens (None: unknown, not checked)."""
    for key, value in lengths if context is not None else []:
        if value > context:
            raise ConfigError(f"{key}={value} is beyond the teacher's context of {context} tokens")


def eval_lengths(cfg) -> list[tuple[str, int]]:
    """The sequence lengths an evaluation of `cfg.eval` feeds the teacher."""
    lengths = [("eval.seq_len", cfg.eval.seq_len)]
    if cfg.eval.ruler.name != "none":
        lengths.append(("eval.ruler.lengths", max(cfg.eval.ruler.lengths)))
    return lengths


def check_lengths(cfg, context: int | None) -> None:
    """Every sequence the run feeds the teacher fits its context."""
    if context is None:
        return
    lengths = [("eval.seq_len", cfg.eval.seq_len)]
    if init_phases(cfg) or cfg.init.name == "full_plus":
        lengths.append(("calibration.seq_len", cfg.calibration.seq_len))
    if cfg.retention.name in SCORED or cfg.retention.name == "recall":
        lengths.append(("retention.seq_len", cfg.retention.seq_len))
    lengths += [(f"{prefix}.seq_len", node.seq_len) for _, node, prefix in stages_of(cfg.stage)]
    if cfg.eval.ruler.name != "none":
        lengths.append(("eval.ruler.lengths", max(cfg.eval.ruler.lengths)))
    for key, value in lengths:
        if value > context:
            raise ConfigError(f"{key}={value} is beyond the teacher's context of {context} tokens")


def check_teacher_shape(cfg, num_layers: int | None, context: int | None) -> None:
    if num_layers is not None:
        check_retention(cfg, num_layers)
        check_layers_to_align(cfg, num_layers)
    check_lengths(cfg, context)


def check_layers_to_align(cfg, num_layers: int) -> None:
    """Stage 1 trains the converted layers: a keep list holding every layer leaves it nothing to align."""
    if "align" not in [kind for kind, _, _ in stages_of(cfg.stage)]:
        return
    ret = cfg.retention
    kept = len(set(ret.keep)) if ret.name == "explicit" else num_kept(ret.ratio, num_layers)
    if kept >= num_layers:
        what = f"retention.keep={list(ret.keep)}" if ret.name == "explicit" else f"retention.ratio={ret.ratio}"
        raise ConfigError(f"stage={cfg.stage.name}: Stage 1 aligns the converted layers, but {what} keeps all "
                          f"{num_layers} layers of the teacher; expected a keep list that converts at least one layer, "
                          f"or stage=distill")


# ------------------------------------------------------------------------------------------------ entries


def validate_config(cfg) -> None:
    """Everything checkable before the teacher loads; raises ConfigError."""
    for check in (check_known_keys, check_seed, check_teacher, check_trainer, check_init, check_calibration, check_data,
                  check_eval, check_stages, check_logger):
        check(cfg)
    check_retention(cfg, None)
    check_teacher_shape(cfg, *configured_shape(cfg))
    check_paths(cfg)  # last: it makes the cache folder


def validate_plan(cfg) -> None:
    """What `tcal-plan` needs of a config, none of it about this machine (a plan is made for another one): the
    settings, budgets and lengths, and the teacher's shape; no GPU, data or hub checks."""
    one_of("teacher.dtype", cfg.teacher.dtype, sorted(DTYPES))
    check_architecture(cfg.teacher)
    one_of("trainer.accelerator", str(cfg.trainer.accelerator), ACCELERATORS)
    one_of("trainer.precision", str(cfg.trainer.precision), PRECISIONS)
    check_strategy(str(cfg.trainer.get("strategy", "auto")))
    for check in (check_seed, check_init, check_calibration, check_stages):
        check(cfg)
    check_retention(cfg, None)
    check_teacher_shape(cfg, *configured_shape(cfg))


def validate_loaded(ctx) -> None:
    """What needs the loaded teacher and documents (`ctx`: a `RunContext`); still before anything is written."""
    cfg, config = OmegaConf.structured(ctx.settings), ctx.teacher.config
    check_teacher_shape(cfg, config.num_hidden_layers, getattr(config, "max_position_embeddings", None))
    check_split_tokens(ctx, cfg)
    check_ruler_room(ctx, cfg)
    check_recall_room(ctx, cfg)


def check_recall_room(ctx, cfg) -> None:
    """The probe sequences of `retention=recall` can be cut from the calibration split (they are built now, as the
    policy will build them: a few thousand tokens), so a short split or sequence fails before any work."""
    ret = cfg.retention
    if ret.name != "recall" or num_kept(ret.ratio, ctx.num_layers) == ctx.num_layers:
        return
    from tcal.retention.recall import probe_sequences

    try:
        probe_sequences(ret, ctx)
    except ValueError as err:
        raise ConfigError(f"retention.seq_len={ret.seq_len}: {err}") from None


def check_ruler_room(ctx, cfg) -> None:
    """The shortest RULER length leaves room for haystack text beside each task's needles and question (the
    examples are built as the evaluation will build them), so a short length fails now, not after the init."""
    ruler = cfg.eval.ruler
    if ruler.name == "none":
        return
    docs, shortest = [d.text for d in ctx.splits.evaluation], min(ruler.lengths)
    for task in ruler.tasks:
        try:
            make_ruler_examples(docs, ctx.tokenizer, shortest, task, ruler.n, ruler.seed)
        except ValueError as err:
            raise ConfigError(f"eval.ruler.lengths={list(ruler.lengths)}: {err}; raise the shortest length or "
                              f"drop the task from eval.ruler.tasks") from None


def check_split_tokens(ctx, cfg) -> None:
    """Each split holds the tokens its windows need: calibration batch (and its held-out check windows),
    scoring windows, evaluation windows per eval set (a short eval file is named)."""
    from tcal.data import eval_sets

    needs = []  # (what, tokens needed, documents)
    cal = cfg.calibration
    if init_phases(cfg):
        windows = 2 * cal.batch_size - 1 if cal.check and cal.batch_size > 1 else cal.batch_size
        needs.append((f"calibration.batch_size={cal.batch_size} windows of calibration.seq_len={cal.seq_len}"
                      + (" (with calibration.check=true, the unseen windows between them too)" if cal.check else ""),
                      windows * cal.seq_len, ctx.splits.calibration, "the calibration split"))
    if cfg.init.name == "full_plus":
        pool = cfg.init.pool
        needs.append((f"init.pool.tokens={pool.tokens} (windows of calibration.seq_len={cal.seq_len})",
                      pool.tokens, ctx.splits.calibration, "the calibration split"))
    ret = cfg.retention
    if ret.name in SCORED and num_kept(ret.ratio, ctx.num_layers) < ctx.num_layers:
        needs.append((f"retention.num_windows={ret.num_windows} windows of retention.seq_len={ret.seq_len}",
                      ret.num_windows * ret.seq_len, ctx.splits.calibration, "the calibration split"))
    files = {Path(p).stem: str(p) for p in cfg.data.get("eval_files") or []}
    for name, docs in eval_sets(ctx.settings.data, ctx.splits).items():
        source = f"data.eval_files entry {files[name]!r}" if name in files else "the evaluation split"
        needs.append((f"eval.num_windows={cfg.eval.num_windows} windows of eval.seq_len={cfg.eval.seq_len}",
                      cfg.eval.num_windows * cfg.eval.seq_len, docs, source))
    for what, need, docs, source in needs:
        have = token_stream(docs, ctx.tokenizer).numel()
        if have < need:
            raise ConfigError(f"{what} need {need} tokens, but {source} has {have}; lower them or give more text")
