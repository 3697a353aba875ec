"""Benchmark the disk-store candidates of a dynamic tiered table: RocksDB, LMDB, a slot file.

A dynamic table's disk tier maps int64 keys (hashes, negative ones included) to one fixed-size
record per key: the row's weights and its optimizer state side by side (dim 64 fp32 +
RowWiseAdagrad's one fp32 = 260 bytes; dim 16 = 68 bytes). Per training step the cache reads the
U distinct keys it misses (``get``; some never stored: absent) and writes back the dirty rows it
evicts (``put``). Every candidate runs the same keys and values, end to end from numpy arrays to
numpy arrays (key encoding, sorting and decoding included), in a subprocess of its own so that
its peak RSS is its own:

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

Cases: N = 2M and 8M stored keys (``--num-keys``; ``--quick``: 200k), records of 68 and 260
bytes (``--record-bytes``). Ops (rows): ``put_bulk``, the fill of the N keys in batches of
``--fill-batch`` (65536; p50 of a batch, keys/s over the whole fill including the final flush
to disk); ``get``, batches of ``--batch`` (8192) distinct keys, 90% stored keys drawn Zipf(1.05)
over the N keys (hottest ranks spread over the fill order at random) and 10% absent keys;
``put``, batches of ``--batch`` distinct stored keys drawn the same way, new values;
``get_cold``: ``get`` after the store was flushed, closed, its files' pages dropped from the
page cache (``fsync`` + ``posix_fadvise(DONTNEED)``, which needs no root) and reopened; one
pass over ``--cold-batches`` fresh batches, no warm-up (later batches find pages the earlier
ones read). ``get`` and ``put`` run on a warm page cache (the files were just written and fit
in RAM; the notes give the share of them cached before the first call, which is below 100%
where other processes pressed on memory). The worker checks that gets return what was put and
report absent keys as absent.

Columns: ``disk_mb`` the MiB the store's directory occupies after the fill (allocated blocks,
as ``du``); ``peak_rss_mb`` the growth of the worker's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` once the workload is generated) over the whole run of that store and
case (mmapped file pages count: the kernel can reclaim them); the notes split the RSS growth at
the end into anonymous and file-backed parts.

Run: ``python scripts/bench_kv_store.py [--quick] [--stores ...] [--dir /tmp]`` (about 10
minutes by default on one core); rows go to ``benchmarks/results/kv_store.csv`` (its own
columns; device, versions and commit from ``scripts/_harness.py``). A store whose package is
not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from _harness import (
    Timing,
    append_csv,
    environment,
    format_table,
    load_note,
    summarize,
    time_fn,
)

TOPIC = "kv_store"
STORES = ("rocksdict", "lmdb", "slot_file")
PACKAGES = {"rocksdict": "rocksdict", "lmdb": "lmdb", "slot_file": None}
MODULES = {"rocksdict": "rocksdict", "lmdb": "lmdb", "slot_file": "recsys.embedding.slot_map"}
COLUMNS = tuple(
    "store op num_keys record_bytes batch p50_ms p20_ms p80_ms repeats keys_per_s disk_mb "
    "peak_rss_mb device versions commit timestamp notes".split()
)
NUMBERS = {"p50_ms": ".4f", "p20_ms": ".4f", "p80_ms": ".4f", "keys_per_s": ".0f"}
NUMBERS |= {"disk_mb": ".1f", "peak_rss_mb": ".1f"}
SIGN_BIT = np.uint64(1 << 63)
LOWEST_KEY = -(2**63) + 2  # SlotMap reserves the two smallest int64 values
MIB = 1 << 20
LMDB_OPTIONS = {"writemap": True, "sync": False, "metasync": False, "readahead": False}


# ---------------------------------------------------------------------------------------------
# stores: put(keys [U] int64, values [U, R] uint8); get(keys) -> (values [U, R], found [U] bool)


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
    """RocksDB through rocksdict (options in the module docstring).

    Every store takes (directory, record_bytes, num_keys: the keys it will hold, which only LMDB
    uses, to size its map) and has put, get, flush, reopen_cold (close, drop the page cache,
    reopen), close and describe (a note on its state).
    """

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
        from recsys.embedding.slot_map import SlotMap

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


# ---------------------------------------------------------------------------------------------
# workload


def zipf_ranks(count: int, num_keys: int, exponent: float, rng: np.random.Generator):
    """``count`` int64 ranks in [0, num_keys), P(r) ~ (r + 1)^-exponent (continuous inverse CDF,
    exponent != 1)."""
    u = rng.random(count)
    top = (num_keys + 1.0) ** (1.0 - exponent) - 1.0
    x = (1.0 + u * top) ** (1.0 / (1.0 - exponent))
    return np.minimum(np.floor(x).astype(np.int64) - 1, num_keys - 1)


def distinct_zipf_ranks(count: int, num_keys: int, exponent: float, rng: np.random.Generator):
    """``count`` distinct Zipf ranks: the first distinct ones of as many draws as it takes."""
    draws = count
    while True:
        ranks = zipf_ranks(draws, num_keys, exponent, rng)
        _, first = np.unique(ranks, return_index=True)
        if len(first) >= count:
            return ranks[np.sort(first)[:count]]
        draws *= 2


class Workload:
    """The keys and values every store of one case sees (same seed, same arrays).

    ``stored`` [N]: the keys in fill order; ``hot`` [N]: stored keys by popularity rank;
    ``get_batches`` / ``cold_batches`` / ``put_batches``: lists of [U] distinct key arrays;
    ``put_values``: a few [U, R] value arrays the puts cycle through; ``absent_check`` [U]
    keys never stored.
    """

    def __init__(self, args: argparse.Namespace, num_keys: int, record_bytes: int) -> None:
        if args.batch > num_keys:
            raise ValueError(f"--batch={args.batch}; expected <= the stored keys N={num_keys}")
        rng = np.random.default_rng(args.seed)
        batch, num_absent = args.batch, args.batch - int(0.9 * args.batch)
        num_gets = args.get_batches + args.cold_batches
        pool_size = num_keys + num_absent * num_gets + batch
        pool = np.unique(rng.integers(LOWEST_KEY, 2**63 - 1, int(pool_size * 1.01) + 16))
        pool = rng.permutation(pool)[:pool_size]
        self.stored = pool[:num_keys]
        absent = pool[num_keys:]
        self.hot = self.stored[rng.permutation(num_keys)]
        gets = []
        for b in range(num_gets):
            ranks = distinct_zipf_ranks(batch - num_absent, num_keys, args.zipf, rng)
            fresh = absent[b * num_absent : (b + 1) * num_absent]
            gets.append(rng.permutation(np.concatenate([self.hot[ranks], fresh])))
        self.get_batches, self.cold_batches = gets[: args.get_batches], gets[args.get_batches :]
        self.absent_check = absent[num_gets * num_absent :]
        self.put_batches = [
            rng.permutation(self.hot[distinct_zipf_ranks(batch, num_keys, args.zipf, rng)])
            for _ in range(args.put_batches)
        ]
        self.put_values = [random_rows(rng, batch, record_bytes) for _ in range(4)]
        self.rng = rng


def random_rows(rng: np.random.Generator, count: int, record_bytes: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(count * record_bytes), np.uint8).reshape(count, record_bytes)


# ---------------------------------------------------------------------------------------------
# worker: one store, one case, in its own process


def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def disk_bytes(directory: str) -> int:
    """Allocated bytes of every file under ``directory`` (as ``du``: sparse holes excluded)."""
    total = 0
    for root, _, files in os.walk(directory):
        total += sum(os.stat(os.path.join(root, name)).st_blocks * 512 for name in files)
    return total


def resident_bytes(directory: str) -> int:
    """Bytes of ``directory``'s files in the page cache (util-linux ``fincore``), -1 without
    it."""
    paths = [os.path.join(root, name) for root, _, files in os.walk(directory) for name in files]
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return -1
    return sum(int(line) for line in out.split())


def cached_share(directory: str) -> float:
    """Share of the allocated bytes of ``directory``'s files that the page cache holds (nan
    without ``fincore``)."""
    resident = resident_bytes(directory)
    return resident / max(disk_bytes(directory), 1) if resident >= 0 else float("nan")


def check_get(store, keys: np.ndarray, expected: np.ndarray | None, what: str) -> None:
    """Fail unless ``store.get(keys)`` finds every key with ``expected`` rows (None: finds
    none)."""
    values, found = store.get(keys)
    if expected is None:
        if found.any():
            raise SystemExit(f"{what}: {int(found.sum())} never-stored keys reported found")
    elif not found.all() or not np.array_equal(values, expected):
        raise SystemExit(f"{what}: {int((~found).sum())} missing or wrong rows")


def fill(store, work: Workload, args: argparse.Namespace, record_bytes: int) -> dict:
    """Put the N stored keys in batches; time each put call, then the flush."""
    first_rows, times_ms = None, []
    cpu_start = time.process_time()
    for start in range(0, len(work.stored), args.fill_batch):
        keys = work.stored[start : start + args.fill_batch]
        rows = random_rows(work.rng, len(keys), record_bytes)
        first_rows = rows if first_rows is None else first_rows
        began = time.perf_counter()
        store.put(keys, rows)
        times_ms.append((time.perf_counter() - began) * 1e3)
    began = time.perf_counter()
    store.flush()
    flush_s = time.perf_counter() - began
    total_s = sum(times_ms) / 1e3 + flush_s
    cpu_s = time.process_time() - cpu_start
    check_get(store, work.stored[: len(first_rows)], first_rows, "after the fill")
    check_get(store, work.absent_check, None, "absent keys")
    timing = summarize(times_ms)
    return {
        "op": "put_bulk",
        "batch": args.fill_batch,
        "timing": timing,
        "keys_per_s": len(work.stored) / total_s,
        "notes": f"fill {total_s:.1f} s incl. flush {flush_s:.1f} s; process CPU {cpu_s:.1f} s "
        "(all threads, background compaction included)",
    }


def time_calls(fn: Callable[[int], object], args: argparse.Namespace) -> Timing:
    """p20 / p50 / p80 of ``fn(i)`` over ``args.repeats`` calls after ``args.warmup`` untimed
    ones (``i`` counts the calls)."""
    calls = iter(range(args.warmup + args.repeats))
    return time_fn(
        lambda: fn(next(calls)),
        torch.device("cpu"),
        warmup=args.warmup,
        repeats=args.repeats,
        min_time_s=0.0,
        max_repeats=args.repeats,
    )


def timed_ops(store, work: Workload, args: argparse.Namespace) -> list[dict]:
    """Warm get, put, then cold get (after a page-cache drop and reopen)."""
    cached = {"get": cached_share(args.case_dir)}
    get = time_calls(lambda i: store.get(work.get_batches[i % len(work.get_batches)]), args)
    written = []

    def put(i: int) -> None:
        keys = work.put_batches[i % len(work.put_batches)]
        values = work.put_values[i % len(work.put_values)]
        store.put(keys, values)
        written[:] = [keys, values]

    cached["put"] = cached_share(args.case_dir)
    put_timing = time_calls(put, args)
    check_get(store, written[0], written[1], "after the puts")
    store.reopen_cold(args.case_dir)
    resident = resident_bytes(args.case_dir)
    cold_ms = []
    for keys in work.cold_batches:
        began = time.perf_counter()
        store.get(keys)
        cold_ms.append((time.perf_counter() - began) * 1e3)
    warm = "warm: files just written, page cache held {:.0%} of them before the first call"
    cold = f"after fsync + fadvise(DONTNEED) + reopen: {resident / MIB:.1f} MiB resident; "
    cold += "one pass, no warm-up"
    get_notes = warm.format(cached["get"]) + "; 10% absent keys"
    return [
        {"op": "get", "batch": args.batch, "timing": get, "notes": get_notes},
        {
            "op": "put",
            "batch": args.batch,
            "timing": put_timing,
            "notes": warm.format(cached["put"]),
        },
        {"op": "get_cold", "batch": args.batch, "timing": summarize(cold_ms), "notes": cold},
    ]


def run_worker(args: argparse.Namespace) -> None:
    """Run one (store, N, R) case and print its rows as one JSON line."""
    torch.set_num_threads(args.threads)
    # imported before the RSS baseline: libraries are not the store's memory
    importlib.import_module(MODULES[args.worker])
    num_keys, record_bytes = args.worker_num_keys, args.worker_record_bytes
    work = Workload(args, num_keys, record_bytes)
    args.case_dir = tempfile.mkdtemp(prefix=f"kv_{args.worker}_", dir=args.dir)
    try:
        reset_ok = reset_peak_rss()
        start_kb = {field: proc_status_kb(field) for field in ("VmRSS", "RssAnon", "RssFile")}
        store = STORE_CLASSES[args.worker](args.case_dir, record_bytes, num_keys)
        results = [fill(store, work, args, record_bytes)]
        disk = disk_bytes(args.case_dir)
        described = store.describe()
        results += timed_ops(store, work, args)
        anon_kb = proc_status_kb("RssAnon") - start_kb["RssAnon"]
        file_kb = proc_status_kb("RssFile") - start_kb["RssFile"]
        peak_kb = proc_status_kb("VmHWM") - start_kb["VmRSS"]
        store.close()
    finally:
        shutil.rmtree(args.case_dir, ignore_errors=True)
    logical = num_keys * (8 + record_bytes)
    common = (
        f"{described}; disk {disk / logical:.2f}x the {logical / MIB:.0f} MiB of keys + records;"
        f" RSS growth at the end: anon {anon_kb / 1024:.0f} MiB, file-backed (mmapped pages)"
        f" {file_kb / 1024:.0f} MiB"
        + ("" if reset_ok else "; VmHWM not reset: peak may include workload generation")
    )
    for result in results:
        timing = result.pop("timing")
        result.setdefault("keys_per_s", result["batch"] / (timing.p50_ms * 1e-3))
        result.update(dataclasses.asdict(timing), disk_mb=disk / MIB, peak_rss_mb=peak_kb / 1024)
        result["notes"] += f"; {common}"
    print("RESULT " + json.dumps(results))


# ---------------------------------------------------------------------------------------------
# parent: one worker per (case, store), rows to the CSV


def filesystem_of(path: str) -> str:
    """``device fstype`` of the mount holding ``path``, from /proc/mounts."""
    path, best = os.path.realpath(path), ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if path.startswith(mount) and len(mount) > len(best[0]):
                    best = (mount, device, fstype)
    except OSError:
        pass
    return f"{best[1]} {best[2]}"


def store_versions() -> str:
    """numpy and the candidates' package versions (``absent`` when not installed)."""
    found = [f"numpy={np.__version__}"]
    for package in ("rocksdict", "lmdb"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        found.append(f"{package}={version}")
    return " ".join(found)


def worker_command(args: argparse.Namespace, store: str, num_keys: int, record_bytes: int):
    command = [sys.executable, __file__, "--worker", store]
    command += ["--worker-num-keys", str(num_keys), "--worker-record-bytes", str(record_bytes)]
    for option in ("batch", "fill_batch", "get_batches", "put_batches", "cold_batches"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for option in ("zipf", "seed", "warmup", "repeats", "threads", "dir"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    return command


def run_case(args, store: str, num_keys: int, record_bytes: int) -> list[dict]:
    """One worker's rows, or a row whose notes hold the failure."""
    started = time.perf_counter()
    done = subprocess.run(
        worker_command(args, store, num_keys, record_bytes), capture_output=True, text=True
    )
    print(f"  {store} N={num_keys} R={record_bytes}: {time.perf_counter() - started:.0f} s")
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            results = json.loads(line[len("RESULT ") :])
            break
    else:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  FAILED: {error}")
        results = [dict.fromkeys(NUMBERS, float("nan"))]
        results[0].update(op="failed", batch=args.batch, repeats=0, notes=f"failed: {error}")
    for result in results:
        result.update(store=store, num_keys=num_keys, record_bytes=record_bytes)
    return results


def write_csv(results: list[dict], env: dict[str, str], out_dir: Path | None) -> Path:
    """Append rows to ``<results dir>/kv_store.csv`` (see ``_harness.append_csv``)."""
    lines = []
    for result in results:
        row = {**env, **result}
        lines.append([format(row[c], NUMBERS[c]) if c in NUMBERS else row[c] for c in COLUMNS])
    return append_csv(TOPIC, COLUMNS, lines, out_dir)


def print_results(results: list[dict]) -> None:
    header = ["store", "op", "N", "R", "batch", "p50 ms", "keys/s", "disk MiB", "peak RSS MiB"]
    fields = ("store", "op", "num_keys", "record_bytes", "batch")
    shown = ("p50_ms", "keys_per_s", "disk_mb", "peak_rss_mb")
    lines = [[*(r[f] for f in fields), *(f"{r[f]:{NUMBERS[f]}}" for f in shown)] for r in results]
    print(format_table(header, lines))


def run_parent(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.device != "cpu":
        print(f"--device {args.device}: the stores live on the host; measuring there")
    stores = []
    for store in args.stores:
        package = PACKAGES[store]
        if package and importlib.util.find_spec(package) is None:
            print(f"skipping {store}: package {package!r} not installed (pip install {package})")
        else:
            stores.append(store)
    num_keys = args.num_keys or ([200_000] if args.quick else [2 << 20, 8 << 20])
    env = environment(torch.device("cpu"))
    env["versions"] += " " + store_versions()
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    where = f"dir={args.dir} ({filesystem_of(args.dir)})"
    results = []
    for n in num_keys:
        for record_bytes in args.record_bytes:
            for store in stores:
                for result in run_case(args, store, n, record_bytes):
                    result["notes"] = f"{result['notes']}; {where}; {load_note()}"
                    results.append(result)
    print_results(results)
    path = write_csv(results, env, args.out_dir)
    print(f"\n{len(results)} rows appended to {path}")
    if any(r["op"] == "failed" for r in results):
        raise SystemExit("some stores failed: see the rows with op=failed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--stores", nargs="+", choices=STORES, default=list(STORES))
    add("--num-keys", type=int, nargs="+", default=None, help="N (default 2M 8M; quick 200k)")
    add("--record-bytes", type=int, nargs="+", default=[68, 260], help="bytes per record")
    add("--quick", action="store_true", help="N = 200k: a smoke run of about half a minute")
    add("--full", action="store_true", help="the default sizes (accepted for make bench)")
    add("--device", default="cpu", help="accepted for gpu_check.sh; the stores are on the host")
    add("--batch", type=int, default=8192, help="U: distinct keys per get / put call")
    add("--fill-batch", type=int, default=65536, help="keys per put call of the fill")
    add("--get-batches", type=int, default=48, help="distinct get batches (cycled)")
    add("--put-batches", type=int, default=48, help="distinct put batches (cycled)")
    add("--cold-batches", type=int, default=8, help="get batches after the page-cache drop")
    add("--zipf", type=float, default=1.05, help="Zipf exponent of the stored keys (!= 1)")
    add("--warmup", type=int, default=3, help="untimed get / put calls")
    add("--repeats", type=int, default=30, help="timed get / put calls")
    add("--threads", type=int, default=1, help="torch threads (the slot file's index)")
    add("--seed", type=int, default=0)
    add("--dir", default=tempfile.gettempdir(), help="local-disk directory for the store files")
    add("--out-dir", type=Path, default=None, help="results directory")
    add("--worker", choices=STORES, default=None, help=argparse.SUPPRESS)
    add("--worker-num-keys", type=int, default=0, help=argparse.SUPPRESS)
    add("--worker-record-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for option in ("batch", "fill_batch", "get_batches", "put_batches", "cold_batches", "repeats"):
        if getattr(args, option) < 1:
            raise ValueError(f"--{option.replace('_', '-')}={getattr(args, option)}; expected >= 1")
    for value in (args.num_keys or []) + args.record_bytes:
        if value < 1:
            raise ValueError(f"--num-keys / --record-bytes value {value}; expected >= 1")
    if args.zipf == 1.0:
        raise ValueError("--zipf=1.0; expected an exponent other than 1 (e.g. 1.05)")
    return args


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        run_worker(parsed)
    else:
        run_parent(parsed)
