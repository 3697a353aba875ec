"""Learning-rate schedule shared by the dense optimizer and the fused embedding optimizers.

The multiplier of step ``s`` (0 for the first step) out of ``S``, with ``W`` warmup steps and
``r = min_lr_ratio``:

    s < W:          (s + 1) / W
    constant:       1
    linear:         1 - (1 - r) * p             with p = (s - W) / max(S - W - 1, 1)
    cosine:         r + (1 - r) * (1 + cos(pi * p)) / 2

so the last step runs at exactly ``r`` times the base rate. The multiplier is a function of the
step alone: a resumed run sets the same rates as the uninterrupted one, and the checkpointed
state (:meth:`LRSchedule.state_dict`) only records the schedule for inspection.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recsys.config import TrainConfig
from recsys.embedding.optim import FusedOptimizer


class LRSchedule:
    """Sets the learning rates of ``optimizers`` (torch optimizers and fused embedding
    optimizers) for each step: ``base_lr * multiplier(step)``.

    Args:
        config: the ``[train]`` section (lr_schedule, warmup_steps, min_lr_ratio).
        total_steps: S, the number of steps of the run.
        optimizers: torch optimizers; each param group's current ``lr`` is its base rate.
        fused: fused embedding optimizers; their current ``lr`` is their base rate.

    Example::

        schedule = LRSchedule(config.train, 1000, [dense_optimizer], [ebc.optimizer])
        for step in range(1000):
            schedule.apply(step)  # before the forward: fused updates run inside backward
            ...
    """

    def __init__(
        self,
        config: TrainConfig,
        total_steps: int,
        optimizers: list[torch.optim.Optimizer],
        fused: list[FusedOptimizer],
    ) -> None:
        if config.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps = {config.warmup_steps}; expected >= 0")
        if not 0.0 <= config.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio = {config.min_lr_ratio}; expected in [0, 1]")
        self.kind = config.lr_schedule
        self.warmup_steps = config.warmup_steps
        self.min_lr_ratio = config.min_lr_ratio
        self.total_steps = total_steps
        # Base rates by group index: loading an optimizer's state replaces its group dicts.
        self._optimizers = [(o, [group["lr"] for group in o.param_groups]) for o in optimizers]
        self._fused = [(optimizer, optimizer.lr) for optimizer in _unique(fused)]

    def multiplier(self, step: int) -> float:
        """The factor applied to every base rate at step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        decay_steps = max(self.total_steps - self.warmup_steps - 1, 1)
        progress = min((step - self.warmup_steps) / decay_steps, 1.0)
        r = self.min_lr_ratio
        if self.kind == "linear":
            return 1.0 - (1.0 - r) * progress
        return r + (1.0 - r) * (1.0 + math.cos(math.pi * progress)) / 2.0

    def apply(self, step: int) -> None:
        """Set every optimizer's rate for step ``step``."""
        factor = self.multiplier(step)
        for optimizer, bases in self._optimizers:
            for group, base in zip(optimizer.param_groups, bases, strict=True):
                group["lr"] = base * factor
        for optimizer, base in self._fused:
            optimizer.lr = base * factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "warmup_steps": self.warmup_steps,
            "min_lr_ratio": self.min_lr_ratio,
            "total_steps": self.total_steps,
        }


def _unique(items: list[Any]) -> list[Any]:
    seen, unique = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            unique.append(item)
    return unique
