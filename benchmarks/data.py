"""Benchmark the data path on CPU: preprocessing, the training loader, and whether the loader
keeps up with the DLRM recipe it feeds.

One run, on the same machine, measures:

- ``preprocess``: ``recsys.data.etl.preprocess`` end to end (read + validate a gzip Criteo TSV,
  carve valid / test, NVTabular Categorify fit + transform, parquet out), input lines/s;
- ``read_criteo``: the streaming read + validate stage alone (``recsys.data.criteo``), lines/s;
- ``loader``: one epoch of the preprocessed train split as KJT batches of 8192 rows (and of
  the recipe's 2048), shuffled (``shuffle_buffer_chunks=4``), ``drop_last``:
  ``recsys.data.loader.BatchLoader`` over ``ParquetDataset`` with ``prefetch`` 0 and 4, against
  the peer a user would write instead, a ``torch.utils.data.DataLoader`` over a map-style dataset
  (the split read once into numpy, one row per item) whose ``collate_fn`` builds the same
  :class:`~recsys.data.batch.Batch`, with ``num_workers`` 0 and 2 (persistent workers). The
  consumer here does nothing with a batch. The peer's one-time table load is its own row.
- ``dlrm_train``: the consumer, the ``configs/dlrm_synthetic.toml`` recipe's training step
  (forward, BCE, backward, dense + embedding optimizer steps, as ``recsys.train.trainer``) at its
  batch size (2048) on batches built beforehand from the same parquet data, samples/s; and one
  epoch of the same training fed live by ``BatchLoader`` with ``prefetch`` 0 and 4, as the
  trainer feeds it, which adds what the loader costs when it shares the cores with training.

The issue's acceptance is that the loader produces batches faster than the DLRM recipe consumes
them on this CPU: the script prints the ratio (``BatchLoader(prefetch=4)`` rows/s over DLRM
samples/s on prebuilt batches) and records it in the notes column, beside the live-fed rates.
Every row's notes carry the 1-minute load average when its case started: on a shared 2-core
machine other work shows up there.

Input: ``SyntheticDataset.write_criteo`` (26 one-hot features of ``--cardinality`` ids, 13 dense,
a known teacher), written once per run into a temporary directory (``write_criteo`` is a slow
Python loop), or kept and reused across runs in ``--work-dir``. Before anything is timed the
script checks that both loaders yield the same number of rows, that with shuffling off every
recsys batch equals the peer's batch of the same rows (dense, labels, KJT keys / values /
lengths), and that a shuffled epoch without ``drop_last`` holds every row exactly once (column
sums).

Run: ``python -m benchmarks.data [--quick | --full]``; rows go to
``benchmarks/results/data.csv`` (see ``benchmarks/_harness.py``). ``--loader-only``: the loader
alone, from parquet and the synthetic source, against a GPU step's consumption
(``benchmarks/_loader_rates.py``).
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from benchmarks import _loader_rates
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
from recsys import Batch, DatasetSpec, KeyedJaggedTensor, load_config  # quiets torchrec's import
from recsys.build.models import build_model
from recsys.config import PreprocessConfig, SyntheticConfig
from recsys.data.criteo import read_criteo
from recsys.data.etl import preprocess
from recsys.data.loader import BatchLoader
from recsys.data.parquet import ParquetDataset
from recsys.data.synthetic import SyntheticDataset
from recsys.train.optimizers import build_optimizers

TOPIC = "data"
NUM_CAT, NUM_DENSE = 26, 13
LOADER_BATCH = 8192
STRADDLING_BATCH = 5000  # divides no row group size: its batches join pieces of two row groups
SHUFFLE_BUFFER_CHUNKS = 4
PREBUILT_BATCHES = 32  # DLRM steps cycle over this many batches built beforehand
RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
DTYPE = "fp32+int64"  # dense / labels float32, ids int64


@dataclass
class Result:
    """A CSV row (throughput: rows or samples per second at p50) and the batches per timed call."""

    row: Row
    batches_per_call: int | None = None
    batch_size: int | None = None

    @property
    def rows_per_s(self) -> float:
        return self.row.throughput

    @property
    def batches_per_s(self) -> float | None:
        if self.batches_per_call is None:
            return None
        return self.batches_per_call / (self.row.timing.p50_ms * 1e-3)


def make_result(
    op: str,
    pass_: str,
    provider: str,
    config: str,
    timing: Timing,
    rows_per_call: int,
    batches_per_call: int | None = None,
    notes: str = "",
) -> Result:
    rows_per_s = rows_per_call / (timing.p50_ms * 1e-3)
    unit = "samples/s" if op == "dlrm_train" else "rows/s"
    row = Row(op, pass_, provider, config, DTYPE, timing, rows_per_s, unit, notes)
    batch_size = rows_per_call // batches_per_call if batches_per_call else None
    return Result(row, batches_per_call, batch_size)


# ---------------------------------------------------------------------------------------------
# Input and preprocessing


def write_input(directory: Path, num_rows: int, cardinality: int, seed: int) -> Path:
    """A gzip Criteo TSV of ``num_rows`` synthetic lines, reused when already in ``directory``."""
    path = directory / f"criteo_synthetic_{num_rows}_c{cardinality}_seed{seed}.tsv.gz"
    if path.is_file():
        print(f"reusing {path}")
        return path
    config = SyntheticConfig(cardinalities=[cardinality] * NUM_CAT, num_train_samples=num_rows)
    start = time.perf_counter()
    partial = path.with_name("partial_" + path.name)  # still ends in .gz: gzip
    written = SyntheticDataset(config, seed=seed).write_criteo(partial)
    partial.rename(path)
    assert written == num_rows, (written, num_rows)
    print(f"wrote {path} ({num_rows} lines) in {time.perf_counter() - start:.1f} s", flush=True)
    return path


def bench_preprocess(
    tsv: Path, output: Path, num_lines: int, warmup: int, repeats: int
) -> list[Result]:
    """``preprocess`` end to end and ``read_criteo`` alone, lines of input per second."""
    preprocess_config = PreprocessConfig(input=str(tsv), output=str(output), overwrite=True)
    chunk_bytes = preprocess_config.chunk_mb << 20  # the piece size preprocess reads with

    def run_preprocess() -> None:
        report = preprocess(preprocess_config)
        lines = sum(report.rows.values()) + report.malformed.count
        assert lines == num_lines, (lines, num_lines)

    def run_read() -> None:
        lines = sum(table.num_rows for table in read_criteo(tsv, chunk_bytes))
        assert lines == num_lines, (lines, num_lines)

    config = (
        f"lines={num_lines} tables={NUM_CAT} one-hot dense={NUM_DENSE} tsv.gz "
        f"chunk_mb={preprocess_config.chunk_mb}"
    )
    notes = load_note()
    timings = time_fns(
        {"read": run_read, "preprocess": run_preprocess},
        torch.device("cpu"),
        warmup=warmup,
        repeats=repeats,
    )
    return [
        make_result(
            "preprocess",
            "etl",
            "recsys_preprocess",
            f"{config} encoding=categorify row_group_rows={preprocess_config.row_group_rows}",
            timings["preprocess"],
            num_lines,
            notes=f"stage + NVTabular fit + transform + parquet write; imports in warmup; {notes}",
        ),
        make_result(
            "read_criteo",
            "read",
            "recsys_read_criteo",
            config,
            timings["read"],
            num_lines,
            notes=f"parse + validate every field, drained; {notes}",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# The peer: torch.utils.data.DataLoader over a map-style dataset


class RowDataset(torch.utils.data.Dataset):
    """What a user writes without recsys: the split read whole into numpy, one row per item."""

    def __init__(self, files: Iterable[Path], spec: DatasetSpec) -> None:
        frame = pa.concat_tables([pq.read_table(f) for f in files]).to_pandas()
        self.dense = frame[list(spec.dense_names)].to_numpy(np.float32)  # [N, N_dense]
        self.ids = frame[list(spec.sparse_names)].to_numpy(np.int64)  # [N, F]
        self.labels = frame[list(spec.label_names)].to_numpy(np.float32)  # [N, T]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.from_numpy(self.dense[index]),
            torch.from_numpy(self.ids[index]),
            torch.from_numpy(self.labels[index]),
        )

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes + self.ids.nbytes + self.labels.nbytes


def collate_rows(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], keys: list[str]
) -> Batch:
    """Rows -> the same Batch recsys builds: one-hot KJT, key-major."""
    dense, ids, labels = zip(*rows, strict=True)
    ids = torch.stack(ids)  # [B, F]
    return Batch(
        dense=torch.stack(dense),  # [B, N_dense]
        sparse=KeyedJaggedTensor(
            keys=keys,
            values=ids.T.reshape(-1),  # [F*B], all of key 0's bags, then key 1's, ...
            lengths=torch.ones(ids.numel(), dtype=torch.int32),
        ),
        labels=torch.stack(labels),  # [B, T]
    )


def torch_loader(
    rows: RowDataset, spec: DatasetSpec, batch_size: int, shuffle: bool, num_workers: int
) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        rows,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        collate_fn=functools.partial(collate_rows, keys=list(spec.sparse_names)),
    )


# ---------------------------------------------------------------------------------------------
# recsys: the training loader


def shuffled_loader(
    dataset: ParquetDataset, batch_size: int, prefetch: int = 0, drop_last: bool = True
) -> BatchLoader:
    """The train split as the trainer reads it: shuffled, rows mixed over 4 row groups."""
    return BatchLoader(
        dataset,
        "train",
        batch_size,
        shuffle=True,
        drop_last=drop_last,
        prefetch=prefetch,
        shuffle_buffer_chunks=SHUFFLE_BUFFER_CHUNKS,
    )


# ---------------------------------------------------------------------------------------------
# Sanity checks (not timed)


def check_loaders(dataset: ParquetDataset, rows: RowDataset, batch_size: int) -> None:
    """Same row count; unshuffled batches equal row for row, at ``batch_size`` and at an odd size
    whose batches straddle row groups; a shuffled epoch has every row's values once (sums)."""
    num_rows = dataset.num_samples("train")
    if len(rows) != num_rows:
        raise AssertionError(f"peer holds {len(rows)} rows, ParquetDataset {num_rows}")
    for size in (batch_size, STRADDLING_BATCH):
        ours = list(BatchLoader(dataset, "train", size, drop_last=True))
        theirs = list(torch_loader(rows, dataset.spec, size, shuffle=False, num_workers=0))
        if len(ours) != len(theirs) or len(ours) != num_rows // size:
            raise AssertionError(f"batch {size}: {len(ours)} recsys, {len(theirs)} peer batches")
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            where = f"unshuffled batch {index} of {size}"
            if a.sparse.keys() != b.sparse.keys():
                raise AssertionError(f"{where}: keys {a.sparse.keys()} != {b.sparse.keys()}")
            torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0, msg=f"{where}: dense")
            torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0, msg=f"{where}: label")
            torch.testing.assert_close(a.sparse.values(), b.sparse.values(), msg=f"{where}: ids")
            torch.testing.assert_close(a.sparse.lengths(), b.sparse.lengths(), msg=f"{where}: len")

    shuffled = list(shuffled_loader(dataset, batch_size, drop_last=False))
    if sum(len(b) for b in shuffled) != num_rows:
        raise AssertionError("a shuffled epoch without drop_last does not hold every row")
    dense = torch.cat([b.dense for b in shuffled]).double()
    torch.testing.assert_close(
        dense.sum(0), torch.from_numpy(rows.dense).double().sum(0), msg="shuffled dense sums"
    )
    id_sums = torch.stack(
        [torch.stack([jt.values().sum() for jt in b.sparse.split([1] * NUM_CAT)]) for b in shuffled]
    ).sum(0)
    torch.testing.assert_close(id_sums, torch.from_numpy(rows.ids).sum(0), msg="shuffled id sums")
    print(
        f"checked: unshuffled batches of {batch_size} and {STRADDLING_BATCH} equal the peer's; "
        f"a shuffled epoch holds all {num_rows} rows once"
    )


# ---------------------------------------------------------------------------------------------
# Loader throughput


def drain(batches: Iterable[Batch]) -> tuple[int, int]:
    """(rows, batches) of one pass; the batches themselves are dropped."""
    num_rows = num_batches = 0
    for batch in batches:
        num_rows += batch.batch_size
        num_batches += 1
    return num_rows, num_batches


def bench_loaders(
    dataset: ParquetDataset, rows: RowDataset, batch_size: int, warmup: int, repeats: int
) -> list[Result]:
    """One shuffled epoch of batches of ``batch_size`` per timed call, every provider,
    interleaved."""
    spec = dataset.spec
    num_rows = dataset.num_samples("train")
    expected = (num_rows // batch_size * batch_size, num_rows // batch_size)

    def recsys_epoch(prefetch: int) -> Callable[[], None]:
        def run() -> None:
            got = drain(shuffled_loader(dataset, batch_size, prefetch))
            assert got == expected, (got, expected)

        return run

    peers = {w: torch_loader(rows, spec, batch_size, True, w) for w in (0, 2)}

    def torch_epoch(num_workers: int) -> Callable[[], None]:
        def run() -> None:
            got = drain(peers[num_workers])
            assert got == expected, (got, expected)

        return run

    fns = {
        "recsys_prefetch0": recsys_epoch(0),
        "recsys_prefetch4": recsys_epoch(4),
        "torch_dataloader_workers0": torch_epoch(0),
        "torch_dataloader_workers2": torch_epoch(2),
    }
    notes = {
        "recsys_prefetch0": "BatchLoader(ParquetDataset) reads row groups each epoch; no thread",
        "recsys_prefetch4": "BatchLoader(ParquetDataset) reads row groups each epoch; "
        "background thread 4 batches ahead",
        "torch_dataloader_workers0": "map-style Dataset over the split in memory; per-row "
        "tensors; collate_fn builds the KJT Batch",
        "torch_dataloader_workers2": "as workers0 with 2 persistent worker processes",
    }
    config = (
        f"rows={num_rows} chunks={dataset.num_chunks('train')} batch={batch_size} "
        f"shuffle=True buffer_chunks={SHUFFLE_BUFFER_CHUNKS} drop_last=True one-hot"
    )
    load = load_note()
    timings = time_fns(fns, torch.device("cpu"), warmup=warmup, repeats=repeats)
    peers.clear()  # shuts the persistent workers down
    return [
        make_result(
            "loader",
            "epoch",
            name,
            config,
            timings[name],
            expected[0],
            expected[1],
            notes=f"{notes[name]}; {load}",
        )
        for name in fns
    ]


# ---------------------------------------------------------------------------------------------
# The consumer: the DLRM recipe's training step


def bench_dlrm(
    dataset: ParquetDataset, num_prebuilt: int, warmup: int, repeats: int, epoch_repeats: int
) -> list[Result]:
    """Train steps on batches built beforehand (samples/s the model consumes), then epochs fed
    live by ``BatchLoader`` with prefetch 0 and 4 (the loader shares the cores with training)."""
    recipe = load_config(RECIPE)
    batch_size = recipe.train.batch_size
    torch.manual_seed(recipe.run.seed)
    device = torch.device("cpu")
    model = build_model(recipe.model, dataset.spec, device)
    optimizers = build_optimizers(recipe.train, model)
    model.train()

    def train_step(batch: Batch) -> None:  # as recsys.train.trainer._Run._train_step
        logits = model(batch.dense, batch.sparse)  # [B, T]
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for optimizer in optimizers.values():
            optimizer.step()

    prebuilt = list(shuffled_loader(dataset, batch_size))[:num_prebuilt]
    position = 0

    def prebuilt_step() -> None:
        nonlocal position
        train_step(prebuilt[position % len(prebuilt)])
        position += 1

    steps_per_epoch = len(shuffled_loader(dataset, batch_size))

    def fed_epoch(prefetch: int) -> Callable[[], None]:
        def run() -> None:
            for batch in shuffled_loader(dataset, batch_size, prefetch):
                train_step(batch)

        return run

    m, sizes = recipe.model, lambda layers: "x".join(map(str, layers))
    config = (
        f"recipe={RECIPE.name} batch={batch_size} tables={NUM_CAT} "
        f"rows<={max(dataset.spec.cardinalities)} dim={m.embedding_dim} "
        f"bottom={sizes(m.dense_arch_layer_sizes)} top={sizes(m.over_arch_layer_sizes)} "
        f"optim={recipe.train.dense_optimizer}+{recipe.train.embedding_optimizer}"
    )
    load = load_note()
    step_timing = time_fns({"step": prebuilt_step}, device, warmup=warmup, repeats=repeats)["step"]
    fed = {f"recsys_loader_prefetch{p}": (p, fed_epoch(p)) for p in (0, 4)}
    epoch_timings = time_fns(
        {name: run for name, (_, run) in fed.items()}, device, warmup=0, repeats=epoch_repeats
    )
    results = [
        make_result(
            "dlrm_train",
            "step",
            "recsys_prebuilt_batches",
            config,
            step_timing,
            batch_size,
            1,
            notes=f"fwd + BCE + bwd + both optimizer steps on {len(prebuilt)} batches built "
            f"beforehand from the parquet data; {load}",
        )
    ]
    for name, (prefetch, _) in fed.items():
        results.append(
            make_result(
                "dlrm_train",
                "epoch",
                name,
                config,
                epoch_timings[name],
                steps_per_epoch * batch_size,
                steps_per_epoch,
                notes=f"one epoch ({steps_per_epoch} steps) fed live by "
                f"BatchLoader(prefetch={prefetch}), as the trainer does; {load}",
            )
        )
    return results


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--rows", type=int, help="input lines (default 100k quick, 1M full)")
    parser.add_argument("--cardinality", type=int, default=10_000, help="ids per feature")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="keep the generated TSV here and reuse it across runs (default: a temp dir)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loader-only", action="store_true", help=_loader_rates.__doc__)
    parser.add_argument("--synthetic-batches", type=int, default=128, help="with --loader-only")
    args = parser.parse_args()
    if args.loader_only:
        return _loader_rates.loader_only(args, write_input, TOPIC)
    device = resolve_device(args.device)
    if device.type != "cpu":
        raise SystemExit("benchmarks.data measures the CPU data path; run it with --device cpu")
    quick = is_quick(args)
    num_lines = args.rows or (100_000 if quick else 1_000_000)
    warmup = args.warmup if args.warmup is not None else 1
    # Timed calls: preprocess runs (seconds each), loader epochs, DLRM steps (tens of ms).
    repeats, epoch_repeats, step_repeats = (3, 5, 50) if quick else (3, 5, 200)
    if args.repeats is not None:
        repeats = epoch_repeats = step_repeats = args.repeats

    train_batch = load_config(RECIPE).train.batch_size  # the consumer's batch size

    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    print(load_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as temp:
        work = args.work_dir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        tsv = write_input(work, num_lines, args.cardinality, args.seed)
        output = Path(temp) / "parquet"
        results = bench_preprocess(tsv, output, num_lines, warmup, repeats)
        print("done preprocess", flush=True)

        dataset = ParquetDataset(output)
        files = [output / "train" / f for f in dataset.metadata["splits"]["train"]["files"]]
        start = time.perf_counter()
        rows = RowDataset(files, dataset.spec)
        load_ms = (time.perf_counter() - start) * 1e3
        results.append(
            make_result(
                "loader_setup",
                "setup",
                "torch_dataloader",
                f"rows={len(rows)}",
                Timing(load_ms, load_ms, load_ms, repeats=1),
                len(rows),
                notes=f"the peer's one-time read of the split into numpy "
                f"({rows.nbytes / 2**20:.0f} MiB held), not in its epoch times; {load_note()}",
            )
        )
        check_loaders(dataset, rows, LOADER_BATCH)
        for batch_size in (LOADER_BATCH, train_batch):
            results += bench_loaders(dataset, rows, batch_size, warmup, epoch_repeats)
        del rows
        print("done loaders", flush=True)

        results += bench_dlrm(dataset, PREBUILT_BATCHES, 3, step_repeats, repeats)
        print("done dlrm", flush=True)
    add_verdict(results)

    path = write_rows(TOPIC, [r.row for r in results], env, args.out_dir)
    print_summary(results)
    print(f"\n{len(results)} rows appended to {path}")


def add_verdict(results: list[Result]) -> None:
    """The acceptance check: loader rows/s (prefetch=4) over DLRM samples/s, in the notes; and
    what feeding training live costs."""
    train = next(r for r in results if r.row.provider == "recsys_prebuilt_batches")
    loaders = [r for r in results if r.row.op == "loader" and r.row.provider == "recsys_prefetch4"]
    print()
    for loader in loaders:
        ratio = loader.rows_per_s / train.rows_per_s
        verdict = "loader keeps up" if ratio > 1 else "LOADER IS THE BOTTLENECK"
        note = f"loader_prefetch4/dlrm_consume={ratio:.2f}x ({verdict})"
        loader.row.notes = f"{note}; {loader.row.notes}"
        train.row.notes = f"{note} at loader batch {loader.batch_size}; {train.row.notes}"
        print(
            f"acceptance: BatchLoader(prefetch=4) makes {loader.rows_per_s:,.0f} rows/s at batch "
            f"{loader.batch_size}; DLRM consumes {train.rows_per_s:,.0f} samples/s at batch "
            f"{train.batch_size}: {ratio:.2f}x -> {verdict}"
        )
    for fed in (r for r in results if r.row.op == "dlrm_train" and r.row.pass_ == "epoch"):
        fed_ratio = fed.rows_per_s / train.rows_per_s
        fed.row.notes = f"{fed_ratio:.2f}x the prebuilt-batch rate; {fed.row.notes}"
        print(
            f"training fed live ({fed.row.provider}) runs at {fed.rows_per_s:,.0f} samples/s, "
            f"{fed_ratio:.2f}x the rate on batches built beforehand"
        )


def print_summary(results: list[Result]) -> None:
    """One line per row: p50 time, rows/s, batches/s."""
    lines = []
    for r in results:
        batches = r.batches_per_s
        lines.append(
            [
                r.row.op,
                r.row.pass_,
                r.row.provider,
                f"{r.row.timing.p50_ms:.1f}",
                f"{r.row.timing.p20_ms:.1f}-{r.row.timing.p80_ms:.1f}",
                f"{r.row.timing.repeats}",
                f"{r.rows_per_s:,.0f}",
                "-" if batches is None else f"{batches:.2f}",
            ]
        )
    header = ["op", "pass", "provider", "p50 ms", "p20-p80 ms", "n", "rows/s", "batches/s"]
    print()
    print(format_table(header, lines))


if __name__ == "__main__":
    main()
