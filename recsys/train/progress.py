"""How a run reports its progress: the window of train steps between two log events (mean
loss, samples/s, with evaluation, checkpoint and torch.compile's compilation time left out),
where a step's time goes, and the one-line summary at the end of a run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

from recsys.distributed.timeline import DeviceTimeline, device_timeline

# The parts of a step, in the order they happen: waiting for the batch, forward (with the
# loss), backward (with the fused embedding update), the optimizers' step, and the time spent
# in the embedding collectives (taken out of forward and backward, where they run).
STEP_PARTS = ("data", "forward", "backward", "optimizer", "collectives")


INPUT_BOUND_SHARE = 0.25
"""A train window whose steps waited longer than this share of their time for the next batch is
input-bound: the trainer says so once a run (:func:`input_bound_note`)."""


def input_bound_note(times: dict[str, float], made_by: str) -> str | None:
    """One line when a window's steps (``times``: :meth:`StepTimer.close`'s ``time_<part>``)
    waited more than :data:`INPUT_BOUND_SHARE` of their time for their batches, saying what
    makes them (``made_by``, from the task); None otherwise."""
    waited = times.get("time_data", 0.0)
    step = sum(times.get(f"time_{part}", 0.0) for part in STEP_PARTS)
    if step <= 0.0 or waited <= INPUT_BOUND_SHARE * step:
        return None
    return (
        f"input-bound: a step waited {1000 * waited:.1f} ms of its {1000 * step:.1f} for its "
        f"batch ({waited / step:.0%}); the batches are made by {made_by}"
    )


class _CompileClock:
    """Seconds spent in torch.compile's compilations, from torch._dynamo's compile start / end
    callbacks (a compilation nested in another counted once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0
        self.since = 0.0

    def started(self, *_: object) -> None:  # torch >= 2.6 passes the compilation's CallbackArgs
        if self.depth == 0:
            self.since = time.perf_counter()
        self.depth += 1

    def ended(self, *_: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.since


_COMPILE_CLOCK = _CompileClock()


def compile_seconds() -> float:
    """Seconds this process has spent compiling under torch.compile so far: Dynamo's capture,
    AOT autograd and code generation of every graph, and a backward graph compiled at its first
    call. The first call starts counting (call it before anything compiles: :class:`StepTimer`
    does); ``torch._dynamo.reset()`` drops every compile callback, and the next call registers
    them again."""
    handler = torch._dynamo.callback_handler
    if _COMPILE_CLOCK.started not in handler.start_callbacks:
        _COMPILE_CLOCK.depth = 0
        handler.register_start_callback(_COMPILE_CLOCK.started)
        handler.register_end_callback(_COMPILE_CLOCK.ended)
    return _COMPILE_CLOCK.seconds


class StepTimer:
    """Seconds per part of the steps of a log window (:data:`STEP_PARTS`), parts that add up to
    the step.

    On CPU: host wall time between marks. ``collectives`` is what ``comm_seconds()`` (the
    collections' running total) grew by during a part; that part is counted without it. Time
    spent compiling (``compile_seconds()`` grew: torch.compile's first forward and backward, a
    recompilation) is in no part: it is counted apart, as ``compile_s``.

    On CUDA nothing waits for the device: each mark records a CUDA event on the current stream
    (:class:`~recsys.distributed.timeline.DeviceTimeline`, ``timeline``; None: the process's one
    for ``device``) and a part is the device time between its mark and the one before, read at
    :meth:`close` (the log event, which has waited for the loss anyway). Collectives record their
    own start and end on the same timeline, so their device time is taken out of the part they
    ran in (``comm_seconds`` is not read); the host seconds spent compiling, while the device
    waited for the host, are taken out of the part they happened in (down to 0 at most).

    DDP's gradient all-reduce overlaps backward and is counted in backward.
    """

    def __init__(
        self,
        device: torch.device,
        comm_seconds: Callable[[], float],
        compile_seconds: Callable[[], float] = compile_seconds,
        timeline: DeviceTimeline | None = None,
    ) -> None:
        self.device = device
        self.comm_seconds = comm_seconds
        self.compile_seconds = compile_seconds
        if timeline is None and device.type == "cuda":
            timeline = device_timeline(device)
        self.timeline = timeline
        self.totals = dict.fromkeys(STEP_PARTS, 0.0)
        self.compiling = 0.0  # seconds compiling in this window
        self._compiling_in = dict.fromkeys(STEP_PARTS, 0.0)  # CUDA: by the part they were in
        self.steps = 0
        if timeline is not None:  # an earlier timer's marks are not this one's
            timeline.flush()
            timeline.take()
        self.start()

    def start(self) -> None:
        """Restart the clock (at the start of a wait for the next batch)."""
        if self.timeline is not None:
            self.timeline.restart()
        else:
            self._last = time.perf_counter()
            self._comm = self.comm_seconds()
        self._compiled = self.compile_seconds()

    def mark(self, part: str) -> None:
        """``part`` ended now: add the time since the last mark to it."""
        compiled = self.compile_seconds()
        compiling, self._compiled = compiled - self._compiled, compiled
        self.compiling += compiling
        if self.timeline is not None:
            self.timeline.mark(part)
            self._compiling_in[part] += compiling
        else:
            now, comm = time.perf_counter(), self.comm_seconds()
            collectives = comm - self._comm
            self.totals[part] += now - self._last - collectives - compiling
            self.totals["collectives"] += collectives
            self._last, self._comm = now, comm
        if part == "optimizer":
            self.steps += 1

    def close(self) -> dict[str, float]:
        """Mean seconds per step of each part since the last close (``time_<part>``; no
        ``time_collectives`` when nothing communicated) and, when something compiled, the
        seconds spent compiling (``compile_s``, in no part); start the next window."""
        if self.timeline is not None:
            self.timeline.flush()  # waits for the window's last mark to run on the device
            for part, seconds in self.timeline.take().items():
                self.totals[part] += max(seconds - self._compiling_in.get(part, 0.0), 0.0)
        steps = max(self.steps, 1)
        means = {f"time_{part}": total / steps for part, total in self.totals.items()}
        if self.totals["collectives"] == 0.0:
            del means["time_collectives"]
        if self.compiling > 0.0:
            means["compile_s"] = self.compiling
        self.totals = dict.fromkeys(STEP_PARTS, 0.0)
        self.compiling = 0.0
        self._compiling_in = dict.fromkeys(STEP_PARTS, 0.0)
        self.steps = 0
        return means


class TrainWindow:
    """Train loss and time since the last train event; time spent in eval or saving, and time
    spent compiling, is not counted as training time (``train_time``); the compilation time of
    the train steps is counted apart (``compile_time``). With ``comm_bytes`` (the sharded
    collections' running byte counts by kind), :meth:`close` adds ``comm_bytes_<kind>``: the
    bytes this rank handed to collectives per step of the window (what ``recsys plan``
    predicts), evaluations left out."""

    def __init__(
        self,
        device: torch.device,
        comm_seconds: Callable[[], float] = float,
        compile_seconds: Callable[[], float] = compile_seconds,
        comm_bytes: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.loss = torch.zeros((), device=device)  # summed on device: no sync per step
        self.timer = StepTimer(device, comm_seconds, compile_seconds)
        self.steps = 0
        self.train_time = 0.0
        self.compile_time = 0.0
        self.start = time.perf_counter()
        self.comm_bytes = comm_bytes
        self._bytes = comm_bytes()  # the running totals at the window's start, pauses left out

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def close(self, samples_per_step: int) -> tuple[float, float, dict[str, float]]:
        """Mean loss, samples/s (compilation left out) and the :class:`StepTimer` fields
        (seconds per step of each part, ``compile_s`` when something compiled) of the window;
        starts the next one."""
        loss = float(self.loss) / max(self.steps, 1)  # waits for the device: time is honest
        times = self.timer.close()
        compiling = times.get("compile_s", 0.0)
        elapsed = time.perf_counter() - self.start - compiling
        self.train_time += elapsed
        self.compile_time += compiling
        rate = self.steps * samples_per_step / max(elapsed, 1e-9)
        now = self.comm_bytes()
        for kind, total in now.items():  # this rank's bytes per step handed to collectives
            times[f"comm_bytes_{kind}"] = (total - self._bytes.get(kind, 0)) / max(self.steps, 1)
        self._bytes = now
        self.loss.zero_()
        self.steps = 0
        self.start = time.perf_counter()
        return loss, rate, times

    def pause(self, work: Callable[[], Any]) -> None:
        """Run ``work`` without counting its time as training time."""
        paused, before = time.perf_counter(), self.comm_bytes()
        work()
        self.start += time.perf_counter() - paused
        after = self.comm_bytes()  # an evaluation's exchanges are not the steps'
        self._bytes = {k: v + after[k] - before.get(k, 0) for k, v in self._bytes.items()}
        self.timer.start()


def summary_line(
    what: str,
    steps: int,
    test: dict[str, float],
    samples_per_s: float | None,
    trained: int,
    run_dir: Path,
    compile_s: float = 0.0,
) -> str:
    """``recsys: <what> done | steps | test AUC (and the oracle's) | logloss | samples/s |
    compile time | run dir`` (a sequence model: test HR@10 with the oracle's and popularity's,
    NDCG@10, in place of AUC and logloss); ``trained``: the steps this process ran (fewer than
    ``steps`` after a resume); ``compile_s``: the seconds its train steps spent compiling under
    torch.compile (left out of samples/s; not shown when 0)."""
    line = f"recsys: {what} done | {steps} steps | "
    if "auc" in test:
        line += f"test auc {test['auc']:.4f}"
        if "oracle_auc" in test:
            gap = test["oracle_auc"] - test["auc"]
            line += f" (oracle {test['oracle_auc']:.4f}, gap {gap:.4f})"
        line += f" | test logloss {test['logloss']:.4f} | "
    else:
        references = [f"popularity {test['popularity_hr@10']:.4f}"]
        if "oracle_hr@10" in test:
            references.insert(0, f"oracle {test['oracle_hr@10']:.4f}")
        line += f"test hr@10 {test['hr@10']:.4f} ({', '.join(references)})"
        line += f" | test ndcg@10 {test['ndcg@10']:.4f} | "
    if samples_per_s is None:
        line += "no step trained in this process"
    else:
        line += f"{samples_per_s:,.0f} {'samples' if 'auc' in test else 'users'}/s"
        if trained != steps:
            line += f" over its {trained} step(s)"
    if compile_s > 0.0:
        line += f" | compile {compile_s:,.1f} s"
    return line + f" | {run_dir}"
