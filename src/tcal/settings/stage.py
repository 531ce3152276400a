"""`stage`: training after the init (conf/stage/; the stages: tcal.training). Budgets are tokens: a stage runs
max_tokens // (batch_size x seq_len x ranks) optimizer steps (`TrainingStageSettings.steps`, the one place that
formula lives) and evaluates every eval_every_tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from tcal.registry import STAGE_KINDS
from tcal.settings.fields import (
    NOTHING,
    REQUIRED,
    TRAIN,
    Key,
    SettingError,
    Settings,
    between,
    declared,
    distinct,
    is_number,
    learning_rate,
    non_negative,
    one_of,
    optional,
    positive_int,
    positive_number,
    setting,
    window_length,
)
from tcal.settings.schedule import SCHEDULES
from tcal.settings.teacher import DTYPES


@declared
@dataclass
class StageSettings(Settings):
    """`stage=none`: no training."""

    schema = "stage/none"

    name: str = setting("none", affects=[TRAIN])

    def stages(self) -> list[tuple[str, TrainingStageSettings]]:
        """[(key of its settings in the config, its settings)] of the stages this setting runs, in order."""
        return []

    def label(self) -> str:
        """What the run's record calls it: the option's name, or the stages a sequence runs (`align_distill`)."""
        return self.name


@dataclass(frozen=True)
class StageSteps:
    """A stage's budget in optimizer steps for a number of ranks."""

    tokens_per_step: int  # batch_size x seq_len x ranks
    total: int
    eval_every: int


def adam_betas(key: str, betas) -> None:
    if len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
        raise SettingError(Key(key), f"={list(betas)}; expected two numbers in [0, 1)")


@declared
@dataclass
class TrainingStageSettings(StageSettings):
    """What both training stages share: a token budget, batches of `batch_size` x `seq_len` per rank, AdamW."""

    kind: str = setting(REQUIRED, affects=[TRAIN], check=one_of(STAGE_KINDS.names))
    # budget in tokens (summed over all ranks)
    max_tokens: int = setting(100000, affects=[TRAIN], check=positive_int)
    eval_every_tokens: int = setting(10000, affects=[TRAIN], check=positive_int)  # where the curve's points are
    batch_size: int = setting(4, affects=[TRAIN], check=positive_int)  # sequences per step and rank
    seq_len: int = setting(512, affects=[TRAIN], check=window_length)
    schedule: str = setting("constant", affects=[TRAIN], check=one_of(SCHEDULES))  # constant | cosine
    min_lr_ratio: float = setting(0.0, affects=[TRAIN], check=between(0.0, 1.0, (
        "a number in [0, 1] (the floor of the cosine schedule, as a fraction of the learning rate)")))
    betas: List[float] = setting(affects=[TRAIN], factory=lambda: [0.9, 0.95], check=adam_betas)
    weight_decay: float = setting(0.0, affects=[TRAIN], check=non_negative)
    grad_clip: float = setting(1.0, affects=[TRAIN], check=positive_number)
    # torch's fused AdamW kernel (CPU and CUDA): about 10x faster optimizer steps on CPU
    fused_optimizer: bool = setting(True, affects=[TRAIN])
    # recompute each GDN mixer in backward: ~170 MB less per layer at 4 x 512
    checkpoint_mixers: bool = setting(False, affects=[TRAIN])
    # recompute whole decoder layers: least memory, about a third more compute
    activation_checkpointing: bool = setting(False, affects=[TRAIN])
    cache_tokens: bool = setting(True, affects=NOTHING)  # keep the tokenized training stream under the cache folder

    def check(self) -> None:
        if self.eval_every_tokens > self.max_tokens:
            raise SettingError(Key("eval_every_tokens"), f"={self.eval_every_tokens} is larger than ",
                               Key("max_tokens"), f"={self.max_tokens}")

    def stages(self) -> list[tuple[str, TrainingStageSettings]]:
        return [("stage", self)]

    def steps(self, ranks: int) -> StageSteps:
        """Optimizer steps of this budget with `ranks` processes (each reading its own batches)."""
        tokens_per_step = self.batch_size * self.seq_len * ranks
        return StageSteps(tokens_per_step, self.max_tokens // tokens_per_step,
                          max(round(self.eval_every_tokens / tokens_per_step), 1))

    # What a step of this stage holds, trains, runs and costs, as `tcal-plan` counts it (tcal.tools.plan asks these,
    # never the kind, so a new kind brings its own). Plain names: the settings import no torch.
    trains = "student"  # what holds gradients and optimizer state: "student" (every parameter) or "mixers" (GDN)
    runs = "decoder"  # what a step runs: "decoder" (the student on the batch) or "mixers" (each GDN mixer alone)

    def checkpointing(self) -> str:
        """What a step recomputes: activation_checkpointing (whole decoder layers), checkpoint_mixers or none."""
        if self.activation_checkpointing:
            return "activation_checkpointing"
        return "checkpoint_mixers" if self.checkpoint_mixers else "none"

    def stage_teacher_dtype(self, teacher_dtype: str) -> str:
        """The dtype the frozen teacher runs in during this stage, `teacher.dtype` unless the stage sets its own."""
        return teacher_dtype

    def logit_kl_chunk(self) -> Optional[int]:
        """Tokens per chunk of the fused KL on the logits (which runs the teacher's head too); None: no such loss."""
        return None


@declared
@dataclass
class AlignSettings(TrainingStageSettings):
    """Stage 1: every GDN layer matches the teacher attention output; only GDN parameters train."""

    schema = "stage/align"
    trains = runs = "mixers"  # the GDN mixers alone, on the inputs and attention outputs captured from the teacher

    name: str = setting("align", affects=[TRAIN])
    kind: str = setting("align", affects=[TRAIN])
    # perplexity curve and checkpoint interval; also at token 0 and at the end
    eval_every_tokens: int = setting(20000, affects=[TRAIN])
    lr: float = setting(1.0e-3, affects=[TRAIN], check=learning_rate)
    schedule: str = setting("cosine", affects=[TRAIN])  # constant | cosine (to min_lr_ratio * lr at max_tokens)
    weight_decay: float = setting(0.01, affects=[TRAIN])
    cache: bool = setting(True, affects=NOTHING)  # keep the result in the Stage 1 cache

    def checkpointing(self) -> str:
        """activation_checkpointing does not apply: the student's decoder does not run."""
        return "checkpoint_mixers" if self.checkpoint_mixers else "none"


@declared
@dataclass
class DistillSettings(TrainingStageSettings):
    """Stage 2: forward KL(teacher || student) on the logits; every student parameter trains."""

    schema = "stage/distill"

    name: str = setting("distill", affects=[TRAIN])
    kind: str = setting("distill", affects=[TRAIN])
    lr_mixer: float = setting(1.0e-4, affects=[TRAIN], check=learning_rate)  # the GDN mixers
    # every other student parameter (embeddings, MLPs, norms, kept attention, head)
    lr_rest: float = setting(7.0e-6, affects=[TRAIN], check=learning_rate)
    # recompute each GDN mixer in backward: ~170 MB less per layer at 4 x 512
    checkpoint_mixers: bool = setting(True, affects=[TRAIN])
    # tokens per chunk of the KL: memory grows with this, not with the batch
    kl_chunk_size: int = setting(256, affects=[TRAIN], check=positive_int)
    ce_weight: float = setting(0.0, affects=[TRAIN], check=non_negative)  # + ce_weight * next-token cross-entropy
    # e.g. bfloat16: the frozen teacher runs in that dtype during this stage
    teacher_dtype: Optional[str] = setting(None, affects=[TRAIN], check=optional(one_of(sorted(DTYPES))))

    def stage_teacher_dtype(self, teacher_dtype: str) -> str:
        return self.teacher_dtype or teacher_dtype

    def logit_kl_chunk(self) -> Optional[int]:
        return self.kl_chunk_size


@declared
@dataclass
class StageSequenceSettings(StageSettings):
    """Stages run one after the other (`stage=align_distill`, `stage=paper`), each with its own settings;
    `sequence: [align]` runs Stage 1 of these settings alone."""

    schema = "stage/sequence"

    name: str = setting("align_distill", affects=[TRAIN])
    sequence: List[str] = setting(affects=[TRAIN], factory=lambda: ["align", "distill"],
                                  check=distinct(STAGE_KINDS.names))
    align: AlignSettings = setting(affects=[TRAIN], factory=AlignSettings)
    distill: DistillSettings = setting(affects=[TRAIN], factory=DistillSettings)

    def stages(self) -> list[tuple[str, TrainingStageSettings]]:
        return [(f"stage.{kind}", getattr(self, kind)) for kind in self.sequence]

    def label(self) -> str:
        return "_".join(self.sequence)


def stage_settings_class(node: dict) -> type:
    """The settings class of a `stage` mapping: none, one stage (by its `kind`), or a sequence."""
    if node.get("name") == "none":
        return StageSettings
    if "sequence" in node:
        return StageSequenceSettings
    kind = node.get("kind")
    return STAGE_KINDS[kind].settings if kind in STAGE_KINDS else TrainingStageSettings

