"""Backing stores of tiered tables: every row of a table (weights and optimizer state side by side
in one record) in host memory or in a file on local disk, behind the table's cache.

A store holds **records**: ``record_bytes`` bytes per row, the row's weights in the table's dtype
followed by its optimizer state in float32 (see
:class:`~recsys.embedding.tiered.row_cache.RowCodec`), so a row's weights and state always move
between tiers together. It is addressed by int64 keys:

- :class:`FixedStore` (fixed tables): the key is the row number in ``[0, num_rows)``; record
  ``k`` of a :class:`RecordArray` of ``num_rows`` records is row ``k``'s.
- :class:`KeyedStore` (dynamic tables): any int64 key; an in-memory index (a
  :class:`~recsys.embedding.dynamic.slot_map.SlotMap` and one int64 per key, 32 bytes a key) gives
  each stored key its record in an array that grows (doubling) as keys arrive. Records stay on disk;
  only the keys are in memory. Measured against RocksDB (``rocksdict``) and LMDB on the same
  batches in ``benchmarks/results/kv_store.csv`` (``benchmarks/kv_store.py``).

A row the store never received is **absent** (``read`` says so): its table initializes it
lazily from (seed, table, key). A fresh file of zeros (sparse: untouched rows take no disk) holds
only absent rows, so a 40 GB table needs no 40 GB write before its first step. The store keeps
which rows are present in memory (a :class:`RowBits` bit per row of a fixed table, the index of
a dynamic one) and reads only those: a row's first use costs no read. (The file is never read
back by another store: a table's store starts empty, and a checkpoint's rows are loaded into it.)

Two record arrays: :class:`HostRecords` (a tensor, in pinned memory when the table's cache is on
CUDA) and :class:`DiskRecords` (a memory-mapped file). A disk store's mapping is dropped from the
process's resident memory after every call (``madvise(MADV_DONTNEED)``: its pages stay in the
kernel's page cache, which the kernel reclaims under pressure), so a table far larger than RAM
trains within a small resident budget.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from recsys._files import NoSpaceError
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.dynamic.table import UNCAPPED
from recsys.embedding.tiered.store_lock import StoreLock

__all__ = [
    "DiskRecords",
    "FixedStore",
    "HostRecords",
    "KeyedStore",
    "RecordArray",
    "RowBits",
    "RowStore",
    "store_directory",
]

_PAGE = mmap.PAGESIZE


class RecordArray:
    """``num_records`` records of ``width`` bytes, read and written by record number."""

    width: int
    num_records: int

    def read(self, index: torch.Tensor) -> torch.Tensor:
        """[n, width] uint8: the records ``index`` (int64 [n]), a copy."""
        raise NotImplementedError

    def write(self, index: torch.Tensor, records: torch.Tensor) -> None:
        """Store ``records`` [n, width] uint8 at ``index`` (int64 [n], distinct)."""
        raise NotImplementedError

    def grow(self, num_records: int) -> None:
        """Hold ``num_records`` records (more than now); the new ones all zeros."""
        raise NotImplementedError

    def reserve(self, index: torch.Tensor) -> None:
        """Make room for records ``index`` before their first write (a no-op in memory)."""

    def clear(self) -> None:
        """Every record back to zeros."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make the writes durable (a no-op in memory)."""


class HostRecords(RecordArray):
    """Records in a host tensor (pinned when ``pin``: the source of a CUDA cache's copies)."""

    def __init__(self, num_records: int, width: int, *, pin: bool = False) -> None:
        self.width, self.num_records, self.pin = width, num_records, pin
        self.data = self._zeros(num_records)

    def _zeros(self, num_records: int) -> torch.Tensor:
        data = torch.zeros(num_records, self.width, dtype=torch.uint8)
        return data.pin_memory() if self.pin else data

    def read(self, index: torch.Tensor) -> torch.Tensor:
        return self.data[index.cpu()]

    def write(self, index: torch.Tensor, records: torch.Tensor) -> None:
        self.data[index.cpu()] = records.cpu()

    def grow(self, num_records: int) -> None:
        data = self._zeros(num_records)
        data[: self.num_records] = self.data
        self.data, self.num_records = data, num_records

    def clear(self) -> None:
        self.data.zero_()


class DiskRecords(RecordArray):
    """Records in the file ``path`` (created sparse: untouched records take no disk), memory
    mapped; the mapping leaves resident memory after every call (see the module docstring).

    The file is locked for the object's life
    (:class:`~recsys.embedding.tiered.store_lock.StoreLock`: a second store of it, in this process
    or another, is refused before the file is touched). Disk blocks are reserved
    (``posix_fallocate``) for records before their first write, so a full disk is a
    :class:`~recsys._files.NoSpaceError` naming the device, the file and the bytes needed, never a
    SIGBUS from a write into the mapping of a sparse file.
    """

    def __init__(self, path: str | Path, num_records: int, width: int) -> None:
        self.path = Path(path)
        store_directory(self.path.parent)
        self._lock = StoreLock(self.path)
        self.width, self.num_records = width, 0
        with open(self.path, "wb"):
            pass  # a new table: whatever the file held belongs to no checkpoint
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self.grow(num_records)

    def _array(self) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8).reshape(self.num_records, self.width)

    def read(self, index: torch.Tensor) -> torch.Tensor:
        if not len(index):
            return torch.zeros(0, self.width, dtype=torch.uint8)
        order = index.cpu().numpy()
        records = torch.from_numpy(self._array()[order])  # fancy indexing copies
        self._release()
        return records

    def write(self, index: torch.Tensor, records: torch.Tensor) -> None:
        if len(index):
            self._array()[index.cpu().numpy()] = records.cpu().numpy()
            self._release()

    def reserve(self, index: torch.Tensor) -> None:
        """Allocate the disk blocks of records ``index`` (int64 [n]) before their first write.

        Raises:
            NoSpaceError: the file system cannot hold them (no record was written)."""
        if not len(index):
            return
        runs = _page_runs(index.cpu().numpy(), self.width, self.num_records * self.width)
        for number, (offset, length) in enumerate(runs):
            try:
                os.posix_fallocate(self._fd, offset, length)
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                needed = sum(length for _, length in runs[number:])
                raise NoSpaceError(self.path, needed) from None

    def _release(self) -> None:
        self._map.madvise(mmap.MADV_DONTNEED)

    def grow(self, num_records: int) -> None:
        self._close()
        os.truncate(self.path, max(num_records, 1) * self.width)
        self.num_records = num_records
        self._open()

    def clear(self) -> None:
        self._close()
        os.truncate(self.path, 0)  # holes read as zeros and take no disk
        os.truncate(self.path, max(self.num_records, 1) * self.width)
        self._open()

    def flush(self) -> None:
        self._map.flush()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, max(self.num_records, 1) * self.width)
        # Rows are read at random: without this a fault reads ahead megabytes of zeros around
        # each row, and a table larger than RAM thrashes the page cache (15-20 s a step vs
        # 0.3 s, python -m benchmarks.tiered --large).
        self._map.madvise(mmap.MADV_RANDOM)

    def _close(self) -> None:
        if self._map is not None:
            self._map.flush()
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Unmap and unlock the file (the object is unusable after)."""
        self._close()
        self._lock.release()


def _page_runs(index: np.ndarray, width: int, file_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges (offset, length) of whole pages covering records ``index`` of ``width``
    bytes, consecutive pages merged, clipped to the file."""
    index = np.sort(index)
    first = index * width // _PAGE
    last = (index * width + width - 1) // _PAGE  # ascending, as the records are
    breaks = np.nonzero(first[1:] > last[:-1] + 1)[0]  # a gap of at least one page
    starts = np.concatenate([[0], breaks + 1])
    stops = np.concatenate([breaks, [len(index) - 1]])
    runs = []
    for start, stop in zip(first[starts].tolist(), last[stops].tolist(), strict=True):
        offset = start * _PAGE
        runs.append((offset, min((stop + 1) * _PAGE, file_bytes) - offset))
    return runs


def store_directory(path: str | Path) -> Path:
    """The directory ``path`` of a disk tier's files, created when missing, but only inside a
    directory that exists: a path on a disk that is not mounted (``/nvme/tables`` without
    ``/nvme``) must not become a directory on the root disk.

    Raises:
        FileNotFoundError: neither ``path`` nor its parent exists (both named).
    """
    path = Path(path)
    if not path.is_dir():
        if not path.parent.is_dir():
            raise FileNotFoundError(
                f"storage path '{path}': its parent '{path.parent}' does not exist (a disk that "
                "is not mounted?); expected an existing directory, or a new one inside one"
            )
        path.mkdir(exist_ok=True)
    return path


class RowStore:
    """Every row of one table, as records by int64 key (see the module docstring)."""

    def __init__(self, records: RecordArray) -> None:
        self.records = records
        self.record_bytes = records.width
        self.bytes_read = 0
        self.bytes_written = 0

    def read(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The records of ``keys`` (int64 [n], distinct): ``(records [n, record_bytes] uint8,
        present [n] bool)``; an absent key's record is zeros."""
        raise NotImplementedError

    def write(self, keys: torch.Tensor, records: torch.Tensor) -> None:
        """Store ``records`` [n, record_bytes] uint8 as the rows of ``keys`` (distinct)."""
        raise NotImplementedError

    def items(self, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every stored ``(keys, records)``, keys ascending, at most ``chunk_rows`` at a time:
        the table streamed without holding it whole."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget every row."""
        raise NotImplementedError

    def _read_records(self, index: torch.Tensor) -> torch.Tensor:
        raw = self.records.read(index)
        self.bytes_read += raw.numel()
        return raw[:, : self.record_bytes]

    def _write_records(self, index: torch.Tensor, records: torch.Tensor) -> None:
        self.records.write(index, records)
        self.bytes_written += len(index) * self.records.width


class RowBits:
    """One bit per row of ``num_rows``: which rows are set (all clear at first).

    Bit ``r`` is bit ``r % 8`` of byte ``r // 8`` of :attr:`words` (uint8 [ceil(num_rows / 8)]),
    so 20M rows take 2.5 MB."""

    def __init__(self, num_rows: int) -> None:
        self.words = torch.zeros((num_rows + 7) // 8, dtype=torch.uint8)

    def get(self, rows: torch.Tensor) -> torch.Tensor:
        """bool [n]: whether each of ``rows`` (int64 [n]) is set."""
        rows = rows.cpu()
        return (self.words[rows >> 3].long() >> (rows & 7)) & 1 == 1

    def set(self, rows: torch.Tensor) -> None:
        """Set ``rows`` (int64 [n], repeats allowed)."""
        rows = rows.cpu().numpy()
        masks = np.left_shift(1, rows & 7).astype(np.uint8)
        np.bitwise_or.at(self.words.numpy(), rows >> 3, masks)  # repeats OR, never add

    def clear(self) -> None:
        """Clear every row."""
        self.words.zero_()


class FixedStore(RowStore):
    """The rows of a fixed table of ``records.num_records`` rows; key = row number. Which rows
    were written is kept in :attr:`written` (a :class:`RowBits`): only those are read."""

    def __init__(self, records: RecordArray) -> None:
        super().__init__(records)
        self.written = RowBits(records.num_records)

    def read(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = keys.cpu()
        present = self.written.get(keys)
        if bool(present.all()):
            return self._read_records(keys), present
        records = torch.zeros(len(keys), self.record_bytes, dtype=torch.uint8)
        if bool(present.any()):
            records[present] = self._read_records(keys[present])
        return records, present

    def write(self, keys: torch.Tensor, records: torch.Tensor) -> None:
        keys = keys.cpu()
        self.records.reserve(keys[~self.written.get(keys)])
        self._write_records(keys, records)
        self.written.set(keys)

    def items(self, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, self.records.num_records, chunk_rows):
            rows = torch.arange(start, min(start + chunk_rows, self.records.num_records))
            rows = rows[self.written.get(rows)]
            if len(rows):
                yield rows, self._read_records(rows)

    def clear(self) -> None:
        self.records.clear()
        self.written.clear()


class KeyedStore(RowStore):
    """The rows of a dynamic table: any int64 key, its record found through an in-memory index
    (a growing :class:`~recsys.embedding.dynamic.slot_map.SlotMap` and the record of each map slot);
    records are appended, the array doubling when full."""

    def __init__(self, records: RecordArray, name: str) -> None:
        super().__init__(records)
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self.index = SlotMap(1024, UNCAPPED, bucket_size=32, name=self.name, backend="torch")
        self.record_of = torch.full((self.index.capacity,), -1, dtype=torch.int64)
        self.num_stored = 0

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """The record of each key, -1 where absent."""
        slots = self.index.find(keys.cpu())
        return torch.where(slots >= 0, self.record_of[slots.clamp(min=0)], -1)

    def read(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        where = self.find(keys)
        present = where >= 0
        records = torch.zeros(len(keys), self.record_bytes, dtype=torch.uint8)
        if bool(present.any()):
            records[present] = self._read_records(where[present])
        return records, present

    def write(self, keys: torch.Tensor, records: torch.Tensor) -> None:
        keys = keys.cpu()
        where = self.find(keys)
        new = where < 0
        if bool(new.any()):
            where[new] = self._add(keys[new])
        self._write_records(where, records)

    def _add(self, keys: torch.Tensor) -> torch.Tensor:
        """Give new ``keys`` the next records (growing the array), indexed."""
        first = self.num_stored
        self.num_stored += len(keys)
        if self.num_stored > self.records.num_records:
            self.records.grow(max(self.num_stored, 2 * self.records.num_records))
        try:
            self.records.reserve(torch.arange(first, self.num_stored))
        except OSError:
            self.num_stored = first
            raise
        insertion = self.index.insert(keys, torch.ones_like(keys), 0)
        if insertion.moved is not None:
            record_of = torch.full((self.index.capacity,), -1, dtype=torch.int64)
            record_of[insertion.moved[1]] = self.record_of[insertion.moved[0]]
            self.record_of = record_of
        added = torch.arange(first, self.num_stored)
        self.record_of[insertion.slots] = added
        return added

    def items(self, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        keys, slots = self.index.entries()
        order = torch.argsort(keys)
        keys, where = keys[order], self.record_of[slots[order]]
        for start in range(0, len(keys), chunk_rows):
            part = slice(start, start + chunk_rows)
            yield keys[part], self._read_records(where[part])

    def clear(self) -> None:
        self.records.clear()
        self._reset()
