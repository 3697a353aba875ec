"""How a run reports its progress: the window of train steps between two log events (mean
loss, samples/s, with evaluation and checkpoint time left out), where a step's time goes, and
the one-line summary at the end of a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The parts of a step, in the order they happen: waiting for the batch, forward (with the
# loss), backward (with the fused embedding update), the optimizers' step, and the time spent
# in the embedding collectives (taken out of forward and backward, where they run).
STEP_PARTS = ("data", "forward", "backward", "optimizer", "collectives")


class StepTimer:
    """Seconds per part of the steps of a log window (:data:`STEP_PARTS`).

    Host wall time between marks; on CUDA the device is synchronized at each mark first, so
    a part is the time its kernels took (one synchronization per part, a few per step).
    ``collectives`` is what ``comm_seconds()`` (the collections' running total) grew by during
    forward and backward; those parts are counted without it, so the parts add up to the step.
    DDP's gradient all-reduce overlaps backward and is counted in backward.
    """

    def __init__(self, device: torch.device, comm_seconds: Callable[[], float]) -> None:
        self.device = device
        self.comm_seconds = comm_seconds
        self.totals = dict.fromkeys(STEP_PARTS, 0.0)
        self.steps = 0
        self._last = time.perf_counter()
        self._comm = comm_seconds()

    def start(self) -> None:
        """Restart the clock (at the start of a wait for the next batch)."""
        self._sync()
        self._last = time.perf_counter()
        self._comm = self.comm_seconds()

    def mark(self, part: str) -> None:
        """``part`` ended now: add the time since the last mark to it."""
        self._sync()
        now, comm = time.perf_counter(), self.comm_seconds()
        collectives = comm - self._comm
        self.totals[part] += now - self._last - collectives
        self.totals["collectives"] += collectives
        self._last, self._comm = now, comm
        if part == "optimizer":
            self.steps += 1

    def close(self) -> dict[str, float]:
        """Mean seconds per step of each part since the last close (``time_<part>``; no
        ``time_collectives`` when nothing communicated), and start the next window."""
        steps = max(self.steps, 1)
        means = {f"time_{part}": total / steps for part, total in self.totals.items()}
        if self.totals["collectives"] == 0.0:
            del means["time_collectives"]
        self.totals = dict.fromkeys(STEP_PARTS, 0.0)
        self.steps = 0
        return means

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class TrainWindow:
    """Train loss and time since the last train event; time spent in eval or saving is not
    counted as training time."""

    def __init__(self, device: torch.device, comm_seconds: Callable[[], float] = float) -> None:
        self.loss = torch.zeros((), device=device)  # summed on device: no sync per step
        self.timer = StepTimer(device, comm_seconds)
        self.steps = 0
        self.train_time = 0.0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def close(self, samples_per_step: int) -> tuple[float, float, dict[str, float]]:
        """Mean loss, samples/s and seconds per step of each part (:class:`StepTimer`) of the
        window; starts the next one."""
        loss = float(self.loss) / max(self.steps, 1)  # waits for the device: time is honest
        elapsed = time.perf_counter() - self.start
        self.train_time += elapsed
        rate = self.steps * samples_per_step / max(elapsed, 1e-9)
        self.loss.zero_()
        self.steps = 0
        self.start = time.perf_counter()
        return loss, rate, self.timer.close()

    def pause(self, work: Callable[[], Any]) -> None:
        """Run ``work`` without counting its time as training time."""
        paused = time.perf_counter()
        work()
        self.start += time.perf_counter() - paused
        self.timer.start()


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
