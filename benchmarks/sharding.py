"""Benchmark the training step of recsys's sharded embedding collection on several ranks.

The step time and the bytes each rank exchanges per step of ``ShardedEmbeddingBagCollection``,
for each sharding type, with and without quantized communication, against the unsharded
collection in one process and TorchRec's DistributedModelParallel; and the same for dynamic
tables (raw 64-bit keys, sharded KEY_WISE), with each rank's key count.

Collection (Criteo-shaped, from ``configs/dlrm_synthetic.toml``): 26 tables, one per
categorical feature, with the recipe's cardinalities (times ``--rows-scale``), dim ``--dim``
(64), sum pooling, the recipe's bags (22 one-hot features; the last four multi-hot, 0..m ids
drawn uniformly, m = 3, 3, 4, 5), ids Zipf(1)-skewed with the hot rows scattered over each
table (``_harness.zipf_ids``). Each of the W ranks (``--world-size``, 2) reads its own
``--batch-size`` samples (2048; ``--quick``: 1024) of a global batch of W x B; four global
batches are drawn up front and cycled. Every provider starts from the same fp32 tables (one
seeded init) and trains them with per-element Adagrad (lr 0.05, eps 1e-10).

Step: forward, backward of ``sum(pooled * upstream)`` for a fixed random upstream gradient
(each rank's rows of one [W x B, 26 x D] tensor), the Adagrad update (fused into backward).

Providers, on the same tables and batches:

- ``recsys_sharded``: ``ShardedEmbeddingBagCollection`` over W ranks (``torch.multiprocessing``
  processes with ``os.cpu_count() // W`` torch threads each; gloo on CPU, or ``--device cuda
  --backend nccl`` with rank r on cuda:r), the fused Adagrad. Shardings (``--shardings``):
  ``data_parallel`` (every table replicated: no pooled vectors travel, only the gradient
  all-reduce, so it runs at fp32 only), ``table_wise`` (table t on rank t mod W), ``row_wise``
  (every table over all ranks), ``column_wise`` (every table in W column pieces, one per rank)
  and ``planner`` (``plan_sharding``'s choice for this batch, precision and Adagrad's state; the
  mix is in the notes). Precisions (``--precisions``) ``fp32`` / ``fp16`` / ``bf16`` / ``int8``,
  the same for the pooled vectors (forward) and their gradients (backward).
- ``torchrec_dmp``: ``torchrec.EmbeddingBagCollection`` under ``DistributedModelParallel`` on
  the same ranks with the same placements, built by ``torchrec.distributed.sharding_plan``
  (``planner``: TorchRec's ``EmbeddingShardingPlanner`` chooses instead), Adagrad by
  ``torchrec.optim.apply_optimizer_in_backward`` (the FUSED kernel: FBGEMM's EXACT_ADAGRAD);
  data-parallel tables (DENSE kernel, which the in-backward optimizer does not reach) get DDP's
  averaged gradient and ``torch.optim.Adagrad``. Quantized comms by ``QCommsConfig``. On CPU
  TorchRec's sharder offers no ROW_WISE (CUDA only), so the row-wise plan is forced; on gloo
  TorchRec sends bf16 as fp16 (its own fallback), so that case is skipped. A case that raises
  is reported with its exception (printed and in ``notes``; no timing). No byte counts.
- ``single_process``: the unsharded recsys ``EmbeddingBagCollection`` stepping the whole global
  batch (W x B) in the parent process with all of its torch threads, in a phase of its own
  before the ranks start (so it is not timed in alternation with them; its ``notes`` carry the
  load average). What a user without sharding runs; ``vs single`` is its p50 over a provider's
  p50 (> 1: the sharded step is faster).
- ``key_wise`` (dynamic tables; ``_sharding_dynamic.py`` has the details): the ids become raw
  keys spread over the whole int64 range, every table is dynamic (no cap), and
  ``recsys_sharded`` shards them KEY_WISE (a key's rank by a mixing hash into 4096 routing
  buckets); ``single_process`` (dynamic) steps the same dynamic collection on the global batch,
  and its p50 is the ``vs single`` of these rows; the peer is ``torchrec_mch_dmp``, TorchRec's
  ``ManagedCollisionEmbeddingBagCollection`` (MCH, ROW_WISE) under DMP. The warmup runs every
  batch at least once, so every key has its row and the timed steps are all hits (the notes
  count the keys inserted while timed). ``notes`` add the keys each rank holds (summed over
  tables), their max / mean and the worst table's, and, when ``row_wise`` ran too, the p50
  over the fixed tables' recsys row_wise p50.

Checks: before timing, each provider's forward matches the unsharded collection on the same
batch (tolerance by precision; not for ``torchrec_mch_dmp``, whose rows start elsewhere); after
timing, its output has moved (the update ran, else the case is reported as failed), and a
TorchRec fp32 provider's output is compared with recsys's fp32 one after the same steps (the
relative difference is in ``notes``; fixed tables only).

Timing: within one sharding type, the providers (every precision, recsys and TorchRec) are
built, warmed up (``--warmup``; ``key_wise``: at least 4), then timed in alternation for
``--steps`` rounds. A timed step is ``barrier; step; barrier`` on every rank (after a CUDA
synchronize), and its time is the slowest rank's. We report p20 / p50 / p80 over the steps;
samples/s is the global batch over the p50. Bytes: the rank's ``comm_stats`` per timed step
(``input``: counts, bag lengths and ids sent in the input dist; ``forward``: pooled vectors;
``backward``: their gradients and the data-parallel tables' gradient all-reduce), averaged over
ranks; ``notes`` also give the busiest rank's total.

Run: ``python -m benchmarks.sharding [--quick | --full] [--world-size W] [--shardings ...]
[--precisions ...] [--batch-size B] [--dim D] [--rows-scale X] [--steps N] [--no-torchrec]
[--no-write]``; on GPUs add ``--device cuda`` (nccl). Rows go to
``benchmarks/results/sharding.csv`` (see ``benchmarks/_harness.py``): one per provider, sharding
and precision, with the bytes in ``notes`` as ``bytes/step/rank input=... forward=...
backward=... total=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import socket
import statistics
import tempfile
import time
import tomllib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._harness import (
    Row,
    Timing,
    add_common_args,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    time_fn,
    write_rows,
)
from benchmarks._sharding_dynamic import (
    balance_note,
    key_wise_group,
    time_single_dynamic,
    warmup_steps,
)
from benchmarks._sharding_setup import (
    KEY_WISE,
    PRECISIONS,
    RECIPE,
    RECSYS,
    SHARDINGS,
    SINGLE,
    TORCHREC,
    Batch,
    Provider,
    Setup,
    build_on_every_rank,
    check_forward,
    inputs,
    kjt_rows,
    make_step,
    recsys_plan,
    recsys_provider,
    relative_difference,
    unsharded_collection,
)
from benchmarks._sharding_torchrec import output_columns, torchrec_dmp
from recsys import KeyedJaggedTensor  # recsys quiets torchrec's import
from recsys.embedding.collection import EmbeddingBagCollection

TOPIC = "sharding"
OP = "sharded_ebc_step"
PASS = "fwd_bwd_adagrad"
# After warmup + timed steps the output must have moved by more than this (relative to the
# sample's largest |pooled| value before training).
MIN_TRAINED = 0.1


def timing_of(samples_ms: list[float]) -> Timing:
    """p20 / p50 / p80 with linear interpolation (numpy's default), as the harness."""
    if len(samples_ms) == 1:
        return Timing(samples_ms[0], samples_ms[0], samples_ms[0], repeats=1)
    deciles = statistics.quantiles(samples_ms, n=10, method="inclusive")
    return Timing(deciles[1], deciles[4], deciles[7], repeats=len(samples_ms))


# ---------------------------------------------------------------------------------------------
# Phase 1: the unsharded collection on the global batch, in this process


def time_single_process(setup: Setup, device: torch.device) -> dict:
    batches, upstream = inputs(setup)
    ebc = unsharded_collection(setup).to(device)
    kjts = [kjt_rows(batch, 0, setup.global_batch).to(device) for batch in batches]
    step = make_step(lambda kjt: ebc(kjt).values(), kjts, upstream.to(device))
    note = f"{load_note()}; unsharded EmbeddingBagCollection, {torch.get_num_threads()} threads"
    timing = time_fn(
        step,
        device,
        warmup=setup.warmup,
        repeats=setup.steps,
        min_time_s=0,
        max_repeats=setup.steps,
    )
    return {"timing": dataclasses.asdict(timing), "note": note + "; no communication"}


# ---------------------------------------------------------------------------------------------
# Phase 2: the ranks


def build_group(
    setup: Setup,
    sharding: str,
    unsharded: EmbeddingBagCollection,
    batches: list[Batch],
    kjts: list[KeyedJaggedTensor],
    upstream: torch.Tensor,
    expected: torch.Tensor,
    device: torch.device,
) -> tuple[dict[tuple[str, str], Provider], dict[tuple[str, str], str]]:
    """The providers of one sharding type on this rank, their forward checked; and the
    (provider, precision) pairs that did not build, with the reason (the same on every rank)."""
    tables = unsharded.embedding_bag_configs()
    precisions = ("fp32",) if sharding == "data_parallel" else setup.precisions
    providers: dict[tuple[str, str], Provider] = {}
    failed: dict[tuple[str, str], str] = {}
    for precision in precisions:
        plan, note = recsys_plan(setup, sharding, precision, tables, batches)
        provider = recsys_provider(unsharded, plan, precision, kjts, upstream, device, note=note)
        check_forward(provider, kjts[0], expected, precision)
        providers[(RECSYS, precision)] = provider
    for precision in precisions if setup.torchrec else ():
        if precision == "bf16" and device.type == "cpu":
            failed[(TORCHREC, precision)] = (
                "skipped: on gloo TorchRec sends bf16 as fp16 (its own fallback)"
            )
            continue

        def build(precision: str = precision) -> Provider:
            dmp, optimizer, note = torchrec_dmp(setup, sharding, precision, unsharded, device)
            forward = lambda kjt, dmp=dmp: dmp(kjt).values()  # noqa: E731
            with torch.no_grad():
                columns = output_columns(dmp(kjts[0]), tables)
            # The same upstream gradient, in TorchRec's column order.
            step = make_step(forward, kjts, upstream[:, columns.to(device)], optimizer)
            provider = Provider(forward, step, columns=columns, note=note)
            check_forward(provider, kjts[0], expected, precision)
            return provider

        provider, error = build_on_every_rank(build, setup.world_size)
        if error:
            failed[(TORCHREC, precision)] = error
        else:
            providers[(TORCHREC, precision)] = provider
    return providers, failed


def time_group(
    providers: dict[tuple[str, str], Provider], setup: Setup, warmup: int, device: torch.device
) -> dict[tuple[str, str], list[float]]:
    """Each timed step's slowest-rank time in ms, per provider, after ``warmup`` untimed
    steps; providers in alternation."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(warmup):
        for provider in providers.values():
            provider.step()
    for provider in providers.values():
        if provider.comm_stats is not None:
            provider.comm_stats.reset()
        if provider.key_stats is not None:
            provider.warm_stats = provider.key_stats()
    times = torch.zeros(len(providers), setup.steps, dtype=torch.float64)
    for s in range(setup.steps):
        for p, provider in enumerate(providers.values()):
            sync()
            start = time.perf_counter()
            provider.step()
            sync()
            times[p, s] = (time.perf_counter() - start) * 1e3
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {key: times[p].tolist() for p, key in enumerate(providers)}


def summarize_group(
    setup: Setup,
    sharding: str,
    providers: dict[tuple[str, str], Provider],
    times: dict[tuple[str, str], list[float]],
    kjt: KeyedJaggedTensor,
    expected: torch.Tensor,
) -> list[dict]:
    """One result per provider: timing, bytes per step (mean over ranks), the key balance of
    dynamic tables and the checks after training (did the output move; TorchRec fp32 against
    recsys fp32)."""
    counted_bytes = {
        key: {k: v / setup.steps for k, v in p.comm_stats.bytes.items()}
        for key, p in providers.items()
        if p.comm_stats is not None
    }  # before the forward below adds to them
    balance = {
        key: balance_note(p.warm_stats, p.key_stats(), warmup_steps(setup))
        for key, p in providers.items()
        if p.key_stats is not None
    }  # a collective, in the same order on every rank
    with torch.no_grad():
        trained = {key: p.forward(kjt).float().cpu() for key, p in providers.items()}
    recsys_fp32 = trained.get((RECSYS, "fp32"))
    results = []
    for key, provider in providers.items():
        counted = counted_bytes.get(key)
        moved = relative_difference(trained[key], provider.before_training(expected))
        agreement = None
        comparable = provider.initial is None and recsys_fp32 is not None
        if key[0] != RECSYS and key[1] == "fp32" and comparable:
            agreement = relative_difference(trained[key], provider.ordered(recsys_fp32))
        per_rank = [None] * setup.world_size
        dist.all_gather_object(per_rank, (counted, moved, agreement))
        result = {"provider": key[0], "sharding": sharding, "precision": key[1]}
        notes = [provider.note, balance.get(key, "")]
        moved = min(m for _, m, _ in per_rank)
        if moved < MIN_TRAINED:
            result["error"] = (
                f"the output moved only {moved:.1e} (relative) in {setup.warmup + setup.steps} "
                "steps: the tables were not trained, so the step is not a training step"
            )
        else:
            result["timing"] = dataclasses.asdict(timing_of(times[key]))
        if agreement is not None:
            agreement = max(a for _, _, a in per_rank)
            notes.append(f"after training {agreement:.1e} from {RECSYS} fp32")
        if counted is not None:
            result["bytes"] = {
                k: sum(c[k] for c, _, _ in per_rank) / len(per_rank) for k in counted
            }
            result["busiest_rank_bytes"] = max(sum(c.values()) for c, _, _ in per_rank)
        result["note"] = "; ".join(n for n in notes if n)
        results.append(result)
    return results


def run_rank(rank: int, setup: Setup, device: torch.device) -> list[dict]:
    batches, upstream = inputs(setup)
    mine = slice(rank * setup.batch_size, (rank + 1) * setup.batch_size)
    kjts = [kjt_rows(batch, mine.start, mine.stop).to(device) for batch in batches]
    upstream = upstream[mine].to(device)
    unsharded = unsharded_collection(setup)
    with torch.no_grad():
        expected = unsharded(kjt_rows(batches[0], 0, setup.global_batch)).values()[mine]
    results = []
    for sharding in setup.shardings:
        if rank == 0:
            print(f"running {sharding}", flush=True)
        if sharding == KEY_WISE:
            providers, failed, check, before = key_wise_group(
                setup, batches, upstream, rank, device
            )
            warmup = warmup_steps(setup)
        else:
            providers, failed = build_group(
                setup, sharding, unsharded, batches, kjts, upstream, expected, device
            )
            check, before, warmup = kjts[0], expected, setup.warmup
        times = time_group(providers, setup, warmup, device)
        results += summarize_group(setup, sharding, providers, times, check, before)
        for (name, precision), error in failed.items():
            results.append(
                {"provider": name, "sharding": sharding, "precision": precision, "error": error}
            )
            if rank == 0:
                print(f"  {name} {precision}: {error}", flush=True)
        del providers
        gc.collect()
    order = {
        **{s: i for i, s in enumerate(SHARDINGS)},
        **{p: i for i, p in enumerate(PRECISIONS)},
    }
    return sorted(
        results, key=lambda r: (order[r["sharding"]], r["provider"], order[r["precision"]])
    )


def rank_main(rank: int, setup: Setup, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # TorchRec's planner and DMP log and warn about their own defaults on every build, and
    # FBGEMM's dense (data-parallel) lookup has no registered autograd kernel; its gradients
    # are right (the data_parallel rows compare TorchRec with recsys after training).
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torchrec\..*|torch\.distributed\..*|fbgemm_gpu.*")
    warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function")
    torch.set_num_threads(setup.threads_per_rank)
    device = torch.device("cpu")
    if setup.device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        setup.backend,
        rank=rank,
        world_size=setup.world_size,
        timeout=datetime.timedelta(minutes=5),
    )
    try:
        results = run_rank(rank, setup, device)
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_ranks(setup: Setup) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(setup, port, out), nprocs=setup.world_size, join=True)
        return json.loads(Path(out, "results.json").read_text())


# ---------------------------------------------------------------------------------------------
# Report


def is_dynamic(result: dict) -> bool:
    return result["sharding"] == KEY_WISE or result.get("dynamic", False)


def with_baselines(singles: list[dict], results: list[dict]) -> list[dict]:
    """The single-process results, then the ranks', each with ``baseline``: the p50 of the
    single-process run on the same kind of tables (fixed or dynamic; None: it did not run); a
    recsys key_wise result also with ``fixed_p50``, the recsys row_wise p50 of its precision
    (fixed tables; when that ran)."""
    single_p50 = {is_dynamic(r): r["timing"]["p50_ms"] for r in singles}
    row_wise = {
        r["precision"]: r["timing"]["p50_ms"]
        for r in results
        if r["sharding"] == "row_wise" and r["provider"] == RECSYS and "timing" in r
    }
    out = []
    for r in [*singles, *results]:
        r = {**r, "baseline": single_p50.get(is_dynamic(r))}
        if r["sharding"] == KEY_WISE and r["provider"] == RECSYS:
            r["fixed_p50"] = row_wise.get(r["precision"])
        out.append(r)
    return out


def fixed_note(r: dict) -> list[str]:
    """A timed key_wise result's p50 against the fixed tables' row_wise one, if that ran."""
    if r.get("fixed_p50") is None:
        return []
    return [f"{r['timing']['p50_ms'] / r['fixed_p50']:.2f}x the time of {RECSYS} row_wise"]


def comparisons(r: dict) -> list[str]:
    """A timed result's p50 against the single process and (key_wise) the fixed tables."""
    notes = []
    if r["provider"] != SINGLE and r["baseline"] is not None:
        kind = " (dynamic tables)" if is_dynamic(r) else ""
        notes.append(f"{r['baseline'] / r['timing']['p50_ms']:.2f}x {SINGLE}{kind}")
    return notes + fixed_note(r)


def to_rows(setup: Setup, singles: list[dict], results: list[dict], load: str) -> list[Row]:
    samples = setup.global_batch
    rows = []
    for r in with_baselines(singles, results):
        notes = [r["note"]] if r.get("note") else []
        if "error" in r:
            nan = float("nan")
            timing, throughput = Timing(nan, nan, nan, repeats=0), None
            notes.append(r["error"])
        else:
            timing = Timing(**r["timing"])
            throughput = samples / (timing.p50_ms * 1e-3)
            if "bytes" in r:
                counted = " ".join(f"{k}={v:.0f}" for k, v in r["bytes"].items())
                total = sum(r["bytes"].values())
                notes.append(
                    f"bytes/step/rank {counted} total={total:.0f} "
                    f"(busiest rank {r['busiest_rank_bytes']:.0f})"
                )
            notes += comparisons(r)
            if r["provider"] != SINGLE:
                notes.append(load)
        rows.append(
            Row(
                op=OP,
                pass_=PASS,
                provider=r["provider"],
                config=setup.config(r["sharding"], is_dynamic(r)),
                dtype=r["precision"],
                timing=timing,
                throughput=throughput,
                throughput_unit="samples/s" if throughput is not None else "",
                notes="; ".join(notes),
            )
        )
    return rows


def print_rows(setup: Setup, singles: list[dict], results: list[dict]) -> None:
    """One line per result; the bytes in MB (1e6) per step per rank, mean over ranks."""
    header = ["sharding", "provider", "precision", "p50 ms", "p20-p80 ms", "samples/s"]
    header += ["in MB", "fwd MB", "bwd MB", "total MB", "vs single", "notes"]
    lines = []
    for r in with_baselines(singles, results):
        sharding = r["sharding"] + (
            " (dynamic)" if r["sharding"] == "none" and is_dynamic(r) else ""
        )
        line = [sharding, r["provider"], r["precision"]]
        if "error" in r:
            lines.append([*line, *["-"] * 8, r["error"]])
            continue
        t = r["timing"]
        line += [f"{t['p50_ms']:.2f}", f"{t['p20_ms']:.2f}-{t['p80_ms']:.2f}"]
        line.append(f"{setup.global_batch / t['p50_ms'] * 1e3:,.0f}")
        if "bytes" in r:
            mb = [r["bytes"][k] / 1e6 for k in ("input", "forward", "backward")]
            line += [f"{x:.3f}" for x in (*mb, sum(mb))]
        else:
            line += ["-"] * 4
        vs = f"{r['baseline'] / t['p50_ms']:.2f}x" if r["baseline"] is not None else "-"
        line += [vs, "; ".join(n for n in [r.get("note", ""), *fixed_note(r)] if n)]
        lines.append(line)
    print(f"\n{setup.config('<sharding>')}")
    print(f"vs single: {SINGLE} p50 / p50 on the same kind of tables (> 1: sharded is faster)")
    print(format_table(header, lines), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--steps", dest="repeats", type=int, metavar="N", help="timed steps (= --repeats)"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--backend", help="gloo (default on cpu) or nccl (default on cuda)")
    parser.add_argument("--shardings", nargs="+", choices=SHARDINGS, default=list(SHARDINGS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--batch-size", type=int, help="samples per rank (2048; quick: 1024)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dim (default 64)")
    parser.add_argument(
        "--rows-scale", type=float, default=1.0, help="factor on the recipe's cardinalities"
    )
    parser.add_argument("--no-torchrec", action="store_true", help="leave out torchrec_dmp")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_from_args(args: argparse.Namespace, device: torch.device) -> Setup:
    """The run's Setup: the recipe's tables and bags, and the command line's sizes (a bad value
    exits with a message)."""
    quick = is_quick(args)
    if args.world_size < 1 or args.dim < args.world_size or args.rows_scale <= 0:
        raise SystemExit(
            f"--world-size {args.world_size} must be >= 1, --dim {args.dim} >= --world-size, "
            f"--rows-scale {args.rows_scale} > 0"
        )
    if device.type == "cuda" and args.world_size > torch.cuda.device_count():
        raise SystemExit(
            f"--world-size {args.world_size}: this machine has {torch.cuda.device_count()} "
            "CUDA devices (rank r runs on cuda:r)"
        )
    recipe = tomllib.loads(RECIPE.read_text())["data"]["synthetic"]
    return Setup(
        cardinalities=tuple(
            max(1, math.ceil(n * args.rows_scale)) for n in recipe["cardinalities"]
        ),
        bag_sizes=tuple(recipe["bag_sizes"]),
        dim=args.dim,
        batch_size=args.batch_size or (1024 if quick else 2048),
        world_size=args.world_size,
        backend=args.backend or ("nccl" if device.type == "cuda" else "gloo"),
        device_type=device.type,
        shardings=tuple(args.shardings),
        precisions=tuple(args.precisions),
        torchrec=not args.no_torchrec,
        warmup=args.warmup if args.warmup is not None else (3 if quick else 5),
        steps=args.repeats if args.repeats is not None else (30 if quick else 50),
        seed=args.seed,
    )


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    setup = setup_from_args(args, device)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    started = time.perf_counter()
    singles = []
    one = {"provider": SINGLE, "sharding": "none", "precision": "fp32"}
    if any(sharding != KEY_WISE for sharding in setup.shardings):
        print(f"running {SINGLE} (batch {setup.global_batch})", flush=True)
        singles.append(one | time_single_process(setup, device))
    if KEY_WISE in setup.shardings:
        print(f"running {SINGLE} on dynamic tables (batch {setup.global_batch})", flush=True)
        singles.append(one | time_single_dynamic(setup, device))
    results = run_ranks(setup)
    load = load_note()
    print_rows(setup, singles, results)
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.no_write:
        return
    rows = to_rows(setup, singles, results, load)
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"{len(rows)} rows appended to {path}")


if __name__ == "__main__":
    main()
