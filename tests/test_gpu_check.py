"""scripts/gpu_check.sh keeps to its --budget: on a machine without CUDA the GPU steps are
skipped with a line each, a step the budget leaves no time for is skipped with a line, and the
call ends well inside the budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, env=env
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_a_cpu_machine_skips_the_gpu_steps_and_keeps_to_the_budget(tmp_path):
    started = time.perf_counter()
    steps = ["device_tests", "mlperf_dcnv2", "bench_mlp", "kernel_table"]
    done = gpu_check("--budget", "60", str(tmp_path), *steps)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for name in steps[:3]:
        assert f"SKIP  {name} (no CUDA device)" in done.stdout
    # kernel_table runs without a GPU, but not with less than a minute of the budget left
    assert re.search(r"SKIP  kernel_table \(budget: \d+s left of 60s\)", done.stdout)
    assert re.search(r"== summary \(results and logs in .*; \d+s of a 60s budget\)", done.stdout)
    assert (tmp_path / "env.txt").is_file()
    assert time.perf_counter() - started < 60


def test_a_bad_budget_is_one_line():
    done = gpu_check("--budget", "soon")
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_check.sh: --budget soon: expected a number of seconds >= 1"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "usage: bash scripts/offline_wheels.sh DIR [PYTHON_VERSION [TORCHREC [FBGEMM]]]"),
        (("wheels", "3"), "offline_wheels.sh: python version '3': expected 3.N, e.g. 3.12"),
    ],
)
def test_offline_wheels_refuses_bad_arguments_in_one_line_before_downloading(
    tmp_path, args, message
):
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "offline_wheels.sh"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == message
    assert not (tmp_path / "wheels").exists()
