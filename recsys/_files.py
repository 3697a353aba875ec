"""Writing files safely, and saying in one line why a write failed.

Every command that writes (train, preprocess, export, predict) goes through these, so a full
disk or a read-only directory is reported the same way everywhere: ``no space left on the
device of '<path>'``, not a C++ assertion from deep inside ``torch.save``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import zlib
from pathlib import Path

_BLOCK = 16 << 20  # bytes read at a time when checksumming

# Below this many free bytes, a failed write is taken to be the disk filling up: torch's zip
# writer reports ENOSPC as "unexpected pos" without the errno.
_NEARLY_FULL = 64 << 20


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` replaced in one rename by a complete, synced file."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, data: bytes | memoryview) -> None:
    """``path`` replaced in one rename by a complete, synced file; a failed write (a full
    disk) is an OSError naming ``path`` and leaves what was there."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        raise write_failure(error, path) from error
    finally:
        remove_quietly(tmp)


def fsync_path(path: Path) -> None:
    """Sync a file, or a directory's entries (a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_checksum(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of a file, read in blocks."""
    crc, size = 0, 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def remove_quietly(path: Path) -> None:
    """Delete the file ``path`` if it is there; a failure to do so is not raised (cleanup must
    not hide the error that made it necessary)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def is_inside(path: str | Path, directory: str | Path) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (links resolved)."""
    path, directory = Path(path).resolve(), Path(directory).resolve()
    return path == directory or directory in path.parents


def write_failure(error: BaseException, path: str | Path) -> BaseException:
    """The error to raise for a write of ``path`` that failed with ``error``: the OSError at
    its root when there is one (torch.distributed.checkpoint wraps them), an ENOSPC OSError
    when the disk of ``path`` is (nearly) full, else ``error`` itself."""
    nearly_full = _free_bytes(Path(path)) < _NEARLY_FULL
    for cause in _causes(error):
        if isinstance(cause, OSError):
            code = cause.errno
            if code is None and nearly_full:  # pyarrow's errors carry no errno
                code = errno.ENOSPC
            if cause.filename is None or code != cause.errno:
                return OSError(code, cause.strerror or str(cause), str(path))
            return cause
    if nearly_full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return error


class NoSpaceError(OSError):
    """ENOSPC for ``path``, knowing how many more bytes were needed and on which device:
    ``no space left on DEVICE for PATH (needs N GiB)``."""

    def __init__(self, path: str | Path, needed_bytes: int) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.needed_bytes = needed_bytes
        self.device = mount_device(Path(path))

    def __str__(self) -> str:
        free = _free_bytes(Path(self.filename))
        return (
            f"no space left on {self.device} for '{self.filename}' (needs "
            f"{format_bytes(self.needed_bytes)} more, {format_bytes(free)} free)"
        )


def mount_device(path: Path) -> str:
    """The device (and mount point) of the file system ``path`` is on, in words:
    ``/dev/nvme0n1 (mounted at /nvme)``; the mount point alone when /proc/mounts is silent."""
    mount = path.absolute()
    while not mount.exists() or not os.path.ismount(mount):
        if mount == mount.parent:
            break
        mount = mount.parent
    device = None
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:  # the last entry of a mount point is the one in effect
            fields = line.split()
            if len(fields) > 1 and fields[1] == str(mount):
                device = fields[0]
    return f"{device} (mounted at {mount})" if device else str(mount)


def format_bytes(num_bytes: int) -> str:
    """``1.25 GiB`` from 128 MiB on, else ``3.4 MiB``."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**27 else f"{num_bytes / 2**20:.1f} MiB"


def describe_os_error(error: OSError) -> str:
    """One line for a user: what failed and on which path."""
    where = f"'{error.filename}'" if error.filename else "a file"
    if isinstance(error, NoSpaceError):
        return f"{error}; free some space and run again"
    if error.errno == errno.ENOSPC:
        return f"no space left on the device of {where}; free some space and run again"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: {error.strerror} (a read-only directory or file?)"
    if error.errno == errno.EFBIG:
        return f"cannot write {where}: file too large for its file system or a size limit"
    return f"{error.strerror or error}: {where}"


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, what it was raised from, and the per-rank failures of a DCP
    CheckpointException."""
    found, todo = [], [error]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is f for f in found):
            continue
        found.append(current)
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # CheckpointException
        if isinstance(failures, dict):  # {rank: (error, traceback)}
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(failure, BaseException):
                    todo.append(failure)
    return found


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return _NEARLY_FULL
    return _NEARLY_FULL
