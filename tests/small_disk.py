"""A small file system to fill: a tmpfs mounted for the length of a ``with`` block, for tests
of what a full disk does (mounting needs root, as on CI; elsewhere the test is skipped)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[Path]:
    """``directory`` (created) as a tmpfs of ``size`` (``"4m"``), unmounted after the block.

    Skips the calling test where the machine cannot mount one."""
    directory.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
