"""Benchmark a tiered recipe end to end: `recsys train` itself on tables larger than RAM.

Runs ``recsys train --config RECIPE`` (default ``configs/dlrm_larger_than_ram.toml``: DLRM, 8
tables of 20M rows at dim 64 on the disk tier, 38.7 GiB of weights and row-wise Adagrad state)
as a subprocess, exactly as a user would, and appends one row to
``benchmarks/results/tiered.csv`` (the columns of ``benchmarks/tiered.py``) from what the run
itself logged and what the kernel measured:

- ``peak_rss_gib``: the run's peak resident memory (``ru_maxrss`` of the child, as
  ``/usr/bin/time -v`` reports it), checked against ``--rss-budget-gib`` (4): over it, the row is
  written and the script exits with status 1;
- ``logical_gib``: rows x (weights + optimizer state) of the tiered tables, from the run's
  resolved config, and the RAM of this machine in the notes;
- ``step_ms_p50/p20/p80``: over the train log windows (batch / samples per second; evaluation
  and checkpoints excluded, as the run reports them);
- ``hit_rate``, ``fetched_per_step``, ``initialized_per_step``, ``written_back_per_step``,
  ``prefetch_wait_ms_per_step``: the tiered counters of the run's last log windows (steps
  after the first window), averaged over the tiered tables;
- ``disk_gib_used``: the blocks allocated by the tiered tables' files after the run (``du``);
- ``auc``: the run's test AUC (the notes give the oracle's).

With ``--curve``, each validation of the run (``train.eval_every_steps``) is also a row of
``benchmarks/results/auc_curve.csv``: step, samples seen, valid AUC and logloss, and the AUC of
the synthetic data's teacher on the same samples (the oracle), so the learning curve of a bounded
run stands beside what the data allows.

``--from-run RUN_DIR`` writes only those rows, from a run directory that exists (a run cut
short, e.g. by SIGTERM, keeps the validations it made).

Run: ``python -m benchmarks.tiered_train [--config RECIPE] [--dir DIR] [-- extra overrides]``
(``--dir``: where the run directory goes, on a local disk with room for the touched rows; a
temporary directory, removed after, by default).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._harness import append_csv, environment, load_note
from benchmarks.tiered import COLUMNS, GIB, TOPIC, _format
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.models import table_configs
from recsys.train.metrics import read_metrics

RECIPE = "configs/dlrm_larger_than_ram.toml"
CURVE_COLUMNS = (
    *("case", "step", "samples_seen", "valid_samples", "auc", "logloss", "oracle_auc"),
    *("device", "versions", "commit", "timestamp", "notes"),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=RECIPE, help="the recipe to train")
    parser.add_argument("--dir", default=None, help="parent of the run directory")
    parser.add_argument("--rss-budget-gib", type=float, default=4.0)
    parser.add_argument("--case", default="recipe_larger_than_ram", help="the row's case name")
    parser.add_argument(
        "--curve", action="store_true", help="also write the validations to auc_curve.csv"
    )
    parser.add_argument(
        "--from-run",
        default=None,
        help="write only the auc_curve.csv rows of this existing run directory (a run cut "
        "short keeps its validations); nothing is trained",
    )
    parser.add_argument("--note", default="", help="text added to the rows' notes")
    parser.add_argument("overrides", nargs="*", help="--section.key=value for recsys train")
    return parser.parse_args()


def tiered_tables(config) -> list[tuple[str, int, int]]:
    """(name, rows, bytes per row) of the recipe's tiered tables."""
    spec = build_dataset(config.data, config.run.seed).spec
    tables = table_configs(spec.sparse_names, spec.cardinalities, config.model.embedding_dim)
    state = (
        4
        if config.train.embedding_optimizer == "rowwise_adagrad"
        else 4
        * (config.model.embedding_dim * (2 if config.train.embedding_optimizer == "adam" else 1))
    )
    assert config.model.storage.tier != "device", "the recipe has no tiered table"
    record = config.model.embedding_dim * 4 + state
    return [
        (t.name, t.num_embeddings, record)
        for t in tables
        if t.num_embeddings >= config.model.storage.min_rows
    ]


def allocated_bytes(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*.rows"))


def main() -> None:
    args = parse_args()
    if args.from_run:
        write_curve_of(args)
        return
    parent = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_tiered_train_"))
    run_dir = parent / "run"
    overrides = [*args.overrides, f"--run.dir={run_dir}", "--train.progress_bar=false"]
    config = load_config(args.config, overrides)
    tables = tiered_tables(config)
    logical = sum(rows * record for _, rows, record in tables)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    env = environment(torch.device("cpu"))
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    print(f"{len(tables)} tiered tables, {logical / GIB:.1f} GiB ({logical / ram:.2f}x RAM)")
    command = [sys.executable, "-m", "recsys", "train", "--config", args.config, *overrides]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, check=False)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB
        if done.returncode != 0:
            raise SystemExit(f"recsys train exited with {done.returncode}")
        row = row_of(args, config, run_dir, tables, logical, ram, peak, seconds)
        curve = curve_of(args, config, run_dir)
    finally:
        if not args.dir:
            shutil.rmtree(parent, ignore_errors=True)
    lines = [[_format({**env, **row}.get(c, "")) for c in COLUMNS]]
    path = append_csv(TOPIC, COLUMNS, lines)
    print(json.dumps(row, indent=1))
    print(f"1 row appended to {path}")
    if args.curve:
        points = [[_format({**env, **point}.get(c, "")) for c in CURVE_COLUMNS] for point in curve]
        print(f"{len(points)} row(s) appended to {append_csv('auc_curve', CURVE_COLUMNS, points)}")
    if peak > args.rss_budget_gib:
        raise SystemExit(f"FAILED: peak RSS {peak:.2f} GiB is over {args.rss_budget_gib} GiB")


def row_of(args, config, run_dir, tables, logical, ram, peak, seconds) -> dict:
    events = read_metrics(run_dir / "metrics.jsonl")
    windows = [e for e in events if e["split"] == "train"]
    (test,) = [e for e in events if e["split"] == "test"]
    batch = config.train.batch_size
    step_ms = sorted(1e3 * batch / e["samples_per_s"] for e in windows[1:] or windows)
    later = windows[1:] or windows
    names = [name for name, _, _ in tables]

    def mean(field: str) -> float:
        return statistics.fmean(e[f"tiered/{n}/{field}"] for e in later for n in names)

    cache_rows = sum(int(windows[-1][f"tiered/{n}/cache_rows"]) for n in names)
    steps = windows[-1]["step"]
    row = {
        "case": args.case,
        "tier": config.model.storage.tier,
        "tables": (
            f"{len(tables)}x{tables[0][1]}xD{config.model.embedding_dim}"
            if len({rows for _, rows, _ in tables}) == 1
            else f"{len(tables)} tables of {'/'.join(str(r) for _, r, _ in tables)} rows, D"
            f"{config.model.embedding_dim}"
        ),
        "rows_total": sum(rows for _, rows, _ in tables),
        "logical_gib": logical / GIB,
        "cache_fraction": cache_rows / sum(rows for _, rows, _ in tables),
        "cache_rows": cache_rows,
        "batch": batch,
        "steps": steps,
        "step_ms_p50": statistics.median(step_ms),
        "step_ms_p20": step_ms[int(0.2 * (len(step_ms) - 1))],
        "step_ms_p80": step_ms[int(0.8 * (len(step_ms) - 1))],
        "hit_rate": mean("hit_rate"),
        "fetched_per_step": mean("fetched_per_step"),
        "initialized_per_step": mean("initialized_per_step"),
        "written_back_per_step": mean("written_back_per_step"),
        "prefetch_wait_ms_per_step": mean("prefetch_wait_ms_per_step"),
        "disk_gib_used": allocated_bytes(Path(config.model.storage.path or run_dir / "tables"))
        / GIB,
        "peak_rss_gib": peak,
        "rss_budget_gib": args.rss_budget_gib,
        "auc": test["auc"],
    }
    row["notes"] = (
        f"`recsys train --config {args.config}` {' '.join(args.overrides)}".rstrip()
        + f" (peak RSS = ru_maxrss of the run's process); logical tables {logical / GIB:.1f} GiB "
        f"= {logical / ram:.2f}x this machine's {ram / GIB:.1f} GiB of RAM; step time over "
        f"{len(step_ms)} train log windows after the first; test oracle AUC "
        f"{test.get('oracle_auc', float('nan')):.4f}; wall {seconds:.0f} s for the whole run "
        f"(data, {steps} steps, evaluations, final checkpoint); {load_note()}"
    )
    return row


def write_curve_of(args) -> None:
    """``--from-run``: the curve rows of an existing run, its resolved config read back."""
    run_dir = Path(args.from_run)
    config = load_config(run_dir / "config.toml")
    env = environment(torch.device("cpu"))
    curve = curve_of(args, config, run_dir)
    for point in curve:
        point["notes"] += f"; read back from the run directory {run_dir} (--from-run)"
        point["notes"] += f"; {args.note}" if args.note else ""
    points = [[_format({**env, **point}.get(c, "")) for c in CURVE_COLUMNS] for point in curve]
    print(f"{len(points)} row(s) appended to {append_csv('auc_curve', CURVE_COLUMNS, points)}")


def curve_of(args, config, run_dir) -> list[dict]:
    """One point per validation of the run: samples seen (steps x batch x ranks, as the run
    counts them), valid AUC / logloss and the oracle's AUC on the same samples."""
    events = read_metrics(run_dir / "metrics.jsonl")
    notes = f"`recsys train --config {args.config}` {' '.join(args.overrides)}".rstrip()
    batch = config.train.batch_size
    return [
        {
            "case": args.case,
            "step": e["step"],
            "samples_seen": e["step"] * batch,
            "valid_samples": config.data.synthetic.num_valid_samples,
            "auc": e["auc"],
            "logloss": e["logloss"],
            "oracle_auc": e.get("oracle_auc", float("nan")),
            "notes": notes,
        }
        for e in events
        if e["split"] == "valid"
    ]


if __name__ == "__main__":
    main()
