"""Killing a run with SIGKILL once it has written a given file or directory (a checkpoint), as
a crash would: what the resume tests start from."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def kill_9_after(command: list[str], written: Path, **popen) -> None:
    """Run ``command`` and SIGKILL it as soon as ``written`` exists.

    Raises:
        AssertionError: the run ended before ``written`` appeared.
    """
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, **popen)
    try:
        while not written.exists():
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL
