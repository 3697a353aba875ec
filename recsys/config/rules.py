"""What a numeric or checked config key may hold: :class:`Range` and :class:`Check`, written on a
field as ``Annotated[int, Range(min=1)]`` and applied when a config is loaded."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric config key, checked when the config is loaded: written as
    ``Annotated[int, Range(min=1)]`` on the field. Floats must also be finite."""

    min: float | None = None
    max: float | None = None
    max_open: bool = False
    """``max`` itself is excluded (``[min, max)``)."""

    def problem(self, value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number {self}"
        if (self.min is not None and value < self.min) or (
            self.max is not None and (value >= self.max if self.max_open else value > self.max)
        ):
            return f"must be {self}"
        return None

    def __str__(self) -> str:
        if self.max is None:
            return f">= {self.min:g}"
        return f"in [{self.min:g}, {self.max:g}{')' if self.max_open else ']'}"


@dataclass(frozen=True)
class Check:
    """A config key whose values are judged by the module that uses them: ``target`` is
    ``"module:function"``, a function of the value returning what is wrong, or None."""

    target: str
    description: str

    def problem(self, value: Any) -> str | None:
        module, name = self.target.split(":")
        check: Callable[[Any], str | None] = getattr(importlib.import_module(module), name)
        return check(value)

    def __str__(self) -> str:
        return f"({self.description})"


AtLeast0 = Range(min=0)
AtLeast1 = Range(min=1)
Fraction = Range(min=0, max=1, max_open=True)
