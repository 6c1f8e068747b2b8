"""A name -> function registry: refuses duplicates, and an unknown name lists the valid ones. Pure Python."""

from __future__ import annotations

import importlib
from collections.abc import Callable


class Registry(dict):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def get_or_raise(self, name: str) -> Callable:
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {sorted(self)}")
        return self[name]

    def resolve(self, spec: str, key: str):
        """A registered name, or ``package.module:attr`` imported; ``key`` (the config key) names it in errors."""
        if ":" not in spec:
            return self.get_or_raise(spec)
        module, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{key}: {spec!r} cannot be imported ({e}); registered: {sorted(self)}") from e
