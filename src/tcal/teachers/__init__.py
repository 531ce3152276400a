"""Teacher families: one `TeacherAdapter` each (`base`), found by the config's `model_type` in the registry
(`tcal.registry.TEACHER_FAMILIES`). Adding a family is one module holding its adapter plus one `declare` line there
(or, in a `TCAL_PLUGINS` package, the module alone, declaring it)."""

from __future__ import annotations

from tcal.registry import TEACHER_FAMILIES
from tcal.teachers.base import TeacherAdapter


def adapter_for(config) -> TeacherAdapter:
    """The adapter for a teacher config (or model; a hybrid student's is its teacher's, whose base model it is); a
    clear error names the supported architectures."""
    config = getattr(config, "config", config)
    config = getattr(config, "teacher_config", None) or config
    model_type = getattr(config, "model_type", None)
    if model_type not in TEACHER_FAMILIES:
        supported = ", ".join(TEACHER_FAMILIES.names())
        raise ValueError(f"unsupported teacher architecture {model_type!r}; supported: {supported}")
    return TEACHER_FAMILIES[model_type].implementation
