"""Benchmark dynamic embedding tables: the id -> slot map, the train step, and AUC under drift.

Three sections, side by side in one run (``--sections``, default all), one process, the
harness's device (CPU by default; ``--threads`` torch threads, default torch's own: on a 2-core
machine that others use too, ``--threads 1`` avoids the OpenMP waits that make every parallel
op take a scheduler slice).

**map** — keys/s of recsys's ``SlotMap`` against TorchRec's managed-collision remapper
``MCHManagedCollisionModule`` (``LRU_EvictionPolicy``, ``eviction_interval=1``), on the same
raw int64 key streams (keys = ``hash_keys(rank)``, ranks Zipf(1)): a table of ``--map-rows``
rows (2**20), batches of ``--map-batch`` keys (65536). Both maps are first filled with the
2**20 hottest keys (each once, in batches, coldest first). Cases:

- ``warm`` phase (table full, mostly hits): batches Zipf(1) over 4 x rows ranks.
  ``find``: recsys ``SlotMap.find(keys)``; TorchRec ``remap()`` (searchsorted in its sorted
  ids). Both look up every key of the batch, duplicates included (no dedupe), read-only.
  ``insert``: the map work of one training batch. recsys: ``torch.unique`` (inverse, counts)
  + ``SlotMap.insert`` (find, slots for the new keys, evicting the lowest LRU score of their
  bucket, scores updated) + the slot of every key. TorchRec: ``profile()`` (history copy;
  ``torch.unique`` of the batch; LRU scores of the held and the new ids, argsort over both,
  the top ``rows`` kept, buffers re-sorted) + ``remap()``. Dedupe included on both sides.
- ``fresh`` phase (insert-heavy): every batch Zipf(1) over ranks of a stream of its own, so
  every distinct key is new and evicts a held one; ``insert`` as above.

keys/s counts the batch's keys (duplicates included) per p50 call. A map that fails records
its exception in ``notes`` (no timing).

**train_step** — one DLRM step (``configs/dlrm_synthetic.toml``: 26 tables with its
cardinalities, dim 16, bottom 64-16, top 128-64-1, batch ``--batch-size`` 2048; forward, BCE,
backward with the recipe's fused Adagrad (lr 0.05) in backward, Adam on the dense part) with
``fixed_tables`` (``EmbeddingBagCollection``, index ids) against ``dynamic_tables``
(``DynamicEmbeddingBagCollection`` built by ``build_model`` for raw-id data: every table
dynamic, no cap), on the same 8 batches of the synthetic data (the dynamic model reads the
same samples with ``id_encoding = "raw"`` keys), cycled. Warm-up runs every batch once, so the
timed dynamic steps find every key (steady state: hits only). The providers are timed in
alternating blocks of ``STEP_BLOCK`` consecutive steps, the first of each block untimed, so
each timed step runs warm as in a training run (the notes add the p50 of steps interleaved one
by one, each after the other model's step, where the model with the larger working set pays
more for the caches the other left). The dynamic row's notes give dynamic/fixed and where the
dynamic lookup's time goes, measured by wrapping the public calls of the dynamic path
(``lookup_ids`` = the whole id -> row mapping of a forward, key arena included;
``DynamicTable.assign`` = unique + insert + gather per table, for tables outside an arena or
with new keys; ``SlotMap.insert``; ``SlotMap.find`` inside it; ``fresh_rows``) over
``--steps`` more steps.

**drift** — test AUC on the drifting synthetic stream (the recipe's features with
``drift_days`` D = ``--days``, ``new_ids_per_day`` 0.15, ``popularity_drift`` 0.3, raw keys):
train day d (``--day-samples`` samples: 131072 quick, 524288 full; one pass, batch
``--batch-size``) then test on day d + 1 (``--test-samples``: 32768 / 131072, an independent
draw), d = 0..D-1, for the same DLRM (dim 16; the recipe's fused Adagrad and Adam) with:

- ``vocab_day0``: a fixed table of the keys seen in day 0's training samples; every later new
  key reads one shared unseen row;
- ``hash_c<x>``: the hashing trick, key mod C into a fixed table of C rows;
- ``dynamic_lru_c<x>``: a dynamic table capped at C rows (``max_capacity``, rounded up to
  whole buckets), LRU eviction;
- ``dynamic_uncapped``: a dynamic table with no cap;
- ``oracle``: the hidden teacher's click probability (the ceiling; no model).

C = x times the ids alive on one day (the feature's cardinality), for each x of
``--cap-fractions`` (1.0 and 0.5). Rows: one per (treatment, day) (``pass`` =
``day<d>->day<d+1>``; ``throughput`` = AUC; the timing = that day's train steps) and one per
treatment with the mean AUC over the days (timing: the median day's); notes give rows in
use and the dynamic tables' size / capacity / inserts / evictions / overflow summed over the
tables. A dynamic treatment that raises (e.g. a batch with more distinct keys than its cap) gets
a ``mean`` row with the error in its notes and is run again with buckets of 128
(``<name>_b128``).

Run: ``python -m benchmarks.dynamic [--quick | --full] [--sections map train_step drift]``;
rows go to ``benchmarks/results/dynamic.csv`` (see ``benchmarks/_harness.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks import _dynamic_cases as cases
from benchmarks._harness import (
    REPO_ROOT,
    Row,
    Timing,
    add_common_args,
    environment,
    format_table,
    is_quick,
    load_note,
    resolve_device,
    time_fns,
    write_rows,
)
from recsys.build.models import build_model
from recsys.config import Config, load_config
from recsys.data.synthetic import SyntheticDataset
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.dynamic.table import DynamicTable
from recsys.embedding.interface import embedding_collections
from recsys.train.optimizers import build_optimizers

TOPIC = "dynamic"
RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
SECTIONS = ("map", "train_step", "drift")
NUM_STEP_BATCHES = 8
# Consecutive steps of one provider per round of the train_step timing (see time_fns).
STEP_BLOCK = 5
NAN_TIMING = Timing(float("nan"), float("nan"), float("nan"), repeats=0)


# ---------------------------------------------------------------------------------------------
# map


def map_rows(args: argparse.Namespace, device: torch.device, warmup: int, repeats: int):
    """Fill both maps, then time find / insert of each phase; rows with keys/s."""
    generator = torch.Generator().manual_seed(args.seed)
    streams = cases.key_streams(args.map_rows, args.map_batch, warmup + repeats, generator)
    config = f"rows={args.map_rows} batch={args.map_batch} keys=hash(zipf1 rank)"
    sides, errors = {}, {}
    for name, make in (
        (
            cases.SlotMapSide.name,
            lambda: cases.SlotMapSide(args.map_rows, args.bucket_size, device),
        ),
        (cases.MCHSide.name, lambda: cases.MCHSide(args.map_rows, device)),
    ):
        try:
            side = make()
            for batch in streams.fill:
                side.insert(batch.to(device))
            sides[name] = side
        except Exception as error:  # a peer that cannot run is reported, not fatal
            errors[name] = f"{type(error).__name__}: {error}"
            print(f"{name} failed: {errors[name]}", flush=True)
    phases = {
        "warm": [b.to(device) for b in streams.warm],
        "fresh": [b.to(device) for b in streams.fresh],
    }
    rows = []
    for phase, op in (("warm", "find"), ("warm", "insert"), ("fresh", "insert")):
        batches = phases[phase]
        unique = float(torch.tensor([len(torch.unique(b)) for b in batches]).float().mean())
        case = f"{config} phase={phase} unique/batch={unique:.0f} universe={streams.universe}"
        hits = {name: side.hit_rate(batches[0]) for name, side in sides.items()}
        fns = {name: cases.cycling(batches, getattr(side, op)) for name, side in sides.items()}
        load = load_note()
        timings = _time_map_case(fns, device, warmup, repeats, op)
        for name in (cases.SlotMapSide.name, cases.MCHSide.name):
            rows.append(_map_row(name, op, case, timings, hits, errors, sides, args, load))
        print(f"done map {phase} {op}", flush=True)
    _compare(rows, cases.SlotMapSide.name, cases.MCHSide.name, "keys/s")
    return rows


def _time_map_case(fns, device, warmup, repeats, op) -> dict[str, Timing]:
    if not fns:
        return {}
    if op == "find":  # read-only and fast: more samples
        return time_fns(fns, device, warmup=warmup, repeats=repeats)
    # Every insert call takes a batch of its own (the fresh stream has warmup + repeats).
    return time_fns(fns, device, warmup=warmup, repeats=repeats, min_time_s=0, max_repeats=repeats)


def _map_row(name, op, case, timings, hits, errors, sides, args, load) -> Row:
    if name in errors:
        return Row(TOPIC + "_map", op, name, case, "int64", NAN_TIMING, notes=errors[name])
    timing = timings[name]
    side = sides[name]
    notes = [
        f"hit rate of the first batch before timing {hits[name]:.3f}",
        f"after: {side.describe()}",
        _per_call(name, op),
        load,
    ]
    return Row(
        op=TOPIC + "_map",
        pass_=op,
        provider=name,
        config=case,
        dtype="int64",
        timing=timing,
        throughput=args.map_batch / (timing.p50_ms * 1e-3),
        throughput_unit="keys/s",
        notes="; ".join(notes),
    )


def _per_call(name: str, op: str) -> str:
    """What one timed call does (see the module docstring)."""
    if name == cases.SlotMapSide.name:
        if op == "find":
            return "per call: SlotMap.find of every key (no dedupe)"
        return "per call: torch.unique + SlotMap.insert + gather (dedupe included)"
    if op == "find":
        return "per call: remap() = searchsorted of every key (no dedupe)"
    return "per call: profile() (unique, LRU scores, argsort, resort) + remap() (dedupe included)"


def _compare(rows: list[Row], name: str, baseline: str, unit: str) -> None:
    """Append ``<ratio>x <baseline>`` to ``name``'s rows, per (pass, config)."""
    base = {(r.pass_, r.config): r for r in rows if r.provider == baseline}
    for r in rows:
        other = base.get((r.pass_, r.config))
        if r.provider == name and other and r.throughput and other.throughput:
            r.notes += f"; {r.throughput / other.throughput:.2f}x {baseline} {unit}"


# ---------------------------------------------------------------------------------------------
# train_step


def step_fn(model, optimizers, batches: Iterator) -> Callable[[], None]:
    return cases.train_step(model, optimizers, batches)


def train_step_rows(
    args: argparse.Namespace, config: Config, device: torch.device, warmup: int, steps: int
) -> list[Row]:
    """Fixed vs dynamic tables, same batches; the dynamic row carries the breakdown."""
    synthetic = config.data.synthetic
    index = SyntheticDataset(synthetic, seed=args.seed)
    raw = SyntheticDataset(dataclasses.replace(synthetic, id_encoding="raw"), seed=args.seed)
    batches = {"fixed_tables": [], "dynamic_tables": []}
    for name, dataset in (("fixed_tables", index), ("dynamic_tables", raw)):
        chunks = itertools.count()
        while len(batches[name]) < NUM_STEP_BATCHES:
            chunk = dataset.chunk("train", next(chunks))
            for start in range(0, len(chunk) - args.batch_size + 1, args.batch_size):
                batches[name].append(chunk.slice(start, start + args.batch_size).to(device))
        del batches[name][NUM_STEP_BATCHES:]
    models = {
        "fixed_tables": build_model(config.model, index.spec, device, seed=args.seed),
        "dynamic_tables": build_model(config.model, raw.spec, device, seed=args.seed),
    }
    fns = {
        name: step_fn(
            model,
            list(build_optimizers(config.train, model).values()),
            itertools.cycle(batches[name]),
        )
        for name, model in models.items()
    }
    load = load_note()
    timings, interleaved = (
        time_fns(
            fns,
            device,
            warmup=max(warmup, NUM_STEP_BATCHES),
            repeats=steps,
            min_time_s=0,
            max_repeats=steps,
            block=block,
        )
        for block in (STEP_BLOCK, 1)
    )
    (collection,) = embedding_collections(models["dynamic_tables"]).values()
    stats = _summed_stats(collection)
    breakdown = _breakdown(fns["dynamic_tables"], steps)
    sizes = (
        f"tables={len(index.spec.sparse_names)} rows={sum(index.num_ids)} dim="
        f"{config.model.embedding_dim} batch={args.batch_size} bottom="
        f"{'-'.join(map(str, config.model.dense_arch_layer_sizes))} top="
        f"{'-'.join(map(str, config.model.over_arch_layer_sizes))} "
        f"optimizer=fused {config.train.embedding_optimizer} + {config.train.dense_optimizer}"
    )
    rows = []
    for name, timing in timings.items():
        notes = [
            "EmbeddingBagCollection, index ids"
            if name == "fixed_tables"
            else "DynamicEmbeddingBagCollection (no cap, LRU), raw keys; "
            f"after timing: {stats}; {breakdown}",
            f"timed in blocks of {STEP_BLOCK} steps per provider (the first untimed); "
            f"interleaved step by step instead (each step after the other model's): "
            f"p50 {interleaved[name].p50_ms:.2f} ms",
            load,
        ]
        rows.append(
            Row(
                op=TOPIC + "_dlrm_step",
                pass_="train_step",
                provider=name,
                config=f"{sizes} batches={NUM_STEP_BATCHES} cycled",
                dtype="fp32",
                timing=timing,
                throughput=args.batch_size / (timing.p50_ms * 1e-3),
                throughput_unit="samples/s",
                notes="; ".join(notes),
            )
        )
    ratio = timings["dynamic_tables"].p50_ms / timings["fixed_tables"].p50_ms
    rows[1].notes = (
        f"step time {ratio:.2f}x fixed_tables (speed {1 / ratio:.2f}x; goal >= 0.9x); "
        + rows[1].notes
    )
    print("done train_step", flush=True)
    return rows


def _summed_stats(collection: DynamicEmbeddingBagCollection) -> str:
    totals: dict[str, float] = {}
    for table in collection.dynamic_stats().values():
        for key in ("size", "capacity", "hits", "misses", "inserts", "evictions", "grows"):
            totals[key] = totals.get(key, 0) + table.get(key, 0)
    return "summed over tables " + " ".join(f"{k}={int(v)}" for k, v in totals.items())


@contextmanager
def _timed(targets: dict[str, tuple[type, str]], totals: dict[str, float]):
    """Wrap each ``(class, method)`` so that its calls add their wall time to ``totals``."""
    originals = {label: getattr(cls, attr) for label, (cls, attr) in targets.items()}

    def wrap(label: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        return timed

    try:
        for label, (cls, attr) in targets.items():
            setattr(cls, attr, wrap(label, originals[label]))
        yield
    finally:
        for label, (cls, attr) in targets.items():
            setattr(cls, attr, originals[label])


def _breakdown(step: Callable[[], None], steps: int) -> str:
    """ms per step of the dynamic path's parts over ``steps`` more steps."""
    targets = {
        "lookup_ids": (DynamicEmbeddingBagCollection, "lookup_ids"),
        "assign": (DynamicTable, "assign"),
        "insert": (SlotMap, "insert"),
        "find": (SlotMap, "find"),
        "fresh_rows": (DynamicTable, "fresh_rows"),
    }
    totals = dict.fromkeys(targets, 0.0)
    start = time.perf_counter()
    with _timed(targets, totals):
        for _ in range(steps):
            step()
    total = time.perf_counter() - start
    ms = {k: v * 1e3 / steps for k, v in totals.items()}
    parts = [
        f"step {total * 1e3 / steps:.1f}",
        f"lookup_ids (all id->row work) {ms['lookup_ids']:.1f}",
        f"assign {ms['assign']:.1f} = unique+gather {ms['assign'] - ms['insert']:.1f} "
        f"+ insert {ms['insert']:.1f} (find inside it {ms['find']:.1f})",
        f"fresh_rows {ms['fresh_rows']:.1f}",
        f"rest of lookup_ids (positions, scatter of rows, row placement) "
        f"{ms['lookup_ids'] - ms['assign']:.1f}",
    ]
    return "dynamic path ms/step, wrapped calls over the same cycle: " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# drift


def drift_rows(args: argparse.Namespace, config: Config, device: torch.device) -> list[Row]:
    """Train each treatment day by day, test on the next day; AUC rows."""
    synthetic = dataclasses.replace(
        config.data.synthetic,
        drift_days=args.days,
        new_ids_per_day=0.15,
        popularity_drift=0.3,
        id_encoding="raw",
    )
    dataset = SyntheticDataset(synthetic, seed=args.seed)
    data = cases.drift_data(dataset, args.day_samples, args.test_samples)
    setup = (
        f"days={args.days} new_ids_per_day={synthetic.new_ids_per_day} popularity_drift="
        f"{synthetic.popularity_drift} train/day={args.day_samples} test={args.test_samples} "
        f"batch={args.batch_size} dim={config.model.embedding_dim} "
        f"ids_alive/day={sum(synthetic.cardinalities)}"
    )
    print(f"drift: {setup}", flush=True)
    rows = []
    oracle = cases.oracle_aucs(data)
    rows += _auc_rows(
        "oracle",
        setup,
        oracle,
        [NAN_TIMING] * len(oracle),
        ["teacher p"] * len(oracle),
        "the hidden teacher's click probability",
    )
    for treatment in cases.treatments(data, args.cap_fractions, args.bucket_size):
        start = time.perf_counter()
        try:
            days = cases.run_treatment(treatment, config, data, args.batch_size, args.seed)
        except ValueError as error:  # a dynamic table that cannot take a batch: reported
            rows.append(_failed_row(treatment, setup, error))
            print(f"drift {treatment.name} failed: {error}", flush=True)
            if treatment.dynamic.bucket_size >= 128:
                continue
            treatment = cases.with_bucket_size(treatment, 128)
            try:
                days = cases.run_treatment(treatment, config, data, args.batch_size, args.seed)
            except ValueError as error:
                rows.append(_failed_row(treatment, setup, error))
                print(f"drift {treatment.name} failed: {error}", flush=True)
                continue
        rows += _auc_rows(
            treatment.name,
            setup,
            [d.auc for d in days],
            [d.timing for d in days],
            [d.notes for d in days],
            treatment.notes,
        )
        print(
            f"done drift {treatment.name}: mean AUC {rows[-1].throughput:.4f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    return rows


def _failed_row(treatment: cases.Treatment, setup: str, error: Exception) -> Row:
    return Row(
        op=TOPIC + "_drift_auc",
        pass_="mean",
        provider=treatment.name,
        config=setup,
        dtype="fp32",
        timing=NAN_TIMING,
        notes=f"{treatment.notes}; failed: {type(error).__name__}: {error}",
    )


def _auc_rows(name, setup, aucs, timings, notes, what) -> list[Row]:
    rows = [
        Row(
            op=TOPIC + "_drift_auc",
            pass_=f"day{d}->day{d + 1}",
            provider=name,
            config=setup,
            dtype="fp32",
            timing=timing,
            throughput=auc,
            throughput_unit="AUC",
            notes=f"{what}; train ms/step in the timing columns; {note}",
        )
        for d, (auc, timing, note) in enumerate(zip(aucs, timings, notes, strict=True))
    ]
    mean = sum(aucs) / len(aucs)
    p50 = sorted(t.p50_ms for t in timings)[len(timings) // 2]
    per_day = " ".join(f"{a:.4f}" for a in aucs)
    rows.append(
        Row(
            op=TOPIC + "_drift_auc",
            pass_="mean",
            provider=name,
            config=setup,
            dtype="fp32",
            timing=Timing(p50, p50, p50, sum(t.repeats for t in timings))
            if timings[0].repeats
            else NAN_TIMING,
            throughput=mean,
            throughput_unit="AUC",
            notes=f"{what}; mean over days of [{per_day}]; at the end: {notes[-1]}",
        )
    )
    return rows


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--map-rows", type=int, default=1 << 20, help="rows of the map tables")
    parser.add_argument("--map-batch", type=int, default=65536, help="keys per map call")
    parser.add_argument("--bucket-size", type=int, default=32, help="slots per map bucket")
    parser.add_argument("--batch-size", type=int, default=2048, help="train batch size")
    parser.add_argument("--steps", type=int, default=None, help="timed train steps")
    parser.add_argument("--days", type=int, default=6, help="drift: days trained")
    parser.add_argument("--day-samples", type=int, default=None, help="drift: train samples/day")
    parser.add_argument("--test-samples", type=int, default=None, help="drift: test samples/day")
    parser.add_argument(
        "--cap-fractions",
        type=float,
        nargs="+",
        default=[1.0, 0.5],
        help="drift: C = fraction x ids alive per day, for hash and capped dynamic",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    for option in (
        "map_rows",
        "map_batch",
        "batch_size",
        "steps",
        "days",
        "day_samples",
        "test_samples",
    ):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ValueError(f"--{option.replace('_', '-')}={value}; expected >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    quick = is_quick(args)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    repeats = args.repeats or (5 if quick else 20)
    steps = args.steps or repeats * 2
    args.day_samples = args.day_samples or (131072 if quick else 524288)
    args.test_samples = args.test_samples or (32768 if quick else 131072)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    config = load_config(RECIPE)
    rows: list[Row] = []
    start = time.perf_counter()
    if "map" in args.sections:
        rows += map_rows(args, device, warmup, repeats)
    if "train_step" in args.sections:
        rows += train_step_rows(args, config, device, warmup, steps)
    if "drift" in args.sections:
        if device.type != "cpu":
            raise SystemExit("--sections drift runs on cpu only")
        rows += drift_rows(args, config, device)
    print(f"\nwall time {time.perf_counter() - start:.0f} s\n")
    print_rows(rows)
    path = write_rows(TOPIC, rows, env, args.out_dir)
    print(f"\n{len(rows)} rows appended to {path}")


def print_rows(rows: list[Row]) -> None:
    header = ["op", "pass", "provider", "p50 ms", "p20-p80 ms", "throughput", "unit"]
    lines = [
        [
            r.op,
            r.pass_,
            r.provider,
            f"{r.timing.p50_ms:.2f}",
            f"{r.timing.p20_ms:.2f}-{r.timing.p80_ms:.2f}",
            "" if r.throughput is None else f"{r.throughput:,.4g}",
            r.throughput_unit,
        ]
        for r in rows
    ]
    print(format_table(header, lines))


if __name__ == "__main__":
    main()
