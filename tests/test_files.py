"""Safe writes and one-line write errors (recsys/_files.py). The end-to-end cases (a full
disk under torch's checkpoint writer, a read-only run directory) are in
tests/train/test_run_safety.py."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest

from recsys import _files
from recsys._files import (
    describe_os_error,
    is_inside,
    remove_quietly,
    write_bytes_atomic,
    write_failure,
    write_text_atomic,
)


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "config.toml"
    write_text_atomic(path, "a = 1\n")
    assert path.read_text() == "a = 1\n"
    write_bytes_atomic(path, memoryview(b"b = 2\n"))
    assert path.read_bytes() == b"b = 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]


def test_a_failed_atomic_write_keeps_the_old_file_and_names_the_path(small_disk):
    path = small_disk / "model.bin"
    write_bytes_atomic(path, b"old")
    with pytest.raises(OSError) as failed:
        write_bytes_atomic(path, os.urandom(2 << 20))  # 2 MiB on a 1 MiB file system
    assert failed.value.errno == errno.ENOSPC
    assert failed.value.filename == str(path)
    assert describe_os_error(failed.value).startswith(f"no space left on the device of '{path}'")
    assert path.read_bytes() == b"old"
    assert [p.name for p in small_disk.iterdir()] == ["model.bin"]  # the temporary is gone


def test_remove_quietly_never_raises(tmp_path):
    remove_quietly(tmp_path / "missing")
    directory = tmp_path / "a_directory"
    directory.mkdir()
    remove_quietly(directory)  # unlink fails on a directory: not raised
    assert directory.is_dir()
    file = tmp_path / "file"
    file.write_text("x")
    remove_quietly(file)
    assert not file.exists()


def test_is_inside(tmp_path):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (tmp_path / "database").mkdir()
    assert is_inside(data, data)
    assert is_inside(data / "train" / "part.parquet", data)
    assert not is_inside(tmp_path / "database", data)  # a common prefix is not containment
    assert not is_inside(data / ".." / "database", data)
    link = tmp_path / "link"
    link.symlink_to(data / "train")
    assert is_inside(link / "x.parquet", data)  # links are resolved
    assert not is_inside(data, data / "train")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.ENOSPC, "no space left on the device of '/r/x'; free some space and run again"),
        (errno.EACCES, "cannot write '/r/x': {} (a read-only directory or file?)"),
        (errno.EPERM, "cannot write '/r/x': {} (a read-only directory or file?)"),
        (errno.EROFS, "cannot write '/r/x': {} (a read-only directory or file?)"),
        (errno.EFBIG, "cannot write '/r/x': file too large for its file system or a size limit"),
        (errno.ENOENT, "{}: '/r/x'"),
    ],
)
def test_describe_os_error_is_one_line_naming_the_path(code, expected):
    message = describe_os_error(OSError(code, os.strerror(code), "/r/x"))
    assert message == expected.format(os.strerror(code))
    assert "\n" not in message


def test_describe_os_error_without_a_path():
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert describe_os_error(error).startswith("no space left on the device of a file;")


@pytest.fixture
def disk_with_space(monkeypatch):
    monkeypatch.setattr(_files.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 40))


def test_write_failure_finds_the_os_error_at_the_root(tmp_path, disk_with_space):
    root = PermissionError(errno.EACCES, "Permission denied", "/r/shard_0.distcp")
    try:
        try:
            raise root
        except OSError as error:
            raise RuntimeError("writer failed") from error
    except RuntimeError as wrapped:
        assert write_failure(wrapped, tmp_path / "ckpt") is root  # it names its own file


def test_write_failure_names_the_path_when_the_os_error_does_not(tmp_path, disk_with_space):
    failure = write_failure(RuntimeError("x"), tmp_path)
    assert isinstance(failure, RuntimeError)  # no OSError anywhere, space left: unchanged
    try:
        raise RuntimeError("wrapped") from OSError(errno.EIO, "Input/output error")
    except RuntimeError as wrapped:
        failure = write_failure(wrapped, tmp_path / "out.parquet")
    assert isinstance(failure, OSError)
    assert (failure.errno, failure.filename) == (errno.EIO, str(tmp_path / "out.parquet"))


def test_write_failure_looks_into_the_per_rank_failures_of_a_checkpoint_error(
    tmp_path, disk_with_space
):
    on_rank_1 = OSError(errno.EROFS, "Read-only file system", "/r/ckpt/__1_0.distcp")
    error = RuntimeError("CheckpointException ranks:dict_keys([1])")
    error.failures = {0: ValueError("unrelated"), 1: (on_rank_1, "traceback text")}
    assert write_failure(error, tmp_path) is on_rank_1


def test_write_failure_on_a_nearly_full_disk_is_no_space(tmp_path, monkeypatch):
    monkeypatch.setattr(_files.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    no_errno = OSError("pyarrow: write failed")
    failure = write_failure(no_errno, tmp_path / "a" / "b.parquet")  # the nearest existing parent
    assert (failure.errno, failure.filename) == (errno.ENOSPC, str(tmp_path / "a" / "b.parquet"))
    failure = write_failure(RuntimeError("unexpected pos 704 vs 598"), tmp_path / "m.pt2")
    assert (failure.errno, failure.filename) == (errno.ENOSPC, str(tmp_path / "m.pt2"))


def test_write_failure_survives_a_cycle_of_causes(tmp_path, disk_with_space):
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert write_failure(first, tmp_path) is first


def test_file_checksum_is_size_and_crc32_and_fsync_path_takes_files_and_directories(tmp_path):
    import zlib

    from recsys._files import file_checksum, fsync_path

    path = tmp_path / "f.bin"
    path.write_bytes(b"recsys" * 1000)
    assert file_checksum(path) == (6000, zlib.crc32(b"recsys" * 1000))
    fsync_path(path)
    fsync_path(tmp_path)
