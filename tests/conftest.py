"""Test setup shared by every test.

TRITON_INTERPRET=1 must be set before anything imports triton, so Triton kernels run on the CPU
interpreter and every kernel test runs on a machine without a GPU. A caller that exports
TRITON_INTERPRET=0 (scripts/gpu_check.sh on a GPU machine) gets compiled kernels instead.

OMP_NUM_THREADS=1 (unless the caller sets it): one torch thread per test process. The tests'
tensors are small, so a second thread gains little, and two threads that share the cores with
anything else (another job on CI's machine, a torchrun test's ranks) wait for each other at
every parallel region: beside one busy process on a 2-core machine, a test that trains in
process took 21 s with two threads and 7 s with one (6 s with two on an idle machine).

RECSYS_TEST_DEVICE=cuda makes CUDA torch's default device, so tests that build their tensors
without naming a device (the op and embedding tests) run their compiled kernels on the GPU
against the same float64 references (scripts/gpu_check.sh, step ``device_tests``).
"""

import os
import subprocess

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

if os.environ.get("RECSYS_TEST_DEVICE"):
    torch.set_default_device(os.environ["RECSYS_TEST_DEVICE"])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory in which no file can be created or removed, root included (the immutable
    attribute: tests run as root on CI, where a chmod would not stop a write)."""
    directory = tmp_path / "read_only"
    directory.mkdir()
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("chattr +i is not supported on this file system")
    yield directory
    subprocess.run(["chattr", "-i", str(directory)], check=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def small_disk(tmp_path):
    """A directory on a file system of 1 MiB (a tmpfs), to fill up for real."""
    directory = tmp_path / "small_disk"
    directory.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)
