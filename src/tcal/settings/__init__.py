"""Typed settings: one closed dataclass per config group, each checking its own fields and declaring what they
change (`tcal.settings.fields`); `RunSettings` holds one run's. `tcal` converts its composed config into them once
(`tcal.settings.conversion.run_settings`); the library, the API and the tools read nothing else."""

from tcal.settings.data import DataSettings, HubDataSettings
from tcal.settings.evaluation import (
    EvalSettings,
    HarnessSettings,
    LocalHarnessSettings,
    NeedleRulerSettings,
    PaperHarnessSettings,
    RulerSettings,
)
from tcal.settings.fields import SettingError, derived_seed
from tcal.settings.init import (
    CalibratedInitSettings,
    CalibrationSettings,
    FullPlusSettings,
    GateInitSettings,
    InitSettings,
    Phase1Settings,
    Phase2Settings,
    PoolPhase2Settings,
    PoolSettings,
    init_settings,
)
from tcal.settings.retention import (
    ExplicitRetentionSettings,
    GaS2RetentionSettings,
    RecallRetentionSettings,
    RetentionSettings,
    ScoredRetentionSettings,
)
from tcal.settings.run import RunSettings
from tcal.settings.stage import (
    AlignSettings,
    DistillSettings,
    StageSequenceSettings,
    StageSettings,
    TrainingStageSettings,
)
from tcal.settings.teacher import TeacherSettings, TokenizerSettings, default_teacher, tiny_teacher
from tcal.settings.trainer import LoggerSettings, PathsSettings, TrainerSettings

__all__ = [name for name in dir() if name[0].isupper() or name in (
    "init_settings", "default_teacher", "tiny_teacher", "derived_seed")]
