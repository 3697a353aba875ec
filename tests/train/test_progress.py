"""Where a step's time goes: the parts add up to the step, and collectives are taken out of
the parts they ran in."""

from __future__ import annotations

import time

import torch

from recsys.train.metrics import read_metrics
from recsys.train.progress import STEP_PARTS, StepTimer
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
