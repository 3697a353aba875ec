"""How a run reports its progress: the window of train steps between two log events (mean
loss, samples/s, with evaluation and checkpoint time left out) and the one-line summary at the
end of a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class TrainWindow:
    """Train loss and time since the last train event; time spent in eval or saving is not
    counted as training time."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)  # summed on device: no sync per step
        self.steps = 0
        self.train_time = 0.0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def close(self, samples_per_step: int) -> tuple[float, float]:
        """Mean loss and samples/s of the window; starts the next one."""
        loss = float(self.loss) / max(self.steps, 1)  # waits for the device: time is honest
        elapsed = time.perf_counter() - self.start
        self.train_time += elapsed
        rate = self.steps * samples_per_step / max(elapsed, 1e-9)
        self.loss.zero_()
        self.steps = 0
        self.start = time.perf_counter()
        return loss, rate

    def pause(self, work: Callable[[], Any]) -> None:
        """Run ``work`` without counting its time as training time."""
        paused = time.perf_counter()
        work()
        self.start += time.perf_counter() - paused


def summary_line(
    what: str,
    steps: int,
    test: dict[str, float],
    samples_per_s: float | None,
    trained: int,
    run_dir: Path,
) -> str:
    """``recsys: <what> done | steps | test AUC (and the oracle's) | logloss | samples/s |
    run dir``; ``trained``: the steps this process ran (fewer than ``steps`` after a resume)."""
    line = f"recsys: {what} done | {steps} steps | test auc {test['auc']:.4f}"
    if "oracle_auc" in test:
        line += f" (oracle {test['oracle_auc']:.4f}, gap {test['oracle_auc'] - test['auc']:.4f})"
    line += f" | test logloss {test['logloss']:.4f} | "
    if samples_per_s is None:
        line += "no step trained in this process"
    else:
        line += f"{samples_per_s:,.0f} samples/s"
        if trained != steps:
            line += f" over its {trained} step(s)"
    return line + f" | {run_dir}"
