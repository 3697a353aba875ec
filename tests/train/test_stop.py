"""Stopping on SIGINT / SIGTERM (recsys/train/stop.py): the handler records the signal, a
second Ctrl-C interrupts, handlers are restored. Through the trainer: test_run_safety.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from recsys.train.stop import StopSignals, TrainingStopped


def send(number: int, stop: StopSignals | None = None) -> None:
    """Signal this process; with ``stop``, wait until Python has run its handler."""
    before = None if stop is None else stop.received
    os.kill(os.getpid(), number)
    deadline = time.monotonic() + 5.0
    while stop is not None and stop.received is before and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def caught_signals():
    """Handlers of this test's own for SIGINT and SIGTERM, so that a signal StopSignals failed to
    catch is recorded here instead of ending the test run."""
    caught = []
    originals = {
        n: signal.signal(n, lambda number, frame: caught.append(number))
        for n in (signal.SIGINT, signal.SIGTERM)
    }
    yield caught
    for number, handler in originals.items():
        signal.signal(number, handler)


def test_training_stopped_message_and_exit_code():
    saved = TrainingStopped("SIGINT", 12, Path("runs/a/checkpoints/step_00000012"))
    assert str(saved) == (
        "stopped by SIGINT at step 12; checkpoint runs/a/checkpoints/step_00000012; continue "
        "with --checkpoint.resume=latest"
    )
    assert (saved.signal_name, saved.step, saved.exit_code) == ("SIGINT", 12, 130)
    unsaved = TrainingStopped("SIGTERM", 3, None)
    assert str(unsaved) == "stopped by SIGTERM at step 3; continue with --checkpoint.resume=latest"
    assert unsaved.exit_code == 143
    cut = TrainingStopped("SIGINT", 7, Path("runs/a/checkpoints/step_00000004"), interrupted=True)
    assert str(cut) == (
        "interrupted by a second SIGINT at step 7, which has no checkpoint (the latest is "
        "runs/a/checkpoints/step_00000004); continue with --checkpoint.resume=latest"
    )
    assert cut.exit_code == 130
    assert str(TrainingStopped("SIGINT", 2, None, interrupted=True)) == (
        "interrupted by a second SIGINT at step 2, before any checkpoint was saved: nothing to "
        "resume"
    )


def test_a_signal_is_recorded_and_handlers_are_restored(caught_signals):
    previous = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals() as stop:
        assert not stop.requested()
        assert stop.name == "SIGTERM"  # the default when none arrived here
        send(signal.SIGTERM, stop)
        assert stop.requested() and stop.received == signal.SIGTERM and stop.name == "SIGTERM"
        send(signal.SIGTERM)  # repeated SIGTERMs are ignored: still handled here
        assert stop.received == signal.SIGTERM
        assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is stop
        # once a stop is requested, a Ctrl-C is noted and goes to the previous handler
        assert signal.getsignal(signal.SIGINT) == stop._interrupt
    assert {n: signal.getsignal(n) for n in previous} == previous
    assert caught_signals == []  # every signal was StopSignals'


def test_a_second_ctrl_c_goes_to_the_previous_handler(caught_signals):
    with StopSignals() as stop:
        send(signal.SIGINT, stop)
        assert stop.name == "SIGINT" and caught_signals == []
        send(signal.SIGINT)
        deadline = time.monotonic() + 5.0
        while not caught_signals and time.monotonic() < deadline:
            time.sleep(0.001)
        assert caught_signals == [signal.SIGINT]  # a second Ctrl-C interrupts at once
        assert stop.interrupted  # noted first: the trainer reports it, whatever it broke


def test_a_second_ctrl_c_in_a_background_job_is_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            send(signal.SIGINT, stop)
            send(signal.SIGINT)
            time.sleep(0.01)
            assert stop.received == signal.SIGINT and not stop.interrupted
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_it_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with StopSignals() as stop:
            seen.append((signal.getsignal(signal.SIGTERM), stop.requested()))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(before, False)]


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ranks_agree_one_call_after_the_signal(one_rank, caught_signals):
    """With several ranks, requested() answers what every rank had as of the previous call (an
    all-reduce started at one step and read at the next): one call late. Run on a one-rank
    group standing in for several."""
    with StopSignals(world_size=2) as stop:
        assert stop.requested() is False
        send(signal.SIGTERM, stop)
        assert stop.requested() is False  # started the all-reduce that carries the signal
        assert stop.requested() is True
    assert caught_signals == []
