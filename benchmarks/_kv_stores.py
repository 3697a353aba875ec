"""The disk-store candidates of a dynamic tiered table, as ``benchmarks/kv_store.py`` measures
them: each maps int64 keys to one fixed-size record per key.

Every store takes ``(directory, record_bytes, num_keys)`` (``num_keys``: the keys it will hold,
which only LMDB uses, to size its map) and has ``put(keys [U] int64, values [U, R] uint8)``,
``get(keys) -> (values [U, R] uint8, found [U] bool)`` (an absent key's values are zeros),
``flush``, ``reopen_cold`` (close, drop the files' pages from the page cache, reopen), ``close``
and ``describe`` (a note on its state). Options:

- ``rocksdict`` (RocksDB; ``pip install rocksdict``): raw mode, keys 8-byte big-endian with the
  sign bit flipped (byte order = numeric order), ``Rdict.get(list)`` for a batched get (RocksDB
  MultiGet), a ``WriteBatch`` per put with ``WriteOptions.disable_wal = True`` (the checkpoint,
  not the store, makes rows durable), no compression (weights do not compress), bloom filter 10
  bits/key, 64 MiB block cache, 2 background jobs (RocksDB's default; its compactions run on
  them, outside the timed calls, and show in the fill's CPU seconds).
- ``lmdb`` (``pip install lmdb``): the same key bytes, ``map_size`` the power of two above 16x
  the data (address space only: the file is sparse), ``writemap=True``, ``sync=False``,
  ``metasync=False``, ``readahead=False`` (random reads); ``Cursor.getmulti`` in a read
  transaction, ``putmulti`` in one write transaction per batch.
- ``slot_file``: our own. recsys's ``SlotMap`` (uncapped: ``max_capacity = 2**40``) as the
  in-memory key -> slot index, a ``record_of`` tensor slot -> record (remapped when the map
  grows), records appended in first-write order to one file, mmapped (``MADV_RANDOM``) and read
  / written with numpy fancy indexing in record order.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

__all__ = ["MODULES", "PACKAGES", "STORE_CLASSES", "LmdbStore", "RocksStore", "SlotFileStore"]

# the pip package each store needs (None: recsys only), and the module that loads its library
PACKAGES = {"rocksdict": "rocksdict", "lmdb": "lmdb", "slot_file": None}
MODULES = {
    "rocksdict": "rocksdict",
    "lmdb": "lmdb",
    "slot_file": "recsys.embedding.dynamic.slot_map",
}
SIGN_BIT = np.uint64(1 << 63)
MIB = 1 << 20
LMDB_OPTIONS = {"writemap": True, "sync": False, "metasync": False, "readahead": False}


def encode_keys(keys: np.ndarray) -> list[bytes]:
    """int64 keys as 8-byte big-endian strings whose byte order is the keys' numeric order."""
    packed = (keys.view(np.uint64) ^ SIGN_BIT).astype(">u8").tobytes()
    return [packed[i : i + 8] for i in range(0, len(packed), 8)]


def split_rows(values: np.ndarray) -> list[bytes]:
    """[U, R] uint8 rows as U byte strings."""
    packed, width = values.tobytes(), values.shape[1]
    return [packed[i : i + width] for i in range(0, len(packed), width)]


def drop_page_cache(directory: str) -> None:
    """Write back and evict every file of ``directory`` from the page cache (no root needed)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class RocksStore:
    """RocksDB through rocksdict (options in the module docstring)."""

    def __init__(self, directory: str, record_bytes: int, num_keys: int) -> None:
        import rocksdict

        self.path = os.path.join(directory, "rocksdb")
        self.options = rocksdict.Options(raw_mode=True)
        self.options.create_if_missing(True)
        self.options.set_compression_type(rocksdict.DBCompressionType.none())
        self.options.set_max_background_jobs(2)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_cache(rocksdict.Cache(64 * MIB))
        self.options.set_block_based_table_factory(table)
        self.write_options = rocksdict.WriteOptions()
        self.write_options.disable_wal = True
        self.record_bytes = record_bytes
        self.db = rocksdict.Rdict(self.path, self.options)

    def put(self, keys: np.ndarray, values: np.ndarray) -> None:
        import rocksdict

        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in zip(encode_keys(keys), split_rows(values), strict=True):
            batch.put(key, value)
        self.db.write(batch, self.write_options)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(keys)
        found_values = self.db.get(encode_keys(keys[order]))
        found = np.fromiter((v is not None for v in found_values), bool, len(keys))
        rows = b"".join(v for v in found_values if v is not None)
        values = np.zeros((len(keys), self.record_bytes), np.uint8)
        values[order[found]] = np.frombuffer(rows, np.uint8).reshape(-1, self.record_bytes)
        return values, found[np.argsort(order)]

    def flush(self) -> None:
        self.db.flush(True)

    def reopen_cold(self, directory: str) -> None:
        import rocksdict

        self.db.close()
        del self.db
        drop_page_cache(directory)
        self.db = rocksdict.Rdict(self.path, self.options)

    def close(self) -> None:
        self.db.close()

    def describe(self) -> str:
        files = self.db.property_int_value("rocksdb.num-files-at-level0")
        live = self.db.property_int_value("rocksdb.estimate-live-data-size")
        return f"L0 files={files} live data estimate={live / MIB:.0f} MiB"


class LmdbStore:
    """LMDB through the lmdb package (options in the module docstring)."""

    def __init__(self, directory: str, record_bytes: int, num_keys: int) -> None:
        self.path = os.path.join(directory, "lmdb")
        self.record_bytes = record_bytes
        # address space only (the file is sparse); 16x the data leaves room for copy-on-write
        self.map_size = 1 << max(30, (16 * num_keys * (8 + record_bytes)).bit_length())
        self.env = self._open()

    def _open(self):
        import lmdb

        return lmdb.open(self.path, map_size=self.map_size, **LMDB_OPTIONS)

    def put(self, keys: np.ndarray, values: np.ndarray) -> None:
        order = np.argsort(keys)
        items = zip(encode_keys(keys[order]), split_rows(values[order]), strict=True)
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(items)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(keys)
        with self.env.begin() as txn:
            pairs = txn.cursor().getmulti(encode_keys(keys[order]))
            found_keys = b"".join(key for key, _ in pairs)
            rows = b"".join(value for _, value in pairs)
        # getmulti returns the found keys only, in the order asked: locate them among the asked
        asked = keys[order].view(np.uint64) ^ SIGN_BIT  # ascending, as the key bytes
        at = np.searchsorted(asked, np.frombuffer(found_keys, ">u8").astype(np.uint64))
        found = np.zeros(len(keys), bool)
        found[order[at]] = True
        values = np.zeros((len(keys), self.record_bytes), np.uint8)
        values[order[at]] = np.frombuffer(rows, np.uint8).reshape(-1, self.record_bytes)
        return values, found

    def flush(self) -> None:
        self.env.sync(True)

    def reopen_cold(self, directory: str) -> None:
        self.env.close()
        drop_page_cache(directory)
        self.env = self._open()

    def close(self) -> None:
        self.env.close()

    def describe(self) -> str:
        stat = self.env.stat()
        return f"B-tree depth={stat['depth']} leaf pages={stat['leaf_pages']}"


class SlotFileStore:
    """A SlotMap index in memory over an mmapped file of fixed-size records."""

    def __init__(self, directory: str, record_bytes: int, num_keys: int) -> None:
        from recsys.embedding.dynamic.slot_map import SlotMap

        self.path = os.path.join(directory, "records.bin")
        self.record_bytes = record_bytes
        self.index = SlotMap(1 << 16, 1 << 40, name="kv_store")
        self.record_of = torch.full((self.index.capacity,), -1, dtype=torch.int64)
        self.num_records = 0
        self.step = 0
        self.capacity = 0
        self.file = open(self.path, "w+b")  # noqa: SIM115 (held open for the store's life)
        self.rows = np.zeros((0, record_bytes), np.uint8)  # [capacity, R] view of the mmap
        self.mapping: mmap.mmap | None = None
        self._map(1 << 16)

    def _map(self, capacity: int) -> None:
        """(Re)map the file at ``capacity`` records (growing it sparsely)."""
        if capacity > self.capacity:
            self.file.truncate(capacity * self.record_bytes)
        self.rows = np.zeros((0, self.record_bytes), np.uint8)  # release the old view first
        self.mapping = mmap.mmap(self.file.fileno(), capacity * self.record_bytes)
        self.mapping.madvise(mmap.MADV_RANDOM)
        self.rows = np.frombuffer(self.mapping, np.uint8).reshape(capacity, self.record_bytes)
        self.capacity = capacity

    def put(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.step += 1
        keys_t = torch.from_numpy(keys)
        insertion = self.index.insert(keys_t, torch.ones_like(keys_t), self.step)
        if insertion.moved is not None:  # the map grew: slots changed
            old_slots, new_slots = insertion.moved
            record_of = torch.full((self.index.capacity,), -1, dtype=torch.int64)
            record_of[new_slots] = self.record_of[old_slots]
            self.record_of = record_of
        fresh = insertion.slots[insertion.inserted]
        self.record_of[fresh] = torch.arange(self.num_records, self.num_records + len(fresh))
        self.num_records += len(fresh)
        if self.num_records > self.capacity:
            self._map(max(self.num_records, 2 * self.capacity))
        records = self.record_of[insertion.slots].numpy()
        assert (records >= 0).all(), "an uncapped map admits every key"
        order = np.argsort(records)
        self.rows[records[order]] = values[order]

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = self.index.find(torch.from_numpy(keys))
        records = torch.where(slots >= 0, self.record_of[slots.clamp(min=0)], -1).numpy()
        found = records >= 0
        where = np.flatnonzero(found)
        where = where[np.argsort(records[where])]
        values = np.zeros((len(keys), self.record_bytes), np.uint8)
        values[where] = self.rows[records[where]]
        return values, found

    def flush(self) -> None:
        self.mapping.flush()

    def reopen_cold(self, directory: str) -> None:
        self.close(keep_file=True)
        drop_page_cache(directory)
        self._map(self.capacity)

    def close(self, keep_file: bool = False) -> None:
        self.flush()
        self.rows = np.zeros((0, self.record_bytes), np.uint8)  # the mmap's only view
        self.mapping.close()
        if not keep_file:
            self.file.close()

    def describe(self) -> str:
        index = self.index
        index_bytes = sum(t.nbytes for t in (index.keys, index.scores, index.last_seen))
        index_bytes += self.record_of.nbytes
        return (
            f"index (SlotMap + record_of) in RAM {index_bytes / MIB:.0f} MiB = "
            f"{index_bytes / self.index.size:.0f} B/key (map capacity {self.index.capacity})"
        )


STORE_CLASSES = {"rocksdict": RocksStore, "lmdb": LmdbStore, "slot_file": SlotFileStore}
