"""`RunSettings`: everything one run reads, with `tcal`'s defaults (teacher smollm2_135m, uniform 0.5, init full),
and the checks that involve more than one group (keys named from the run's root)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Optional

from tcal.settings.data import DataSettings
from tcal.settings.evaluation import EvalSettings
from tcal.settings.fields import (
    EVERYTHING,
    INIT,
    NOTHING,
    TRAIN,
    Key,
    SettingError,
    Settings,
    bad,
    declared,
    seed_value,
    setting,
)
from tcal.settings.init import CalibratedInitSettings, CalibrationSettings, InitSettings
from tcal.settings.retention import MIN_PROBE_LEN, PolicySettings, RetentionSettings
from tcal.settings.stage import StageSequenceSettings, StageSettings
from tcal.settings.teacher import TeacherSettings, default_teacher
from tcal.settings.trainer import LoggerSettings, PathsSettings, TrainerSettings

GROUPS = ("teacher", "data", "retention", "init", "calibration", "stage", "eval", "trainer", "logger", "paths")


def folder_name(key: str, name) -> None:
    if not isinstance(name, str) or not name.strip() or set("/\\") & set(name) or name in (".", ".."):
        raise SettingError(Key(key), f"={name!r}; expected a name for the run's folder under paths.output_dir (no path "
                           f"separators)")


@declared
@dataclass
class RunSettings(Settings):
    """One run: a setting per config group, the seed, and where the run goes (`task_name` names its folder under
    paths.output_dir, `resume` a run folder to continue)."""

    teacher: TeacherSettings = setting(affects=EVERYTHING, factory=default_teacher)
    data: DataSettings = setting(affects=EVERYTHING, factory=DataSettings)
    retention: PolicySettings = setting(affects=EVERYTHING, factory=RetentionSettings)
    init: InitSettings = setting(affects=EVERYTHING, factory=CalibratedInitSettings)
    calibration: CalibrationSettings = setting(affects=EVERYTHING, factory=CalibrationSettings)
    stage: StageSettings | StageSequenceSettings = setting(affects=EVERYTHING, factory=StageSettings)
    eval: EvalSettings = setting(affects=EVERYTHING, factory=EvalSettings)
    trainer: TrainerSettings = setting(affects=EVERYTHING, factory=TrainerSettings)
    logger: LoggerSettings = setting(affects=NOTHING, factory=LoggerSettings)
    paths: PathsSettings = setting(affects=NOTHING, factory=PathsSettings)
    # the naive GDN layers' new weights, data order
    seed: int = setting(0, affects=[INIT, TRAIN], check=seed_value)
    save_student: bool = setting(True, affects=NOTHING)
    task_name: str = setting("convert", affects=NOTHING, check=folder_name)
    resume: Optional[str] = setting(None, affects=NOTHING)

    def check(self) -> None:
        for group, kind in group_types().items():  # a group of another class (the Python API's arguments)
            if not isinstance(getattr(self, group), kind):
                raise bad(group, getattr(self, group), " or ".join(k.__name__ for k in typing.get_args(kind) or [kind]))
        self.init.check_with(self.calibration)
        if self.data.retrieval_mix > 0:
            for key, stage in self.stage.stages():
                if stage.seq_len < MIN_PROBE_LEN:
                    raise SettingError(Key(f"{key}.seq_len"), f"={stage.seq_len} is too short for ",
                                       Key("data.retrieval_mix"), f"={self.data.retrieval_mix}; expected at least "
                                       f"{MIN_PROBE_LEN} tokens (a retrieval sequence holds needles, a question and an "
                                       f"answer besides its text)")

    def __post_init__(self):
        try:
            super().__post_init__()
        except SettingError as err:
            raise (err if err.place is not None else err.placed("")) from None

    def tree(self) -> dict:
        """The settings as the plain mapping a results.json records (`tcal.settings.conversion.run_settings` reads it
        back)."""
        return dataclasses.asdict(self)

    def calibrates(self) -> bool:
        """Whether the init reads the calibration split."""
        return self.init.calibrates()


@functools.cache
def group_types() -> dict[str, type]:
    """Each group's declared class (a plugin's option derives from it)."""
    hints = typing.get_type_hints(RunSettings)
    return {group: hints[group] for group in GROUPS}
