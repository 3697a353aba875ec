"""DeviceTimeline: points timed by events on the stream, read only once the device reached them,
with a bounded number of events; collectives taken out of the part they ran in (fake events that
model a device running behind the host, so this runs without a GPU)."""

from __future__ import annotations

import pytest
import torch

from recsys.distributed.comm import CommStats
from recsys.distributed.timeline import DeviceTimeline

CUDA = torch.device("cuda", 0)


class FakeDevice:
    """A stream: the host queues work (``queue(ms)``), the device runs it later (``done``, the
    ms of queued work it has finished). ``waits`` counts the host waiting on it."""

    def __init__(self) -> None:
        self.queued = 0.0
        self.done = 0.0
        self.waits = 0

    def queue(self, ms: float) -> None:
        self.queued += ms

    def run_all(self) -> None:
        self.done = self.queued


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on a :class:`FakeDevice`: reading its time before
    the device reached it is an error, as cudaEventElapsedTime's cudaErrorNotReady."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = self.device.queued

    def query(self) -> bool:
        assert self.at is not None, "query of an event never recorded"
        return self.device.done >= self.at

    def synchronize(self) -> None:
        self.device.waits += 1
        self.device.done = max(self.device.done, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
        return end.at - self.at


def fake_timeline(device: FakeDevice, max_pending: int = 1024) -> DeviceTimeline:
    return DeviceTimeline(
        CUDA, lambda: FakeEvent(device), current_stream=lambda: None, max_pending=max_pending
    )


def test_parts_are_the_device_time_between_marks_minus_collectives():
    device = FakeDevice()
    timeline = fake_timeline(device)
    stats = CommStats(timeline=timeline)
    timeline.restart()
    for _ in range(3):
        device.queue(1.0)
        timeline.mark("data")
        device.queue(2.0)
        with stats.timed(CUDA):
            device.queue(3.0)
        device.queue(1.0)
        timeline.mark("forward")
        device.queue(4.0)
        with stats.timed(CUDA):
            device.queue(2.0)
        timeline.mark("backward")
    assert device.waits == 0 and timeline.take() == {}  # the device ran nothing yet: no read
    assert stats.seconds == 0.0
    timeline.flush()
    assert device.waits == 1
    totals = timeline.take()
    assert totals == pytest.approx(
        {"data": 0.003, "forward": 0.009, "backward": 0.012, "collectives": 0.015}
    )
    assert stats.seconds == pytest.approx(0.015)
    assert timeline.take() == {}


def test_points_the_device_has_reached_are_read_as_new_ones_come_without_waiting():
    device = FakeDevice()
    timeline = fake_timeline(device)
    timeline.restart()
    for _ in range(50):
        device.queue(2.0)
        timeline.mark("forward")
        device.run_all()  # the device keeps up
    assert timeline.pending == 1  # only the newest mark: the others were read
    assert timeline.events_made <= 3  # read events go back to the pool
    assert device.waits == 0
    assert timeline.take() == pytest.approx({"forward": 49 * 0.002})
    timeline.flush()
    assert timeline.take() == pytest.approx({"forward": 0.002})


def test_a_host_far_ahead_of_its_device_holds_a_bounded_number_of_events():
    device = FakeDevice()
    timeline = fake_timeline(device, max_pending=8)
    timeline.restart()
    for _ in range(100):
        device.queue(1.0)
        timeline.mark("forward")
        assert timeline.pending <= 8
    assert timeline.events_made <= 10
    assert 0 < device.waits <= 100  # on the oldest point only, when the queue is full
    timeline.flush()
    assert timeline.take() == pytest.approx({"forward": 0.1})


def test_a_restart_drops_what_ran_since_the_last_mark_collectives_included():
    device = FakeDevice()
    timeline = fake_timeline(device)
    stats = CommStats(timeline=timeline)
    timeline.restart()
    device.queue(1.0)
    timeline.mark("data")
    device.queue(5.0)  # an evaluation, with a collective
    with stats.timed(CUDA):
        device.queue(2.0)
    timeline.restart()
    device.queue(1.5)
    timeline.mark("data")
    timeline.flush()
    assert timeline.take() == pytest.approx({"data": 0.0025})
    assert stats.seconds == pytest.approx(0.002)  # the collection's own total counts it


def test_nested_collectives_are_counted_once():
    device = FakeDevice()
    timeline = fake_timeline(device)
    outer, inner = CommStats(timeline=timeline), CommStats(timeline=timeline)
    timeline.restart()
    with outer.timed(CUDA):
        device.queue(1.0)
        with inner.timed(CUDA):
            device.queue(2.0)
    device.queue(1.0)
    timeline.mark("forward")
    timeline.flush()
    assert timeline.take() == pytest.approx({"forward": 0.001, "collectives": 0.003})
    assert (outer.seconds, inner.seconds) == pytest.approx((0.003, 0.002))


def test_comm_stats_on_cuda_never_synchronizes(monkeypatch):
    def synchronize(*_):
        raise AssertionError("torch.cuda.synchronize in a timed collective")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    device = FakeDevice()
    stats = CommStats(timeline=fake_timeline(device))
    with stats.timed(CUDA):
        device.queue(3.0)
    assert device.waits == 0


def test_comm_stats_on_cpu_counts_host_time():
    stats = CommStats()
    with stats.timed(torch.device("cpu")):
        torch.randn(256, 256) @ torch.randn(256, 256)
    assert stats.seconds > 0.0


def test_max_pending_below_two_is_refused():
    with pytest.raises(ValueError, match="max_pending = 1; expected at least 2"):
        DeviceTimeline(CUDA, max_pending=1)
