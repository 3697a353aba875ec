"""Benchmark ``recsys preprocess --preprocess.encoding=mlperf``: Criteo 1TB day files into MLPerf
DLRM-DCNv2's multi-hot data, at MLPerf's table sizes.

Runs ``recsys preprocess`` as a subprocess, as a user would, on a generated train day of
``--lines`` lines and a day 23 of a tenth of that (Criteo 1TB's format: a label, 13 counts, 26
categories of 8 hex digits drawn with a Zipf skew, some fields missing), and appends one row to
``benchmarks/results/mlperf_preprocess.csv``:

- ``tables_gb``, ``tables_s``: the reference's one-hot -> multi-hot lookup tables, drawn to disk
  (int32) in the order the reference draws them, and the seconds that took (from the run's
  ``metadata.json``); a one-time cost per run, whatever the input;
- ``lines_per_s``: input lines over the rest of the time the run reports (read, validate,
  number the ids, look the bags up, write parquet); ``wall_s`` adds the process start;
- ``peak_rss_gib``: ``ru_maxrss`` of the run's process; ``output_gib``: the parquet written.

The reference itself (``materialize_synthetic_multihot_dataset.py``) draws its tables as int64
numpy arrays in memory, 2x ``tables_gb`` before its int32 copies, so at MLPerf's sizes it needs
a machine with far more RAM than this one; there is no peer row.

Run: ``python -m benchmarks.mlperf_preprocess --full`` (MLPerf's tables, 200k lines; ``--quick``,
the default on CPU: tables capped at 1M rows, 20k lines) ``[--dir DIR]`` (a temporary directory
by default, removed after).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import add_common_args, append_csv, environment, is_quick, load_note
from recsys.config.sections import MLPERF_BAG_SIZES, MLPERF_TABLE_ROWS

TOPIC = "mlperf_preprocess"
COLUMNS = (
    *("case", "lines", "table_rows", "tables_gb", "tables_s", "lines_per_s", "wall_s"),
    *("peak_rss_gib", "output_gib", "device", "versions", "commit", "timestamp", "notes"),
)
GIB = 1 << 30


def write_day(path: Path, lines: int, seed: int) -> None:
    """A Criteo 1TB day file of ``lines`` lines (see the module docstring)."""
    rng = np.random.default_rng(seed)
    columns = [np.where(rng.random(lines) < 0.25, "1", "0")]
    for _ in range(13):
        counts = rng.geometric(0.05, lines) - 3
        columns.append(np.where(rng.random(lines) < 0.1, "", counts.astype(str)))
    for column in range(26):
        ranks = rng.zipf(1.1, lines).astype(np.uint64) + np.uint64(column << 40)
        values = (ranks * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
        hexed = np.char.mod("%08x", values)
        columns.append(np.where(rng.random(lines) < 0.05, "", hexed))
    with open(path, "w") as out:
        out.writelines("\t".join(row) + "\n" for row in zip(*columns, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--lines", type=int, default=None, help="train lines (200k; quick 20k)")
    parser.add_argument("--dir", default=None, help="work directory (kept)")
    args = parser.parse_args()
    quick = is_quick(args)
    lines = args.lines or (20_000 if quick else 200_000)
    rows = [min(r, 1_000_000) for r in MLPERF_TABLE_ROWS] if quick else list(MLPERF_TABLE_ROWS)
    env = environment(torch.device("cpu"))
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_mlperf_prep_"))
    try:
        (work / "raw").mkdir(parents=True, exist_ok=True)
        write_day(work / "raw" / "day_0", lines, 0)
        write_day(work / "day_23", lines // 10, 23)
        command = [
            *(sys.executable, "-m", "recsys", "preprocess", "--format", "criteo"),
            *("--input", str(work / "raw"), "--valid", str(work / "day_23")),
            *("--output", str(work / "out"), "--preprocess.encoding=mlperf"),
            f"--preprocess.mlperf_table_rows={rows}",
            "--preprocess.overwrite=true",
        ]
        load = load_note()
        start = time.perf_counter()
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - start
        print(done.stdout, end="")
        seconds = float(
            re.search(
                r"^recsys: preprocessed into .* in ([0-9.]+) s", done.stdout, re.MULTILINE
            ).group(1)
        )
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB
        metadata = json.loads((work / "out" / "metadata.json").read_text())
        drawn = metadata["mlperf"]["lookup_tables"]
        output = sum(p.stat().st_size for p in (work / "out").rglob("*.parquet"))
        total_lines = lines + lines // 10
        row = {
            "case": "quick_tables_capped_1M" if quick else "mlperf_full_tables",
            "lines": total_lines,
            "table_rows": sum(rows),
            "tables_gb": drawn["bytes"] / 1e9,
            "tables_s": drawn["seconds"],
            "lines_per_s": total_lines / (seconds - drawn["seconds"]),
            "wall_s": wall,
            "peak_rss_gib": peak,
            "output_gib": output / GIB,
            "notes": f"bags of {sum(MLPERF_BAG_SIZES)} ids a line (MLPerf's sizes); generated "
            f"Criteo 1TB lines (Zipf 1.1 categories); {load}",
        }
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    values = {**env, **row}
    line = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in (values[c] for c in COLUMNS)]
    print(json.dumps(row, indent=1))
    print(f"1 row appended to {append_csv(TOPIC, COLUMNS, [line], args.out_dir)}")


if __name__ == "__main__":
    main()
