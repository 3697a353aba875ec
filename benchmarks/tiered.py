"""Benchmark tiered tables: DLRM over tables larger than RAM, and step time and hit rate at cache
sizes of 1%, 10% and 50% of the rows against the same tables held in memory.

Every case trains ``recsys.models.DLRM`` (bottom MLP 13 -> 128 -> D, dot interaction, top MLP
256 -> 128 -> 1; dense part under Adam, tables under the fused ``RowWiseAdagrad``) on the same
synthetic log, in a subprocess of its own so that its peak RSS (``VmHWM``) is its own. The tiered
cases run :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection` as the trainer
does: ``ebc.prefetch(next batch)`` after each forward, so the next batch's rows are prepared in the
background while this one trains.

Modes:

- ``--sweep`` (default): ``--tables`` (4) tables of ``--rows`` (2M) rows, dim 64 (2.1 GiB of
  weights and RowWiseAdagrad state in all: fits in RAM). ``memory``: the in-memory
  ``EmbeddingBagCollection``; ``host`` and ``disk`` tiers at cache sizes ``--cache-fractions``
  (1%, 10%, 50% of each table's rows). ``--warmup`` (20) untimed steps, then ``--steps`` (100)
  timed ones; the counters are over the timed steps.
- ``--large``: the larger-than-RAM run: ``--large-tables`` (8) tables of ``--large-rows`` (20M)
  rows, dim 64: 160M rows x 260 bytes (256 of weights, 4 of RowWiseAdagrad state) =
  38.7 GiB of logical table, 1.65x this machine's 23.5 GiB of RAM, tier ``disk`` in sparse files
  under ``--dir`` (untouched rows take no disk), a cache of ``--large-cache-fraction`` (1%) of
  each table's rows. ``--large-steps`` (300) steps, the first ``--warmup`` untimed. Its peak RSS
  is checked against ``--rss-budget-gib`` (6): over it, the script says so and exits with
  status 1 (after writing the row).

Data (the same batches for every case of a mode; ``benchmarks/_tiered_data.py``): one id per table
and sample (one-hot, as Criteo), ``--batch`` (4096) samples a step, ids Zipf(``--zipf`` = 1.05)
over each table's rows (the hot rows spread over the table's file), labels from a planted model of
the ids and the 13 dense features. After training, AUC on ``--eval-batches`` (20) held-out
batches of the same distribution (the notes give the planted logit's own AUC on them, the
ceiling: tail ids are seen too rarely to learn).

Columns (besides device, versions, commit, timestamp, notes): ``cache_rows`` summed over the
tables; ``step_ms_*`` percentiles of the timed steps (forward, the prefetch call, backward with
the fused update, the dense optimizer); ``hit_rate`` = hits / lookups (distinct ids per batch and
table; a row's first touch is a miss at any cache size, so the notes also give the hit rate of
rows seen before); ``fetched_per_step`` rows read back from the store, ``initialized_per_step``
rows new to the table (initialized lazily, no read), ``written_back_per_step`` dirty rows written
to the store on eviction, ``prefetch_wait_ms_per_step`` the time forwards waited for their
prefetch (not hidden behind compute); ``disk_gib_used`` the allocated blocks of the case's files
(``du``) after the run; ``peak_rss_gib`` the worker's ``VmHWM``. Sizes are GiB (2**30 bytes).
The disk tier's pages live in the kernel's page cache, which is not the process's RSS (the store
drops its mapping after every call); the notes give the RSS split at the end.

The disk tier's mapping is advised ``MADV_RANDOM`` by recsys itself
(``recsys.embedding.tiered.row_store.DiskRecords``): without it, page faults read around (8 MiB
here) and tables larger than RAM thrash the page cache: 15-20 s a step.

``--device cuda`` runs the same cases with the cache (and the in-memory tables) and the dense
layers on the GPU: the host tier's table is then pinned host memory, and the notes add the
device's peak memory.

Run: ``python -m benchmarks.tiered [--sweep] [--large] [--quick] [--device D] [--dir DIR]``.
Rows are appended to ``benchmarks/results/tiered.csv`` (its own columns; device, versions and
commit from ``benchmarks/_harness.py``); ``--quick`` (tiny sizes, a few steps) writes no rows
unless ``--write``, and then marks them quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torchrec import EmbeddingBagConfig

from benchmarks._harness import append_csv, environment, format_table, load_note, summarize
from benchmarks._tiered_data import NUM_DENSE, Batch, LogSpec, auc, make_batches
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import RowWiseAdagrad
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.options import StorageOptions
from recsys.models import DLRM

TOPIC = "tiered"
COLUMNS = (
    *("case", "tier", "tables", "rows_total", "logical_gib", "cache_fraction", "cache_rows"),
    *("batch", "steps", "step_ms_p50", "step_ms_p20", "step_ms_p80", "hit_rate"),
    *("fetched_per_step", "initialized_per_step", "written_back_per_step"),
    *("prefetch_wait_ms_per_step", "disk_gib_used", "peak_rss_gib", "rss_budget_gib", "auc"),
    *("device", "versions", "commit", "timestamp", "notes"),
)
GIB = 1 << 30
DIM = 64
BOTTOM = [128, DIM]
TOP = [256, 128, 1]


@dataclasses.dataclass
class Case:
    """One worker's run (passed to the subprocess as JSON)."""

    name: str
    tier: str  # "memory" (EmbeddingBagCollection), "host" or "disk"
    num_tables: int
    rows: int  # per table
    cache_fraction: float  # of each table's rows (tiered only)
    batch: int
    warmup: int
    steps: int  # timed steps, after warmup
    eval_batches: int
    zipf: float
    seed: int
    threads: int
    lr_embedding: float
    lr_dense: float
    directory: str  # disk tier: where the table files go (removed after the run)
    rss_budget_gib: float = 0.0  # 0: none
    device: str = "cpu"  # cuda: the cache and the dense layers on the GPU, a host table pinned

    @property
    def cache_rows(self) -> int:
        return max(int(self.rows * self.cache_fraction), 1) if self.tier != "memory" else 0

    @property
    def log(self) -> LogSpec:
        """The synthetic log the case trains on."""
        return LogSpec(self.num_tables, self.rows, self.batch, self.zipf, self.seed)


# ---------------------------------------------------------------------------------------------
# worker: build, train, measure


def build(case: Case) -> tuple[DLRM, EmbeddingBagCollection, torch.optim.Optimizer]:
    """The model, its collection (tiered or in memory) and the dense optimizer."""
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", embedding_dim=DIM, num_embeddings=case.rows, feature_names=[f"f{t}"]
        )
        for t in range(case.num_tables)
    ]
    optimizer, device = RowWiseAdagrad(lr=case.lr_embedding), torch.device(case.device)
    if case.tier == "memory":
        torch.manual_seed(case.seed)  # the tables' init_fn draws from the global generator
        ebc = EmbeddingBagCollection(tables, optimizer=optimizer, device=device)
    else:
        storage = StorageOptions(
            tier=case.tier,
            cache_rows=case.cache_rows,
            path=case.directory if case.tier == "disk" else "",
        )
        ebc = TieredEmbeddingBagCollection(
            tables, storage, optimizer, device=device, seed=case.seed
        )
    torch.manual_seed(case.seed)
    model = DLRM(ebc, NUM_DENSE, BOTTOM, TOP).to(device)
    table_params = {id(p) for p in ebc.parameters()}
    dense = [p for p in model.parameters() if id(p) not in table_params and p.requires_grad]
    return model, ebc, torch.optim.Adam(dense, lr=case.lr_dense)


def counters(ebc: EmbeddingBagCollection) -> dict[str, float]:
    """The tiered counters summed over tables (zeros in memory)."""
    if not isinstance(ebc, TieredEmbeddingBagCollection):
        return {}
    totals: dict[str, float] = {}
    for stats in ebc.tiered_stats().values():
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    totals["prefetch_wait_s"] = ebc.prefetch_wait_seconds  # the collection's, not per table
    return totals


def train(case: Case, model, ebc, dense_optimizer, batches: list[Batch]) -> dict:
    """Train on ``batches`` (prefetching one ahead when tiered): step times (ms) of the timed
    steps and the counters over them."""
    tiered = isinstance(ebc, TieredEmbeddingBagCollection)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    times, before, losses = [], {}, []
    if tiered:
        ebc.prefetch(batches[0].sparse)
    for i, batch in enumerate(batches):
        if i == case.warmup:
            if tiered:
                ebc.wait_prefetch()  # this batch's prefetch counts in the timed steps
            before = counters(ebc)
        start = time.perf_counter()
        logits = model(batch.dense, batch.sparse)
        if tiered and i + 1 < len(batches):
            ebc.prefetch(batches[i + 1].sparse)
        loss = loss_fn(logits, batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer.step()
        if i >= case.warmup:
            if batch.labels.is_cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.detach()))
        if (i + 1) % 50 == 0:
            print(f"  step {i + 1}/{len(batches)} loss {sum(losses[-50:]) / 50:.4f}", flush=True)
    after = counters(ebc)
    return {"times": times, "counters": {k: after[k] - before.get(k, 0) for k in after}}


def evaluate(model, ebc, batches: list[Batch]) -> tuple[float, float]:
    """(the model's AUC, the planted logit's AUC) on held-out ``batches``."""
    if isinstance(ebc, TieredEmbeddingBagCollection):
        ebc.drop_prefetched()
    model.eval()
    scores = []
    with torch.no_grad():
        for batch in batches:
            scores.append(model(batch.dense, batch.sparse).squeeze(1).cpu())
    labels = torch.cat([b.labels.squeeze(1).cpu() for b in batches])
    planted = torch.cat([b.logits.cpu() for b in batches])
    return auc(torch.cat(scores), labels), auc(planted, labels)


def process_memory() -> dict[str, float]:
    """GiB from /proc/self/status: peak RSS (VmHWM) and the RSS now, anonymous and file."""
    fields = {"VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in fields:
                out[fields[key]] = int(line.split()[1]) * 1024 / GIB
    return out


def disk_used(directory: str) -> int:
    """Bytes allocated under ``directory`` (as ``du``: blocks, not file lengths)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def on_device(batches: list[Batch], device: str) -> list[Batch]:
    """``batches`` moved to ``device`` (unchanged on the CPU)."""
    if device == "cpu":
        return batches
    return [
        Batch(b.dense.to(device), b.sparse.to(torch.device(device)), b.labels.to(device), b.logits)
        for b in batches
    ]


def run_worker(case: Case) -> dict:
    """Build, train and evaluate one case; its measurements."""
    torch.set_num_threads(case.threads)
    start = time.perf_counter()
    batches = on_device(make_batches(case.log, case.warmup + case.steps, case.seed), case.device)
    held_out = on_device(make_batches(case.log, case.eval_batches, case.seed + 1), case.device)
    model, ebc, dense_optimizer = build(case)
    setup_s = time.perf_counter() - start
    print(f"  {case.name}: setup {setup_s:.1f} s", flush=True)
    trained = train(case, model, ebc, dense_optimizer, batches)
    train_s = time.perf_counter() - start - setup_s
    model_auc, planted_auc = evaluate(model, ebc, held_out)
    memory = process_memory()
    if case.device != "cpu":
        memory["device_peak"] = torch.cuda.max_memory_allocated() / GIB
    disk = disk_used(case.directory) if case.tier == "disk" else 0
    return {
        "times": trained["times"],
        "counters": trained["counters"],
        "auc": model_auc,
        "planted_auc": planted_auc,
        "memory": memory,
        "disk_bytes": disk,
        "setup_s": setup_s,
        "train_s": train_s,
        "load": load_note(),
    }


# ---------------------------------------------------------------------------------------------
# parent: cases, subprocesses, rows


RECORD_BYTES = DIM * 4 + 4
"""Bytes of one stored row: D fp32 weights, RowWiseAdagrad's one float."""


def run_case(case: Case) -> dict:
    """Run ``case`` in a subprocess; its row (a failed run: a row whose notes say why)."""
    print(f"{case.name}: tier={case.tier} cache={case.cache_rows} rows/table", flush=True)
    if case.tier == "disk":
        os.makedirs(case.directory, exist_ok=True)
    # The worker is this module again; the inherited cwd or PYTHONPATH finds the package.
    case_json = json.dumps(dataclasses.asdict(case))
    command = [sys.executable, "-m", "benchmarks.tiered", "--worker", case_json]
    start, result, output = time.perf_counter(), None, []
    try:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as worker:
            for line in worker.stdout:  # progress as it comes
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT ") :])
                else:
                    output.append(line.rstrip())
                    print(line, end="", flush=True)
    finally:
        if case.tier == "disk":
            shutil.rmtree(case.directory, ignore_errors=True)
    wall = time.perf_counter() - start
    if result is None:
        error = ([line for line in output if line.strip()] or ["no output"])[-1]
        print(f"  FAILED ({wall:.0f} s, exit {worker.returncode}): {error}", flush=True)
        return row_of(case, None, f"worker failed (exit {worker.returncode}): {error}")
    print(f"  done in {wall:.0f} s", flush=True)
    return row_of(case, result, "")


def row_of(case: Case, result: dict | None, failure: str) -> dict:
    """The CSV row of a case's result (None: failed, ``failure`` in the notes)."""
    tiered = case.tier != "memory"
    rows_total = case.num_tables * case.rows
    row = {
        "case": case.name,
        "tier": case.tier,
        "tables": f"{case.num_tables}x{case.rows}xD{DIM}",
        "rows_total": rows_total,
        "logical_gib": rows_total * RECORD_BYTES / GIB,
        "cache_fraction": case.cache_fraction if tiered else "",
        "cache_rows": case.cache_rows * case.num_tables if tiered else "",
        "batch": case.batch,
        "steps": case.steps,
        "rss_budget_gib": case.rss_budget_gib or "",
    }
    if result is None:
        return {**row, "notes": failure, "failed": True}
    timing, c = summarize(result["times"]), result["counters"]
    steps = len(result["times"])
    memory = result["memory"]
    row.update(
        step_ms_p50=timing.p50_ms,
        step_ms_p20=timing.p20_ms,
        step_ms_p80=timing.p80_ms,
        hit_rate=c["hits"] / c["lookups"] if tiered and c["lookups"] else "",
        fetched_per_step=c["fetched"] / steps if tiered else "",
        initialized_per_step=c["initialized"] / steps if tiered else "",
        written_back_per_step=c["written_back"] / steps if tiered else "",
        prefetch_wait_ms_per_step=c["prefetch_wait_s"] * 1e3 / steps if tiered else "",
        disk_gib_used=result["disk_bytes"] / GIB if case.tier == "disk" else "",
        peak_rss_gib=memory["peak"],
        auc=result["auc"],
        notes=notes_of(case, result),
        over_budget=bool(case.rss_budget_gib) and memory["peak"] > case.rss_budget_gib,
    )
    return row


def notes_of(case: Case, result: dict) -> str:
    """What else a reader needs: the setup, the planted AUC, the rest of the counters."""
    c, memory = result["counters"], result["memory"]
    steps = len(result["times"])
    parts = [
        f"DLRM bottom 13-{'-'.join(map(str, BOTTOM))} top {'-'.join(map(str, TOP))}, "
        f"RowWiseAdagrad lr {case.lr_embedding} + Adam lr {case.lr_dense}",
        f"zipf {case.zipf} one id per table and sample; warmup {case.warmup} steps untimed",
        f"AUC on {case.eval_batches}x{case.batch} held-out samples; planted logit's AUC "
        f"{result['planted_auc']:.4f}",
        f"RSS at end anon {memory['anon']:.2f} GiB file {memory['file']:.2f} GiB",
        f"setup {result['setup_s']:.0f} s, train {result['train_s']:.0f} s",
        f"torch threads {case.threads}",
        *(
            [f"device memory peak {memory['device_peak']:.2f} GiB"]
            if "device_peak" in memory
            else []
        ),
        result["load"],
    ]
    if case.tier != "memory":
        parts.insert(
            3,
            f"hit rate of rows seen before {reuse_hit_rate(c):.4f}; "
            f"per step: lookups {c['lookups'] / steps:.0f} misses {c['misses'] / steps:.0f} "
            f"initialized {c['initialized'] / steps:.0f} evicted {c['evicted'] / steps:.0f} "
            f"MiB read {c['bytes_read'] / steps / 2**20:.2f} written "
            f"{c['bytes_written'] / steps / 2**20:.2f}",
        )
    if case.tier == "disk":
        parts.append(f"dir {case.directory}; mmap advice MADV_RANDOM (recsys DiskRecords)")
    if case.rss_budget_gib:
        verdict = "OVER" if memory["peak"] > case.rss_budget_gib else "under"
        budget = f"peak RSS {memory['peak']:.2f} GiB {verdict} budget {case.rss_budget_gib} GiB"
        parts.insert(0, budget)
    return "; ".join(parts)


def reuse_hit_rate(c: dict[str, float]) -> float:
    """Hits over the lookups of rows the table held before (first touches left out: no cache
    size avoids those misses)."""
    seen = c["lookups"] - c["initialized"]
    return c["hits"] / seen if seen else float("nan")


def sweep_cases(args: argparse.Namespace, base: dict) -> list[Case]:
    """In memory, then the host and disk tiers at each cache fraction."""
    cases = [Case(name="sweep_memory", tier="memory", cache_fraction=0.0, **base)]
    for tier in ("host", "disk"):
        for fraction in args.cache_fractions:
            directory = os.path.join(args.dir, f"sweep_{tier}_{fraction:g}")
            cases.append(
                Case(
                    name=f"sweep_{tier}_{fraction:g}",
                    tier=tier,
                    cache_fraction=fraction,
                    **{**base, "directory": directory},
                )
            )
    return cases


def large_case(args: argparse.Namespace, base: dict) -> Case:
    """The larger-than-RAM disk run."""
    return Case(
        name="large_disk",
        tier="disk",
        cache_fraction=args.large_cache_fraction,
        rss_budget_gib=args.rss_budget_gib,
        **{
            **base,
            "num_tables": args.large_tables,
            "rows": args.large_rows,
            "steps": args.large_steps - args.warmup,
            "directory": os.path.join(args.dir, "large"),
        },
    )


def write_csv(rows: list[dict], env: dict[str, str], out_dir: Path | None) -> Path:
    """Append ``rows`` to ``<results dir>/tiered.csv`` (see ``_harness.append_csv``)."""
    lines = [[_format({**env, **row}.get(c, "")) for c in COLUMNS] for row in rows]
    return append_csv(TOPIC, COLUMNS, lines, out_dir)


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.0f}"
    return str(value)


def print_rows(rows: list[dict]) -> None:
    header = ["case", "cache rows", "step ms p50", "hit rate", "fetched/step", "new/step",
              "written/step", "wait ms/step", "disk GiB", "peak RSS GiB", "AUC"]  # fmt: skip
    keys = ["case", "cache_rows", "step_ms_p50", "hit_rate", "fetched_per_step",
            "initialized_per_step", "written_back_per_step", "prefetch_wait_ms_per_step",
            "disk_gib_used", "peak_rss_gib", "auc"]  # fmt: skip
    lines = [[_short(r.get(k, "")) for k in keys] for r in rows]
    print(format_table(header, lines))


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--sweep", action="store_true", help="cache-size sweep vs in memory (default mode)")
    add("--large", action="store_true", help="the larger-than-RAM disk run")
    add("--quick", action="store_true", help="tiny sizes, a few steps; no rows unless --write")
    add("--write", action="store_true", help="with --quick: append the rows (marked quick)")
    add("--dir", default=None, help="disk tier files (default: a new directory under /tmp)")
    add("--tables", type=int, default=4, help="sweep: tables")
    add("--rows", type=int, default=2_000_000, help="sweep: rows per table")
    add("--cache-fractions", type=float, nargs="+", default=[0.01, 0.1, 0.5])
    add("--large-tables", type=int, default=8)
    add("--large-rows", type=int, default=20_000_000, help="large: rows per table")
    add("--large-cache-fraction", type=float, default=0.01)
    add("--large-steps", type=int, default=300, help="large: steps in all, warmup included")
    add("--rss-budget-gib", type=float, default=6.0, help="large: peak RSS allowed")
    add("--batch", type=int, default=4096)
    add("--warmup", type=int, default=20, help="untimed steps")
    add("--steps", type=int, default=100, help="sweep: timed steps")
    add("--eval-batches", type=int, default=20)
    add("--zipf", type=float, default=1.05)
    add("--lr-embedding", type=float, default=0.05)
    add("--lr-dense", type=float, default=3e-3)
    add("--threads", type=int, default=1, help="torch threads (the prefetch thread is another)")
    add("--seed", type=int, default=0)
    add("--out-dir", type=Path, default=None, help="results directory")
    add("--device", default="cpu", help="cpu or cuda (the cache and dense layers on the GPU)")
    add("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("tables", "rows", "large_tables", "large_rows", "batch", "steps",
                 "eval_batches", "threads"):  # fmt: skip
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}; expected >= 1")
    if args.large_steps <= args.warmup:
        raise ValueError(f"--large-steps={args.large_steps}; expected > --warmup={args.warmup}")
    for fraction in [*args.cache_fractions, args.large_cache_fraction]:
        if not 0 < fraction <= 1:
            raise ValueError(f"cache fraction {fraction}; expected in (0, 1]")
    return args


def quick_sizes(args: argparse.Namespace) -> None:
    """--quick: tiny tables, a few steps."""
    args.rows, args.large_rows, args.large_tables = 100_000, 200_000, 8
    args.batch, args.warmup, args.steps, args.large_steps = 256, 3, 8, 16
    args.eval_batches = 4


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        result = run_worker(Case(**json.loads(args.worker)))
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.device not in ("cpu", "cuda") or (
        args.device == "cuda" and not torch.cuda.is_available()
    ):
        raise SystemExit(f"--device {args.device}: expected cpu, or cuda on a machine with a GPU")
    if args.quick:
        quick_sizes(args)
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_tiered_", dir="/tmp")
    base = dict(
        num_tables=args.tables, rows=args.rows, batch=args.batch, warmup=args.warmup,
        steps=args.steps, eval_batches=args.eval_batches, zipf=args.zipf, seed=args.seed,
        threads=args.threads, lr_embedding=args.lr_embedding, lr_dense=args.lr_dense, directory="",
        device=args.device,
    )  # fmt: skip
    cases = sweep_cases(args, base) if args.sweep or not args.large else []
    if args.large:
        cases.append(large_case(args, base))
    torch.set_num_threads(args.threads)  # the workers' count, which the device column names
    env = environment(torch.device(args.device))
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    print(f"disk tier files under {args.dir}", flush=True)
    try:
        rows = [run_case(case) for case in cases]
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    print_rows(rows)
    if args.quick:
        for row in rows:
            row["case"] = "quick_" + row["case"]
    if not args.quick or args.write:
        path = write_csv(rows, env, args.out_dir)
        print(f"\n{len(rows)} rows appended to {path}")
    over = [r for r in rows if r.get("over_budget")]
    for row in over:
        print(f"\nFAILED: {row['case']}: peak RSS {row['peak_rss_gib']:.2f} GiB is over the "
              f"budget of {row['rss_budget_gib']} GiB", file=sys.stderr)  # fmt: skip
    failed = [r for r in rows if r.get("failed")]
    if over or failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
