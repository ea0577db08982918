"""Attributes replaced for the length of a rehearsal and put back at its end: what
cuda.py's `fake_cuda` and world.py's `fake_world` change in torch and in trainer modules."""

from __future__ import annotations

from typing import Any

_MISSING = object()  # not in the object's own __dict__: undo deletes the patch again


class Patches:
    """setattr that remembers the old values, restored in reverse order."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.saved.append(
            (
                obj,
                name,
                obj.__dict__.get(name, _MISSING)
                if hasattr(obj, "__dict__")
                else getattr(obj, name),
            )
        )
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.saved.clear()
