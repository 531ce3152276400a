"""What a run needs of this machine, its files, the hub and the teacher, checked once before any work, with a
`ConfigError` naming the key. The settings' own values are checked when they are built (`tcal.settings`); these
are the checks a value cannot make alone. Which of them a run makes follows from its steps (`STEP_NEEDS`), so `tcal`
(every step) and each step of the Python API make them from one table, through `tcal.run.Run.build`:

- `check_steps(settings, steps, on_cuda)`, on every road: the trainer on this machine, the GDN kernel for its GPU
  stack (chosen here, for this run), the stages' budgets, the paper tasks.
- `check_machine(settings, steps)`, before `tcal` loads the teacher and documents: the above, then the cache folder,
  data and teacher files, the hub, the teacher's family and, when its config is known without loading it, its
  layers and context.
- `check_loaded(ctx, steps)`, once the teacher and the documents are in memory and before anything is written: the
  teacher's layers and context (those not checked before), its vocabulary, and whether each split holds the tokens
  the steps' windows need.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tcal.errors import ConfigError
from tcal.runtime.processes import usable_cpus
from tcal.settings import RunSettings, SettingError


def calibration_length(settings: RunSettings) -> list[tuple[str, int]]:
    return [("calibration.seq_len", settings.calibration.seq_len)] if settings.calibrates() else []


@dataclass(frozen=True)
class StepNeeds:
    """What one step of a run reads, and so what is checked before the run starts."""

    splits: tuple[str, ...] = ()  # the windows it cuts from the splits (`check_split_tokens`): init, retention, eval
    lengths: Callable[[RunSettings], list] = lambda settings: []  # (key, length) of what it feeds the teacher
    selects: bool = False  # it chooses the kept layers: the keep list fits the teacher, recall's probes
    trains: bool = False  # it trains the stages: their budgets
    evaluates: bool = False  # it evaluates: the paper tasks, RULER's and the harness's room


STEP_NEEDS = {
    "select": StepNeeds(("retention",), lambda s: [*s.retention.teacher_lengths(), *(
        calibration_length(s) if s.retention.initializes_layers() else [])], selects=True),
    "build": StepNeeds(),
    "initialize": StepNeeds(("init",), calibration_length),
    "train": StepNeeds(("eval",), lambda s: [*((f"{key}.seq_len", stage.seq_len) for key, stage in s.stage.stages()),
                                             *s.eval.lengths()], trains=True),
    "evaluate": StepNeeds(("eval",), lambda s: s.eval.lengths(), evaluates=True),
    "save": StepNeeds(),
}
STEPS = tuple(STEP_NEEDS)  # `tcal`'s run: every step, in order


def check_steps(settings: RunSettings, steps=STEPS, on_cuda: bool = False) -> str:
    """What the steps need of this machine, on every road; returns the GDN kernel chosen for the run (`on_cuda`:
    its teacher is already on a GPU)."""
    check_chosen_options(settings)
    check_trainer(settings.trainer)
    kernel = choose_gdn_kernel(settings.trainer, on_cuda)
    if any(STEP_NEEDS[step].trains for step in steps):
        check_budgets(settings)
    if any(STEP_NEEDS[step].evaluates for step in steps) and settings.eval.harness.name == "paper":
        from tcal.evaluate.local_tasks import check_paper_tasks_available

        check_paper_tasks_available()
    return kernel


def check_machine(settings: RunSettings, steps=STEPS) -> str:
    """Everything checkable before `tcal` loads the teacher and documents; returns the GDN kernel chosen."""
    kernel = check_steps(settings, steps)
    check_teacher(settings.teacher)
    check_data_files(settings)
    check_resources(settings)
    check_teacher_shape(settings, steps, *configured_shape(settings.teacher))
    check_cache_folder(settings.paths.cache_dir)  # last: it makes the cache folder
    return kernel


def check_plan(settings: RunSettings) -> None:
    """What `tcal-plan` needs of a config, none of it about this machine (a plan is made for another one)."""
    check_family(settings.teacher)
    check_teacher_shape(settings, STEPS, *configured_shape(settings.teacher))


def check_chosen_options(settings: RunSettings) -> None:
    """The options this run uses (init mode, retention policy, harness, RULER, stage kinds) resolve: a plugin's
    option declared at a dotted path that does not is refused in one line naming the plugin and the path
    (`tcal.registry.Option.check_resolves`), not when the option first runs, after the teacher loads."""
    from tcal.registry import HARNESSES, INIT_MODES, POLICIES, RULERS, STAGE_KINDS

    chosen = [(INIT_MODES, settings.init.name), (POLICIES, settings.retention.name),
              (HARNESSES, settings.eval.harness.name), (RULERS, settings.eval.ruler.name),
              *((STAGE_KINDS, stage.kind) for _, stage in settings.stage.stages())]
    for registry, name in chosen:
        registry[name].check_resolves()


# ------------------------------------------------------------------------------------------------ the machine


def check_trainer(trainer) -> None:
    gpus = torch.cuda.device_count()
    accelerator, strategy = str(trainer.accelerator), str(trainer.strategy)
    if trainer.wants_gpu and gpus == 0:
        raise ConfigError(f"trainer.accelerator={accelerator!r} (strategy {strategy!r}) needs a GPU, but no GPU is "
                          f"visible here (torch.cuda.device_count() == 0); expected trainer=cpu on this machine")
    if trainer.wants_gpu and isinstance(trainer.devices, int) and trainer.devices > gpus:
        raise ConfigError(f"trainer.devices={trainer.devices}; only {gpus} GPUs are visible")
    if trainer.wants_gpu and "bf16" in str(trainer.precision) and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"trainer.precision={trainer.precision!r}: this GPU has no bfloat16; expected 16-mixed or "
                          f"32-true")


def choose_gdn_kernel(trainer, on_cuda: bool = False) -> str:
    """The delta rule's kernel for a run (`trainer.gdn_kernel`: `fla` or `torch`), chosen against the machine's torch,
    Triton, fla and GPU: a stack on which fla computes wrong or refuses is refused now, in one line naming the fix,
    not at the first backward after calibration (docs/gpu.md, "The stack check")."""
    from tcal.student.stack import gdn_kernel_for

    on_cuda = on_cuda or trainer.wants_gpu or (str(trainer.accelerator) == "auto" and torch.cuda.is_available())
    return gdn_kernel_for(str(trainer.gdn_kernel), on_cuda)


MAX_STAGE_SAMPLES = 2**30


def check_budgets(settings: RunSettings) -> None:
    """Each stage's budget holds at least one optimizer step of all the run's ranks."""
    from tcal.runtime.distributed import world_size

    ranks = world_size(settings.trainer)
    for key, stage in settings.stage.stages():
        steps = stage.steps(ranks)
        if steps.total < 1:
            raise ConfigError(f"{key}.max_tokens={stage.max_tokens} is less than one step of {steps.tokens_per_step} "
                              f"tokens ({key}.batch_size x {key}.seq_len x {ranks} devices)")
        samples = steps.total * stage.batch_size * ranks
        if samples > MAX_STAGE_SAMPLES:
            raise ConfigError(f"{key}.max_tokens={stage.max_tokens}: {samples:,} samples of {key}.seq_len="
                              f"{stage.seq_len}; expected at most 2**30 samples a stage (the stage's reading is "
                              f"planned before work, an index a sample; 2**30 x 4,096 tokens is 4.4T tokens)")


def check_cache_folder(cache_dir: str) -> None:
    """The cache folder is a folder this user can write (found now, not after calibration work started)."""
    folder = Path(cache_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"paths.cache_dir={cache_dir!r} is a file; expected a folder (or a path where one can be "
                          f"made)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ConfigError(f"paths.cache_dir={cache_dir!r} cannot be written ({err.strerror or err}); expected a "
                          f"folder this user can write") from None


def check_data_files(settings: RunSettings) -> None:
    data = settings.data
    if data.source == "datasets":
        from tcal.data.documents import check_dataset_reachable

        check_dataset_reachable(data)
    for key, paths in (("data.files", data.files if data.source == "files" else []), ("data.eval_files",
                                                                                    data.eval_files)):
        for path in paths:
            if not Path(str(path)).expanduser().is_file():
                raise ConfigError(f"{key}: {str(path)!r} does not exist (or is not a file); expected an existing "
                                  f".txt or .jsonl file")


def check_resources(settings: RunSettings) -> None:
    """The processes and devices a run starts are ones this machine has: tokenizing workers (`data.workers`) and CPU
    ranks (`trainer.devices` with accelerator cpu) at most one per CPU this process may use, GPU ids among the
    visible GPUs. Beyond that a run would fork them all at once (thousands of processes) or fail in Lightning."""
    cpus, trainer = usable_cpus(), settings.trainer
    workers = settings.data.workers
    if workers is not None and workers > cpus:
        raise ConfigError(f"data.workers={workers}: more tokenizing processes than the {cpus} CPUs this process may "
                          f"use; expected at most {cpus}, or null (one per CPU); it changes nothing, a resume may set it")
    check_cpu_ranks(trainer)
    ids = trainer.devices if isinstance(trainer.devices, (list, tuple)) else (
        [int(p) for p in str(trainer.devices).split(",") if p.strip().isdigit()] if isinstance(trainer.devices, str)
        and "," in trainer.devices else [])
    gpus = torch.cuda.device_count()
    if trainer.wants_gpu and any(i >= gpus for i in ids):
        raise ConfigError(f"trainer.devices={list(ids)}: GPU ids from 0 to {gpus - 1} are visible here; expected ids "
                          f"among them")


def check_cpu_ranks(trainer) -> None:
    """CPU ranks (`trainer.devices` with accelerator cpu) at most one per CPU this process may use: checked before
    any work and again where the ranks are started (`tcal.cli.rank.run_ranks`)."""
    cpus = usable_cpus()
    if str(trainer.accelerator) == "cpu" and isinstance(trainer.devices, int) and trainer.devices > cpus:
        raise ConfigError(f"trainer.devices={trainer.devices} CPU processes with trainer.accelerator=cpu, more than the "
                          f"{cpus} CPUs this process may use; expected at most {cpus}")


def check_teacher(teacher) -> None:
    check_family(teacher)
    if teacher.path:
        check_pretrained_path("teacher.path", str(teacher.path), model=True)
    if teacher.tokenizer is not None and teacher.tokenizer.path:
        check_pretrained_path("teacher.tokenizer.path", str(teacher.tokenizer.path), model=False)


def check_family(teacher) -> None:
    """`teacher.architecture` and `teacher.config` name a family this project converts (a teacher of `path` says
    its family when its config.json is read, before any work: `check_loaded`)."""
    from tcal.registry import TEACHER_FAMILIES

    for key in ("architecture", "config"):
        node = getattr(teacher, key)
        if node is not None and node.get("model_type") not in TEACHER_FAMILIES:
            raise ConfigError(f"teacher.{key}.model_type={node.get('model_type')!r}; expected one of "
                              f"{', '.join(TEACHER_FAMILIES.names())}")


def check_pretrained_path(key: str, path: str, model: bool) -> None:
    """A local folder (a model folder holds config.json), or a hub id that is reachable or already cached."""
    from tcal.hub import hub_model_cached, hub_offline, looks_local

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


# ------------------------------------------------------------------------------------------------ the teacher


def configured_shape(teacher) -> tuple[int | None, int | None]:
    """(layers, context) of the teacher when known without loading it: a local folder's config.json, the shipped
    `architecture` of a paper teacher, or a config teacher. (None, None) otherwise (GGUF, a hub id without an
    architecture): checked after loading instead."""
    config_file = Path(str(teacher.path)).expanduser() / "config.json" if teacher.path else None
    config = json.loads(config_file.read_text()) if config_file is not None and config_file.is_file() else \
        teacher.shape()
    return config.get("num_hidden_layers"), config.get("max_position_embeddings")


def check_fit(lengths: list[tuple[str, int]], context: int | None) -> None:
    """Each (key, length) fits a teacher context of `context` tokens (None: unknown, not checked)."""
    for key, value in lengths if context is not None else []:
        if value > context:
            raise ConfigError(f"{key}={value} is beyond the teacher's context of {context} tokens")


def check_teacher_shape(settings: RunSettings, steps, num_layers: int | None, context: int | None) -> None:
    """The lengths the steps feed the teacher within its context, and a keep list that fits its layers (each when
    known)."""
    if num_layers is not None and any(STEP_NEEDS[step].selects for step in steps):
        check_keep_list(settings, num_layers)
    if context is not None:
        lengths = [length for step in steps for length in STEP_NEEDS[step].lengths(settings)]
        check_fit(list(dict.fromkeys(lengths)), context)


def check_keep_list(settings: RunSettings, num_layers: int) -> None:
    retention = settings.retention
    try:
        retention.check_keep(num_layers)
    except SettingError as err:
        raise err.placed("retention.") from None
    if "align" in [stage.kind for _, stage in settings.stage.stages()] and retention.kept(num_layers) >= num_layers:
        raise ConfigError(f"stage={settings.stage.name}: Stage 1 aligns the converted layers, but "
                          f"retention.{retention.keep_setting()} keeps all "
                          f"{num_layers} layers of the teacher; expected a keep list that converts at least one layer, "
                          f"or stage=distill")


# ------------------------------------------------------------------------------------------------ loaded


def check_loaded(ctx, steps=STEPS, checked: tuple = (None, None)) -> None:
    """What the steps need of the loaded teacher and documents (`ctx`: a `RunContext`); still before anything is
    written. Of the teacher's layers and context, those not `checked` before (or checked otherwise) are checked."""
    config = ctx.teacher.config
    loaded = (config.num_hidden_layers, getattr(config, "max_position_embeddings", None))
    check_teacher_shape(ctx.settings, steps, *(None if have == known else have for have, known in zip(loaded, checked)))
    if ctx.tokenizer is not None:  # a bare model (`api.build_student`) has none
        check_vocabulary(ctx)
    check_split_tokens(ctx, tuple(split for step in steps for split in STEP_NEEDS[step].splits))
    if any(STEP_NEEDS[step].evaluates for step in steps):
        check_ruler_room(ctx)
        check_harness_room(ctx)
    if any(STEP_NEEDS[step].selects for step in steps):
        check_recall_room(ctx)


def check_vocabulary(ctx) -> None:
    """Every id the tokenizer makes has a row in the teacher's embedding (a config teacher whose `vocab_size` is
    below its tokenizer's would index past it in the first forward)."""
    rows, ids = ctx.teacher.get_input_embeddings().num_embeddings, len(ctx.tokenizer)
    if ids > rows:
        key = "teacher.config.vocab_size" if ctx.settings.teacher.config else "teacher.path"
        raise ConfigError(f"{key}: the teacher's embedding has {rows} rows, fewer than its tokenizer's {ids} ids; "
                          f"expected a vocabulary of at least {ids} (or the teacher's own tokenizer)")


def check_harness_room(ctx) -> None:
    """The local harness's tasks can be cut from the evaluation split (built now as the evaluation will build them:
    a short split fails before any work, not after Stage 2)."""
    harness = ctx.settings.eval.harness
    if harness.name != "local":
        return
    from tcal.evaluate.local_tasks import task_records

    try:
        task_records([d.text for d in ctx.splits.evaluation], int(harness.seed), int(harness.n_examples))
    except ValueError as err:
        raise ConfigError(f"eval/harness=local: {err}; expected more held-out text (data.evaluation_docs), fewer "
                          f"eval.harness.n_examples, or eval/harness=none") from None


def check_recall_room(ctx) -> None:
    """The probe sequences of `retention=recall` can be cut from the calibration split (they are built now, as the
    policy will build them: a few thousand tokens), so a short split or sequence fails before any work."""
    retention = ctx.settings.retention
    probe = retention.needle_probe()
    if probe is None or retention.kept(ctx.num_layers) == ctx.num_layers:
        return
    from tcal.data.needles import probe_batch

    try:
        probe_batch(ctx.splits.calibration, ctx.tokenizer, *probe)
    except ValueError as err:
        raise ConfigError(f"retention.seq_len={probe[0]}: {err}") from None


def check_ruler_room(ctx, ruler=None) -> None:
    """The shortest RULER length leaves room for haystack text beside each task's needles and question (the
    examples are built as the evaluation will build them), so a short length fails now, not after the init."""
    from tcal.evaluate.ruler import make_ruler_examples

    ruler = ruler or ctx.settings.eval.ruler
    if ruler.name == "none":
        return
    docs = [d.text for d in ctx.splits.evaluation]
    for length, fix in ((min(ruler.lengths), "raise the shortest length or drop the task from eval.ruler.tasks"),
                        (max(ruler.lengths), "expected lengths the evaluation split can fill: more "
                                             "data.evaluation_docs, or shorter eval.ruler.lengths")):
        for task in ruler.tasks:
            try:
                make_ruler_examples(docs, ctx.tokenizer, length, task, ruler.n, ruler.seed)
            except ValueError as err:
                raise ConfigError(f"eval.ruler.lengths={list(ruler.lengths)}: {task} at length {length}: "
                                  f"{str(err).removeprefix(f'{task} at length {length}: ')}; {fix}") from None


def check_split_tokens(ctx, splits: tuple[str, ...] = ("init", "retention", "eval")) -> None:
    """Each split holds the tokens its windows need: calibration batch (and its held-out check windows),
    scoring windows, evaluation windows per eval set (a short eval file is named). `splits`: the windows the run's
    steps read (`StepNeeds.splits`); a policy that scores initialized layers reads the init's too."""
    from tcal.data.documents import eval_sets, token_stream

    settings = ctx.settings
    steps = (*splits, "init") if "retention" in splits and settings.retention.initializes_layers() else splits
    calibration_needs = settings.init.split_needs(settings.calibration) if "init" in steps else []
    if "retention" in steps and settings.retention.kept(ctx.num_layers) < ctx.num_layers:
        calibration_needs += settings.retention.split_needs()
    # (what, tokens needed, documents, where they come from)
    needs = [(what, tokens, ctx.splits.calibration, "the calibration split") for what, tokens in calibration_needs]
    files = {Path(p).stem: str(p) for p in settings.data.eval_files}
    ev = settings.eval
    for name, docs in eval_sets(settings.data, ctx.splits).items() if "eval" in steps else ():
        source = f"data.eval_files entry {files[name]!r}" if name in files else "the evaluation split"
        needs.append((f"eval.num_windows={ev.num_windows} windows of eval.seq_len={ev.seq_len}",
                      ev.num_windows * ev.seq_len, docs, source))
    for what, need, docs, source in needs:
        have = token_stream(docs, ctx.tokenizer).numel()
        if have < need:
            raise ConfigError(f"{what} need {need} tokens, but {source} has {have}; lower them or give more text")
