"""Teacher families: one adapter module each, found by `model_type` (adding a family adds one module)."""

from __future__ import annotations

import importlib
import pkgutil

from tcal.teachers.base import TeacherAdapter

ADAPTERS: dict[str, TeacherAdapter] = {}


def register(adapter: TeacherAdapter) -> TeacherAdapter:
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter
    return adapter


def adapter_for(config) -> TeacherAdapter:
    """The adapter for a teacher config (or model; a hybrid student's is its teacher's, whose base model it is); a
    clear error names the supported architectures."""
    config = getattr(config, "config", config)
    config = getattr(config, "teacher_config", None) or config
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        supported = ", ".join(sorted(ADAPTERS))
        raise ValueError(f"unsupported teacher architecture {model_type!r}; supported: {supported}")
    return ADAPTERS[model_type]


for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "load"):
        importlib.import_module(f"{__name__}.{_module.name}")
