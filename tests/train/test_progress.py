"""Where a step's time goes: the parts add up to the step, and collectives and torch.compile's
compilation are taken out of the parts they ran in (compilation out of samples/s too)."""

from __future__ import annotations

import time

import pytest
import torch

import recsys.train.model_setup
from recsys.config import load_config
from recsys.distributed.comm import CommStats
from recsys.train.compiled import compile_dense
from recsys.train.metrics import read_metrics
from recsys.train.progress import (
    STEP_PARTS,
    StepTimer,
    TrainWindow,
    compile_seconds,
    input_bound_note,
)
from recsys.train.trainer import train
from tests.distributed.test_timeline import FakeDevice, fake_timeline
from tests.train.test_resume import TINY, run


def test_collectives_are_taken_out_of_the_part_they_ran_in():
    comm = [0.0]
    timer = StepTimer(torch.device("cpu"), lambda: comm[0])
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.mark("data")
        time.sleep(0.02)
        comm[0] += 0.015  # 15 ms of the forward were an all-to-all
        timer.mark("forward")
        timer.mark("backward")
        timer.mark("optimizer")
    times = timer.close()
    assert set(times) == {f"time_{p}" for p in STEP_PARTS}
    assert abs(times["time_collectives"] - 0.015) < 1e-9
    assert 0.004 <= times["time_forward"] < 0.015  # 20 ms minus the 15 ms all-to-all
    assert times["time_data"] >= 0.009
    assert timer.close() == dict.fromkeys(
        [f"time_{p}" for p in STEP_PARTS if p != "collectives"], 0.0
    )  # a fresh window; nothing communicated: no time_collectives


def test_on_cuda_parts_are_read_from_events_at_close_without_waiting_in_a_step(monkeypatch):
    """Each mark records an event (a fake device here, running behind the host); a collective's
    own events take it out of its part; compilation (host seconds) is in no part; nothing waits
    for the device before close, and the parts add up to the device's step."""

    def synchronize(*_):
        raise AssertionError("torch.cuda.synchronize inside a step")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    device, compiled = FakeDevice(), [0.0]
    timeline = fake_timeline(device)
    stats = CommStats(timeline=timeline)

    def comm_seconds() -> float:
        raise AssertionError("on CUDA the collectives come from the timeline")

    timer = StepTimer(torch.device("cuda"), comm_seconds, lambda: compiled[0], timeline)
    for step in range(4):
        device.queue(1.0)
        timer.mark("data")
        device.queue(2.0)
        with stats.timed(torch.device("cuda")):
            device.queue(3.0)
        if step == 0:  # the first forward compiled for 4 ms while the device waited
            device.queue(4.0)
            compiled[0] += 0.004
        timer.mark("forward")
        device.queue(5.0)
        timer.mark("backward")
        device.queue(0.5)
        timer.mark("optimizer")
        assert device.waits == 0
    times = timer.close()
    assert device.waits == 1  # the window's one wait, for its last mark
    assert times == pytest.approx(
        {
            "time_data": 0.001,
            "time_forward": 0.002,
            "time_backward": 0.005,
            "time_optimizer": 0.0005,
            "time_collectives": 0.003,
            "compile_s": 0.004,
        }
    )
    assert sum(v for k, v in times.items() if k.startswith("time_")) == pytest.approx(0.0115)
    assert stats.seconds == pytest.approx(0.012)
    timer.start()  # after an evaluation: its time is in no part
    device.queue(50.0)
    timer.start()
    device.queue(1.0)
    timer.mark("data")
    timer.mark("forward")
    timer.mark("backward")
    timer.mark("optimizer")
    times = timer.close()
    assert times == pytest.approx(
        {"time_data": 0.001, "time_forward": 0.0, "time_backward": 0.0, "time_optimizer": 0.0}
    )


def test_a_new_cuda_timer_does_not_count_an_earlier_timers_marks():
    device = FakeDevice()
    timeline = fake_timeline(device)
    first = StepTimer(torch.device("cuda"), float, lambda: 0.0, timeline)
    device.queue(7.0)
    first.mark("forward")  # never closed
    second = StepTimer(torch.device("cuda"), float, lambda: 0.0, timeline)
    device.queue(2.0)
    second.mark("forward")
    second.mark("optimizer")
    assert second.close()["time_forward"] == pytest.approx(0.002)


@pytest.mark.gpu
def test_cuda_events_time_the_parts_and_the_collectives_without_synchronizing(monkeypatch):
    cuda = torch.device("cuda")
    a = torch.randn(4096, 4096, device=cuda)
    stats = CommStats()
    timer = StepTimer(cuda, float)
    torch.cuda.synchronize()
    started = time.perf_counter()
    synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: pytest.fail("synchronized"))
    for _ in range(5):
        timer.mark("data")
        for _ in range(4):
            a = (a @ a).tanh_()
        with stats.timed(cuda):  # stands for an all-to-all: device work inside the block
            a = (a @ a).tanh_()
        timer.mark("forward")
        for _ in range(3):
            a = (a @ a).tanh_()
        timer.mark("backward")
        timer.mark("optimizer")
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    times = timer.close()
    elapsed = time.perf_counter() - started
    parts = sum(v for k, v in times.items() if k.startswith("time_")) * 5
    assert parts == pytest.approx(elapsed, rel=0.2)  # device-bound: the device's time is wall
    assert times["time_forward"] == pytest.approx(4 * times["time_collectives"], rel=0.2)
    assert times["time_backward"] == pytest.approx(3 * times["time_collectives"], rel=0.2)
    assert stats.seconds == pytest.approx(5 * times["time_collectives"])


def test_the_parts_add_up_to_the_measured_step_time(tmp_path):
    run(tmp_path, *TINY, "--train.max_steps=12", "--train.log_every_steps=4")
    events = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["split"] == "train"]
    assert len(events) == 3
    for event in events:
        parts = sum(v for k, v in event.items() if k.startswith("time_"))
        step = 512 / event["samples_per_s"]  # TINY: batch 512, one rank
        assert abs(parts - step) <= 0.1 * step, (parts, step)
        assert event["lr_dense"] == 1e-3 and event["lr_embedding"] == 0.05
        assert "time_collectives" not in event  # one process: no collectives


def test_compilation_is_counted_apart_from_the_parts_and_the_rate():
    compiled = [0.0]
    window = TrainWindow(torch.device("cpu"), compile_seconds=lambda: compiled[0])
    for step in range(2):
        window.timer.mark("data")
        time.sleep(0.03)
        if step == 0:  # the first forward also compiled for 25 ms
            time.sleep(0.025)
            compiled[0] += 0.025
        window.timer.mark("forward")
        window.timer.mark("backward")
        window.timer.mark("optimizer")
        window.add(torch.tensor(0.5))
    started = window.start
    _, rate, times = window.close(samples_per_step=100)
    elapsed = time.perf_counter() - started
    assert times["compile_s"] == pytest.approx(0.025)
    assert 0.03 <= times["time_forward"] < 0.03 + 0.025 / 2  # the 25 ms are in no part
    assert rate >= 200 / (elapsed - 0.025)  # nor in the rate
    assert window.compile_time == pytest.approx(0.025)
    assert "compile_s" not in window.close(100)[2]  # a window without compilation


class TwoLayers(torch.nn.Module):
    """A module of this file: Dynamo compiles a forward of user code (it skips torch's own
    modules, nn.Sequential included, when they are compiled on their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def test_compile_seconds_counts_a_real_compilation_once():
    model = TwoLayers()
    model.compile(backend="aot_eager")
    before = compile_seconds()  # counts from here
    model(torch.randn(4, 8)).sum().backward()  # forward and backward graphs
    first = compile_seconds()
    model(torch.randn(4, 8)).sum().backward()  # compiled already
    assert first > before
    assert compile_seconds() == first
    torch._dynamo.reset()  # drops the callbacks; the next call puts them back
    compile_seconds()
    model(torch.randn(4, 8)).sum().backward()
    assert compile_seconds() > first


def test_train_compile_logs_compile_time_apart_from_throughput_and_parts(
    tmp_path, monkeypatch, capsys
):
    """The first step of a compiled run compiles the dense part: its samples/s and step parts
    are those of the step, the compilation is ``compile_s`` (and in the summary line)."""
    monkeypatch.setattr(  # aot_eager: Dynamo and AOT autograd without code generation (fast)
        recsys.train.model_setup,
        "compile_dense",
        lambda model: compile_dense(model, backend="aot_eager"),
    )
    run(tmp_path, *TINY, "--train.max_steps=3", "--train.compile=true")  # a window per step
    events = [e for e in read_metrics(tmp_path / "metrics.jsonl") if e["split"] == "train"]
    assert events[0]["compile_s"] > 0 and not any("compile_s" in e for e in events[1:])
    step_seconds = [sum(v for k, v in e.items() if k.startswith("time_")) for e in events]
    for event, seconds in zip(events, step_seconds, strict=True):
        assert seconds == pytest.approx(512 / event["samples_per_s"], rel=0.1)  # TINY: batch 512
    # The first step is about as long as the next ones (its first batch and first calls cost
    # more): folded into it, the compilation would make it compile_s longer.
    assert step_seconds[0] - min(step_seconds[1:]) < events[0]["compile_s"] / 2
    assert f"| compile {events[0]['compile_s']:,.1f} s |" in capsys.readouterr().out


def test_a_window_that_waited_for_data_most_of_its_time_is_called_input_bound():
    slow = {"time_data": 0.214, "time_forward": 0.1646, "time_backward": 0.1333}
    assert input_bound_note(slow, "8 worker process(es)") == (
        "input-bound: a step waited 214.0 ms of its 511.9 for its batch (42%); the batches are "
        "made by 8 worker process(es)"
    )
    at_the_line = {"time_data": 0.25, "time_forward": 0.75}
    assert input_bound_note(at_the_line, "x") is None  # more than a quarter, not a quarter
    assert input_bound_note({"time_data": 0.0}, "x") is None
    assert input_bound_note({}, "x") is None


def test_a_run_waiting_for_its_batches_says_so_once_after_the_first_window(
    tmp_path, monkeypatch, capsys
):
    from recsys.data.loader import BatchLoader

    batches = BatchLoader.__iter__

    def slow_batches(loader):
        for batch in batches(loader):
            time.sleep(0.6)  # a TINY step takes 5-300 ms here, depending on the load
            yield batch

    monkeypatch.setattr(BatchLoader, "__iter__", slow_batches)
    run(tmp_path / "one", *TINY, "--train.max_steps=3", "--train.log_every_steps=3")
    assert "input-bound" not in capsys.readouterr().out  # the first window is not judged
    run(tmp_path / "three", *TINY, "--train.max_steps=9", "--train.log_every_steps=3")
    lines = [line for line in capsys.readouterr().out.splitlines() if "input-bound" in line]
    assert len(lines) == 1, lines  # the second and third windows: said once
    assert lines[0].startswith("input-bound: a step waited ")
    # auto (-1): half the CPUs (1 worker on 2 CPUs), at most 8
    assert "(data.loader_workers = -1;" in lines[0] and "CPU(s) here)" in lines[0]


def test_a_run_that_keeps_up_with_its_data_says_nothing(tmp_path, capsys):
    # the default recipe: its batches take 1-2 % of a step here (TINY's tiny model waits 40 %)
    recipe = ["--train.max_steps=6", "--train.log_every_steps=3", "--train.progress_bar=false"]
    train(load_config("configs/dlrm_synthetic.toml", [f"--run.dir={tmp_path}", *recipe]))
    assert "input-bound" not in capsys.readouterr().out
