"""One process per disk-tier file: an advisory lock held for as long as a store uses its file.

Two runs given the same ``model.storage.path`` would truncate and overwrite each other's
memory-mapped rows. A :class:`StoreLock` takes ``<file>.lock`` beside the file with
``flock(LOCK_EX | LOCK_NB)`` before the file is touched, and writes who holds it (pid, host, the
command and its directory, since when) into it. The kernel drops the lock when the process ends,
however it ends (a crash, ``kill -9``): a stale ``.lock`` file left behind locks nothing. A second
store of the same file, in another process or the same one, is a :class:`StoreInUseError` that
names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

__all__ = ["StoreInUseError", "StoreLock"]


class StoreInUseError(ValueError):
    """The file of a store is in use by another store (another run, most often)."""


class StoreLock:
    """Holds ``<path>.lock`` (see the module docstring) until :meth:`release` or until the
    object is collected.

    Raises:
        StoreInUseError: another store holds it (the message names its process and command).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(f"{path}.lock")
        self._fd: int | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StoreInUseError(
                f"'{path}' is in use by another run ({holder}): two runs on one store overwrite "
                "each other's rows; give this run a model.storage.path of its own, or stop the "
                "other one"
            ) from None
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)

    def release(self) -> None:
        """Let another store take the file (closing the descriptor drops the lock)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.release()


def _lock(fd: int) -> None:
    """flock ``fd``, or BlockingIOError. Held by this very process, the holder may be a store
    nothing refers to any more, not yet collected (a run that failed, in a reference cycle):
    collect garbage and try once more."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if _holder_pid(fd) != os.getpid():
            raise
        gc.collect()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _holder_pid(fd: int) -> int | None:
    holder = _holder_fields(fd)
    try:
        return int(holder["pid"]) if holder else None
    except (ValueError, KeyError, TypeError):
        return None


def _holder_fields(fd: int) -> dict | None:
    """What the holder wrote into the lock file (None: nothing readable)."""
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0).decode())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _holder() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
        "cwd": os.getcwd(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _read_holder(fd: int) -> str:
    """The holder the lock file names, in words."""
    holder = _holder_fields(fd)
    try:
        where = "" if holder["host"] == socket.gethostname() else f" on {holder['host']}"
        if holder["pid"] == os.getpid() and not where:
            return f"this process, since {holder['since']}: another store of the same file"
        return (
            f"pid {holder['pid']}{where} since {holder['since']}: "
            f"'{holder['command']}' in {holder['cwd']}"
        )
    except (KeyError, TypeError):  # no holder, or one without these fields
        return "a process that did not say which"
