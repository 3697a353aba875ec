"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, torchrun
shutting its workers down).

The handler only records the signal; the training loop asks :meth:`StopSignals.requested` after
each step, saves a checkpoint at that step and raises :class:`TrainingStopped`, which the
command line reports in one line. Under torchrun every rank must stop at the same step (the
save is collective), so the ranks agree on it with a one-int all-reduce on a CPU (gloo) group of
its own, started at one step and read at the next: no step waits for it, no device
synchronizes for it, and the run stops one step after the signal. A second Ctrl-C interrupts
at once, wherever the run is (a checkpoint save included): :attr:`StopSignals.interrupted` is set
before the previous handler raises KeyboardInterrupt, so the trainer knows that whatever error
comes out of the interrupted code (torch.distributed.checkpoint wraps a KeyboardInterrupt in
its own exception) is the user's stop, and reports it in one line (the atomic checkpoint commit
leaves the previous checkpoint intact). Repeated SIGTERMs are ignored until the run has stopped.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(Exception):
    """Training stopped on a signal, after saving a checkpoint at ``step``; or, ``interrupted``
    by a second Ctrl-C, at once: ``checkpoint`` is then the latest one committed before (None:
    there is none)."""

    def __init__(
        self, signal_name: str, step: int, checkpoint: Path | None, *, interrupted: bool = False
    ) -> None:
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.interrupted = interrupted
        if interrupted and checkpoint is None:
            message = (
                f"interrupted by a second {signal_name} at step {step}, before any checkpoint "
                "was saved: nothing to resume"
            )
        elif interrupted:
            message = (
                f"interrupted by a second {signal_name} at step {step}, which has no checkpoint "
                f"(the latest is {checkpoint}); continue with --checkpoint.resume=latest"
            )
        else:
            saved = f"; checkpoint {checkpoint}" if checkpoint else ""
            message = (
                f"stopped by {signal_name} at step {step}{saved}; continue with "
                "--checkpoint.resume=latest"
            )
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number."""
        return 128 + signal.Signals[self.signal_name].value


class StopSignals:
    """Context manager: while active, SIGINT and SIGTERM request a stop instead of killing.

    Installed only from the main thread (Python delivers signals there); elsewhere it does
    nothing and signals keep their handlers.

    Args:
        world_size: ranks that must agree on the step to stop at.
    """

    def __init__(self, world_size: int = 1) -> None:
        self.received: signal.Signals | None = None
        self.interrupted = False  # a second Ctrl-C arrived
        self._previous: dict[int, object] = {}
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None  # the last call's all-reduce
        if world_size > 1 and dist.is_initialized():
            # The flags are CPU tensors: a gloo group beside NCCL (and gloo); a backend of
            # another kind (the mirror recsys plan times a rank in) serves them itself.
            cpu = dist.get_backend() in (dist.Backend.GLOO, dist.Backend.NCCL)
            self._group = dist.new_group(backend=dist.Backend.GLOO if cpu else None)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in _SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pending is not None:  # every rank started it: it completes
            self._pending[0].wait()
            self._pending = None
        self._restore()

    def requested(self) -> bool:
        """Whether a signal arrived: here, at once, in one process; on any rank as of the
        previous call when there are several (collective: every rank calls it once per step
        and all get the same answer at the same call)."""
        if self._group is None:
            return self.received is not None
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = bool(flag.item())  # a CPU tensor
        flag = torch.tensor([int(self.received is not None)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return agreed

    @property
    def name(self) -> str:
        """The signal received here (``SIGTERM`` when another rank got one)."""
        return (self.received or signal.SIGTERM).name

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(number)
        # A second Ctrl-C interrupts at once; a repeated SIGTERM (torchrun's agent may send two)
        # is ignored: the supervisor's SIGKILL after its grace period is the hard stop.
        if signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, self._interrupt)

    def _interrupt(self, number: int, frame: FrameType | None) -> None:
        """A Ctrl-C after the stop was requested: noted, then the previous handler's (Python's
        raises KeyboardInterrupt wherever the main thread is)."""
        previous = self._previous.get(signal.SIGINT, signal.SIG_DFL)
        if previous == signal.SIG_IGN:  # e.g. a background job's
            return
        self.interrupted = True
        if callable(previous):
            previous(number, frame)
        else:
            raise KeyboardInterrupt

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
