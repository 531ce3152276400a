"""Name -> implementation tables for the pluggable concepts (init modes, retention policies).

Each concept is a package whose modules register themselves on import; `Registry.load` imports them all,
so adding a mode or policy means adding one module (and one YAML), nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable


class Registry:
    def __init__(self, kind: str, package: str):
        self.kind, self.package = kind, package
        self._entries: dict[str, Callable] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def add(fn: Callable) -> Callable:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = fn
            return fn

        return add

    def load(self) -> None:
        if not self._loaded:
            package = importlib.import_module(self.package)
            for module in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self.package}.{module.name}")
            self._loaded = True

    def names(self) -> list[str]:
        self.load()
        return sorted(self._entries)

    def __getitem__(self, name: str) -> Callable:
        self.load()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}")
        return self._entries[name]
