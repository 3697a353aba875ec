"""Benchmark the disk-store candidates of a dynamic tiered table: RocksDB, LMDB, a slot file.

A dynamic table's disk tier maps int64 keys (hashes, negative ones included) to one fixed-size
record per key: the row's weights and its optimizer state side by side (dim 64 fp32 +
RowWiseAdagrad's one fp32 = 260 bytes; dim 16 = 68 bytes). Per training step the cache reads the
U distinct keys it misses (``get``; some never stored: absent) and writes back the dirty rows it
evicts (``put``). Every candidate runs the same keys and values, end to end from numpy arrays to
numpy arrays (key encoding, sorting and decoding included), in a subprocess of its own so that
its peak RSS is its own:

- ``rocksdict`` (RocksDB), ``lmdb`` and ``slot_file`` (recsys's ``SlotMap`` over an mmapped
  file of records): the classes and their options are in ``benchmarks/_kv_stores.py``.

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

Run: ``python -m benchmarks.kv_store [--quick] [--stores ...] [--dir /tmp]`` (about 10
minutes by default on one core); rows go to ``benchmarks/results/kv_store.csv`` (its own
columns; device, versions and commit from ``benchmarks/_harness.py``). A store whose package is
not installed is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
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

from benchmarks._harness import (
    Timing,
    append_csv,
    environment,
    format_table,
    load_note,
    summarize,
    time_fn,
)
from benchmarks._kv_stores import MODULES, PACKAGES, STORE_CLASSES

TOPIC = "kv_store"
STORES = tuple(STORE_CLASSES)
COLUMNS = tuple(
    "store op num_keys record_bytes batch p50_ms p20_ms p80_ms repeats keys_per_s disk_mb "
    "peak_rss_mb device versions commit timestamp notes".split()
)
NUMBERS = {"p50_ms": ".4f", "p20_ms": ".4f", "p80_ms": ".4f", "keys_per_s": ".0f"}
NUMBERS |= {"disk_mb": ".1f", "peak_rss_mb": ".1f"}
LOWEST_KEY = -(2**63) + 2  # SlotMap reserves the two smallest int64 values
MIB = 1 << 20


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
    # The worker is this module again; the inherited cwd or PYTHONPATH finds the package.
    command = [sys.executable, "-m", "benchmarks.kv_store", "--worker", store]
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
