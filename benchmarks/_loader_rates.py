"""The loader alone, no model (``python -m benchmarks.data --loader-only``): samples/s that
``BatchLoader`` delivers from preprocessed parquet and from the synthetic source, in this
process and with worker processes, against the rate a GPU training step consumes; and, for
parquet, what one worker spends per stage, which says what limits the rate.

Cases (each an epoch, or the first ``--synthetic-batches`` batches of one, per timed call;
providers interleaved round by round):

- ``loader_alone`` / ``parquet`` and ``synthetic``: ``BatchLoader`` at the recipe's batch size
  (2048), shuffled over 4 chunks as the trainer reads: ``workers0`` (built in this process),
  ``prefetch4`` (a background thread, the old CUDA default), ``workers1``, ``workers2``. The
  throughput is rows over the whole call (the pool's start and the first shuffle buffer
  included); the notes add the steady rate after the first batch and the first batch's wait.
- ``loader_stage`` / ``parquet``: the stages of one task as a worker runs it, with one torch
  thread: read a row group (pyarrow decode), to a Batch (numpy columns, validation), the
  shuffle buffer (concat, gather each batch's permuted rows), the whole task (all of these,
  cut into batches, host offsets), packing it into shared memory; rows/s of each alone.

The GPU consumption rate is the last DLRM fixed-table step measured on a GPU in
``benchmarks/results/dynamic.csv`` (batch 2048), and :data:`GPU_TARGET` the rate the step
should reach (several million samples/s).
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from benchmarks._harness import (
    DEFAULT_RESULTS_DIR,
    REPO_ROOT,
    Row,
    Timing,
    environment,
    format_table,
    load_note,
    summarize,
    write_rows,
)
from recsys.config import PreprocessConfig, load_config
from recsys.data.batch import Batch, gather_batches
from recsys.data.etl import preprocess
from recsys.data.loader import BatchLoader, ChunkedDataset
from recsys.data.parquet import ParquetDataset, table_to_batch
from recsys.data.synthetic import SyntheticDataset
from recsys.data.workers import pack_batches, shared_empty

GPU_TARGET = 3_000_000
"""Samples/s a GPU DLRM step at batch 2048 should consume once it is not host-bound (issue
33's "several million"): a target, not a measurement."""
SHUFFLE_BUFFER_CHUNKS = 4
RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
PROVIDERS = {  # name: (workers, prefetch)
    "workers0": (0, 0),
    "prefetch4": (0, 4),
    "workers1": (1, 0),
    "workers2": (2, 0),
}


def gpu_consumption(results_dir: Path = DEFAULT_RESULTS_DIR) -> tuple[float, str] | None:
    """(samples/s, where) of the latest GPU DLRM fixed-table step at batch 2048 on record."""
    path = results_dir / "dynamic.csv"
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        rows = [
            r
            for r in csv.DictReader(f)
            if r["op"] == "dynamic_dlrm_step"
            and r["provider"] == "fixed_tables"
            and "batch=2048" in r["config"]
            and "NVIDIA" in r["device"]
        ]
    if not rows:
        return None
    last = max(rows, key=lambda r: r["timestamp"])
    where = f"{last['device']} {float(last['time_p50_ms']):.1f} ms/step at commit {last['commit']}"
    return float(last["throughput"]), where


def _epoch(make: Callable[[], BatchLoader], num_batches: int) -> tuple[float, float, int]:
    """(seconds, seconds to the first batch, rows) of the first ``num_batches`` batches."""
    start = time.perf_counter()
    first = None
    rows = 0
    iterator = iter(make())
    for index, batch in enumerate(iterator):
        rows += batch.batch_size
        if first is None:
            first = time.perf_counter() - start
        if index + 1 == num_batches:
            break
    iterator.close()
    return time.perf_counter() - start, first or 0.0, rows


def bench_sources(
    sources: dict[str, tuple[ChunkedDataset, int]],
    batch_size: int,
    repeats: int,
    gpu: tuple[float, str] | None,
) -> list[Row]:
    """``loader_alone`` rows: every source x provider (see the module docstring)."""
    rows = []
    for source, (dataset, num_batches) in sources.items():

        def make(workers: int, prefetch: int, dataset=dataset) -> BatchLoader:
            return BatchLoader(
                dataset,
                "train",
                batch_size,
                shuffle=True,
                drop_last=True,
                prefetch=prefetch,
                workers=workers,
                shuffle_buffer_chunks=SHUFFLE_BUFFER_CHUNKS,
            )

        num_batches = min(num_batches, len(make(0, 0)))
        load = load_note()
        samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in PROVIDERS}
        for workers, prefetch in PROVIDERS.values():  # warmup
            _epoch(lambda w=workers, p=prefetch: make(w, p), num_batches)
        for _ in range(repeats):
            for name, (workers, prefetch) in PROVIDERS.items():
                samples[name].append(_epoch(lambda w=workers, p=prefetch: make(w, p), num_batches))
        config = (
            f"source={source} rows={num_batches * batch_size} batch={batch_size} "
            f"shuffle=True buffer_chunks={SHUFFLE_BUFFER_CHUNKS} chunk_rows="
            f"{dataset.chunk_rows('train', 0)} drop_last=True"
        )
        for name, runs in samples.items():
            timing = summarize([seconds * 1e3 for seconds, _, _ in runs])
            num_rows = runs[0][2]
            rate = num_rows / (timing.p50_ms * 1e-3)
            steady = float(np.median([(n - batch_size) / (s - f) for s, f, n in runs]))
            first_ms = float(np.median([f for _, f, _ in runs])) * 1e3
            notes = [f"steady {steady:,.0f} rows/s after a first batch of {first_ms:.0f} ms"]
            if gpu is not None:
                notes.append(f"{steady / gpu[0]:.2f}x the GPU step's {gpu[0]:,.0f}/s ({gpu[1]})")
            notes.append(f"{steady / GPU_TARGET:.2f}x a {GPU_TARGET:,}/s GPU target")
            notes.append(load)
            rows.append(
                Row(
                    "loader_alone",
                    source,
                    f"recsys_{name}",
                    config,
                    "fp32+int64",
                    timing,
                    rate,
                    "rows/s",
                    "; ".join(notes),
                )
            )
    return rows


def bench_parquet_stages(dataset: ParquetDataset, batch_size: int, repeats: int) -> list[Row]:
    """``loader_stage`` rows: one shuffle buffer's stages, one torch thread (as a worker)."""
    loader = BatchLoader(
        dataset,
        "train",
        batch_size,
        shuffle=True,
        drop_last=True,
        shuffle_buffer_chunks=SHUFFLE_BUFFER_CHUNKS,
    )
    chunks = loader.tasks[0].segment.chunks
    groups = _row_groups(dataset)
    files = {path: pq.ParquetFile(path) for path, _ in groups}
    multi_hot = {c["name"] for c in dataset.metadata["categorical"] if c["multi_hot"]}
    buffer_rows = sum(dataset.chunk_rows("train", c) for c in chunks)
    order = torch.from_numpy(np.random.default_rng(0).permutation(buffer_rows))
    state: dict[str, object] = {}

    def read() -> None:
        state["tables"] = [files[groups[c][0]].read_row_group(groups[c][1]) for c in chunks]

    def to_batch(validate: bool) -> Callable[[], None]:
        def run() -> None:
            state["batches"] = [
                table_to_batch(t, dataset.spec, multi_hot, validate=validate)
                for t in state["tables"]
            ]

        return run

    def shuffle() -> None:
        buffer = Batch.concat(state["batches"])
        sizes = [batch_size] * (buffer_rows // batch_size)
        gather_batches(buffer, order[: sum(sizes)], sizes)

    def task() -> None:
        state["built"] = loader.build_task(0, shared_empty)

    stages = {
        "read_row_groups": read,
        "to_batch_validated": to_batch(True),
        "to_batch_unvalidated": to_batch(False),
        "concat_gather": shuffle,
        "build_task": task,
        "pack_shared_memory": lambda: pack_batches(state["built"]),
    }
    notes = {
        "read_row_groups": "pyarrow read + decode of the buffer's row groups",
        "to_batch_validated": "columns -> Batch with data.validate (labels, finite, id range)",
        "to_batch_unvalidated": "columns -> Batch, data.validate = false",
        "concat_gather": "concat the buffer's chunks, gather all batches' permuted rows in one "
        "pass per tensor (gather_batches)",
        "build_task": "a whole task as a worker runs it: read, to Batch, concat, gather into "
        "shared memory cut into batches with host offsets",
        "pack_shared_memory": "the task's places in shared memory for the trip (no copy)",
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in stages.values():  # in order: each stage's input comes from the one before
            fn()
        load = load_note()
        times: dict[str, list[float]] = {name: [] for name in stages}
        for _ in range(repeats):
            for name, fn in stages.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    config = (
        f"source=parquet buffer_rows={buffer_rows} chunks={len(chunks)} batch={batch_size} "
        "torch_threads=1"
    )
    rows = []
    for name, samples in times.items():
        timing: Timing = summarize(samples)
        rows.append(
            Row(
                "loader_stage",
                "parquet",
                name,
                config,
                "fp32+int64",
                timing,
                buffer_rows / (timing.p50_ms * 1e-3),
                "rows/s",
                f"{notes[name]}; {load}",
            )
        )
    return rows


def _row_groups(dataset: ParquetDataset) -> list[tuple[Path, int]]:
    """(file, row group) of every train chunk, in chunk order (as ParquetDataset numbers them)."""
    groups = []
    for name in dataset.metadata["splits"]["train"]["files"]:
        path = dataset.path / "train" / name
        groups += [(path, g) for g in range(pq.ParquetFile(path).metadata.num_row_groups)]
    return groups


def loader_only(
    args: argparse.Namespace, write_input: Callable[[Path, int, int, int], Path], topic: str
) -> None:
    """``python -m benchmarks.data --loader-only``: the rows above, appended to the topic's
    CSV. The parquet input is ``recsys preprocess`` of ``write_input``'s Criteo TSV (both kept
    in ``--work-dir`` when given); the synthetic source is the default recipe's."""
    recipe = load_config(RECIPE)
    batch_size = recipe.train.batch_size
    num_lines = args.rows or 1_000_000  # 14 row groups: 4 shuffle buffers of 4
    repeats = args.repeats or 3
    env = environment(torch.device("cpu"))
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as temp:
        work = args.work_dir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        tsv = write_input(work, num_lines, args.cardinality, args.seed)
        output = work / f"parquet_{tsv.name.split('.')[0]}"
        if not (output / "metadata.json").is_file():
            preprocess(PreprocessConfig(input=str(tsv), output=str(output), overwrite=True))
        parquet = ParquetDataset(output)
        synthetic = SyntheticDataset(recipe.data.synthetic, seed=recipe.run.seed)
        num_batches = parquet.num_samples("train") // batch_size
        gpu = gpu_consumption()
        sources = {
            "parquet": (parquet, num_batches),
            "synthetic": (synthetic, args.synthetic_batches),
        }
        rows = bench_sources(sources, batch_size, repeats, gpu)
        rows += bench_parquet_stages(parquet, batch_size, repeats)
    path = write_rows(topic, rows, env, args.out_dir)
    lines = [
        [r.op, r.pass_, r.provider, f"{r.timing.p50_ms:.1f}", f"{r.throughput:,.0f}", r.notes]
        for r in rows
    ]
    print(format_table(["op", "source", "provider", "p50 ms", "rows/s", "notes"], lines))
    print(f"\n{len(rows)} rows appended to {path}")
