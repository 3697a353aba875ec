"""Test setup shared by every test.

TRITON_INTERPRET=1 must be set before anything imports triton, so Triton kernels run on the CPU
interpreter and every kernel test runs on a machine without a GPU. A caller that exports
TRITON_INTERPRET=0 (scripts/gpu_check.sh on a GPU machine) gets compiled kernels instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
