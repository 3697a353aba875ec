"""Device time without waiting for the device: CUDA events recorded on the stream, read later.

On CUDA the host queues a step's kernels ahead of the device. Timing a part of the step with the
host's clock would need a ``torch.cuda.synchronize`` at each of its ends, which drains the
queue and makes the next kernels wait for the host. A :class:`DeviceTimeline` instead records a
CUDA event on the current stream at each point of interest, in program order, and reads the
times between points (``Event.elapsed_time``) once the device has passed them: the points it
has passed are folded in whenever a new point is recorded (``Event.query``, which does not
wait), the rest at :meth:`DeviceTimeline.flush`, called where the host waits for the device
anyway (a log event reads the loss). Read events go back to a pool, so a timeline holds at most
the points the device has not reached yet (``max_pending``: past it, recording a point waits
for the oldest one, which only a host thousands of points ahead of its device ever does).

The points are the step timer's marks (the end of each part of a step,
``recsys.train.progress.StepTimer``) and the start and end of every timed collective
(:meth:`recsys.distributed.comm.CommStats.timed`): both record on the process's one timeline per
device (:func:`device_timeline`), so the time between two marks splits into the collectives
that ran in it and the rest, and each collective's time is also charged to the
:class:`~recsys.distributed.comm.CommStats` that timed it. All points are on the stream current
when they are taken (the step's: the train loop and its collectives share it), so program order
is the device's order. On CPU nothing here is used: host time is read at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Event(Protocol):
    """What the timeline needs of an event: ``torch.cuda.Event(enable_timing=True)``."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class Charged(Protocol):
    """An owner of collective intervals (a :class:`~recsys.distributed.comm.CommStats`): the
    seconds of its intervals are added to its ``seconds`` once the device has run them."""

    seconds: float


MARK, RESTART, BEGIN, END = "mark", "restart", "begin", "end"


class DeviceTimeline:
    """Points on one device's current stream, timed by events and read without waiting.

    Between two marks, the time inside collectives (from a :meth:`begin` to its :meth:`end`,
    nested ones counted once) goes to ``"collectives"``, the rest to the part the second mark
    names. :meth:`take` returns those seconds per part for the marks read so far (call
    :meth:`flush` first to read them all) and starts over.

    Args:
        device: the CUDA device.
        new_event: makes an event (default ``torch.cuda.Event(enable_timing=True)``).
        current_stream: the stream a point is recorded on (default the device's current one).
        max_pending: the most points recorded and not yet read; past it, recording a point waits
            for the oldest.
    """

    def __init__(
        self,
        device: torch.device,
        new_event: Callable[[], Event] | None = None,
        current_stream: Callable[[], Any] | None = None,
        max_pending: int = 1024,
    ) -> None:
        if max_pending < 2:
            raise ValueError(f"max_pending = {max_pending}; expected at least 2")
        self.device = device
        self.max_pending = max_pending
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current_stream = current_stream or (lambda: torch.cuda.current_stream(device))
        self._pending: deque[tuple[str, Any, Event]] = deque()  # (kind, part or owner, event)
        self._pool: list[Event] = []
        self._last: Event | None = None  # the newest point read: the next one is timed from it
        self._open: list[Charged] = []  # owners of the collectives open at the last point read
        self._compute = 0.0  # seconds outside collectives since the last mark read
        self._collectives = 0.0  # seconds in collectives since the last mark read
        self._totals: dict[str, float] = {}
        self.events_made = 0  # events ever made (the pool keeps this bounded)

    def mark(self, part: str) -> None:
        """``part`` of the step ends here."""
        self._record(MARK, part)

    def restart(self) -> None:
        """Time from here on: what ran since the last mark belongs to no part."""
        self._record(RESTART, None)

    def begin(self, owner: Charged) -> None:
        """A collective of ``owner`` starts here."""
        self._record(BEGIN, owner)

    def end(self, owner: Charged) -> None:
        """The collective of ``owner`` begun last ends here."""
        self._record(END, owner)

    def flush(self) -> None:
        """Read every point recorded so far, waiting for the device to reach the newest."""
        if self._pending:
            self._pending[-1][2].synchronize()
        while self._pending:
            self._read_oldest()

    def take(self) -> dict[str, float]:
        """Seconds per part (and ``"collectives"``) of the marks read since the last take."""
        totals, self._totals = self._totals, {}
        return totals

    @property
    def pending(self) -> int:
        """Points recorded that the device may not have reached yet (not read)."""
        return len(self._pending)

    def _record(self, kind: str, what: Any) -> None:
        event = self._pool.pop() if self._pool else self._make_event()
        event.record(self._current_stream())
        self._pending.append((kind, what, event))
        while self._pending and self._pending[0][2].query():  # reached: read it, no wait
            self._read_oldest()
        if len(self._pending) > self.max_pending:
            self._pending[0][2].synchronize()  # a bounded queue: wait for the oldest point
            self._read_oldest()

    def _make_event(self) -> Event:
        self.events_made += 1
        return self._new_event()

    def _read_oldest(self) -> None:
        kind, what, event = self._pending.popleft()
        if self._last is not None:
            seconds = self._last.elapsed_time(event) / 1000.0  # ms -> s
            if self._open:
                self._collectives += seconds
                for owner in {id(o): o for o in self._open}.values():
                    owner.seconds += seconds
            else:
                self._compute += seconds
            self._pool.append(self._last)
        self._last = event
        if kind == MARK:
            self._totals[what] = self._totals.get(what, 0.0) + self._compute
            if self._collectives:
                self._totals["collectives"] = self._totals.get("collectives", 0.0)
                self._totals["collectives"] += self._collectives
            self._compute = self._collectives = 0.0
        elif kind == RESTART:
            self._compute = self._collectives = 0.0
        elif kind == BEGIN:
            self._open.append(what)
        elif kind == END:
            for index in range(len(self._open) - 1, -1, -1):
                if self._open[index] is what:
                    del self._open[index]
                    break


_TIMELINES: dict[torch.device, DeviceTimeline] = {}


def device_timeline(device: torch.device) -> DeviceTimeline:
    """The process's timeline of CUDA device ``device`` (made at the first call), shared by the
    step timer and the collectives."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _TIMELINES:
        _TIMELINES[device] = DeviceTimeline(device)
    return _TIMELINES[device]
