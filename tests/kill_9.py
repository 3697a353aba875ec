"""Killing a run with SIGKILL once it has written a given file or directory (a checkpoint), as
a crash would: what the resume tests start from. The whole process group is killed, the run's
worker processes with it: a worker left alive a moment longer still holds the run's files
(a disk tier's store lock), which a resume right after would find in use."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def kill_9_after(command: list[str], written: Path, **popen) -> None:
    """Run ``command`` in a session of its own and SIGKILL its process group as soon as
    ``written`` exists.

    Raises:
        AssertionError: the run ended before ``written`` appeared.
    """
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True, **popen)
    try:
        while not written.exists():
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL
