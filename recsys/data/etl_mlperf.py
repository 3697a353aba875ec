"""``recsys preprocess --preprocess.encoding=mlperf``: Criteo 1TB day files -> the multi-hot data
of MLPerf Training's DLRM-DCNv2, id for id.

The reference (``recommendation_v2/torchrec_dlrm`` in mlcommons/training) builds its data in
steps; this does the same in one streaming pass per file, with memory bounded by the number of
distinct values instead of the size of the log:

1. **One-hot ids** (TorchRec's ``tsv_to_npys`` and ``sparse_to_contiguous`` with frequency
   threshold 0, which ``process_Criteo_1TB_Click_Logs_dataset.sh`` runs): each category is its
   hex value as an integer (missing: 0), and each column numbers its values from 2 in the order
   they first appear, reading the files in order (train, then valid, then test; files named
   ``day_<n>`` in day order). The id is that number modulo the table's rows
   (``mlperf_table_rows``, the reference's ``num_embeddings_per_feature``: 40M rows at most).
2. **Multi-hot bags** (``materialize_synthetic_multihot_dataset.py`` and ``multi_hot.py``): a
   feature with bag size ``m`` maps id ``i`` to the bag ``[i, r_1 .. r_{m-1}]``, row ``i`` of a
   lookup table drawn once from numpy's legacy generator seeded with 0, one table after the
   other (``randint(0, rows, (rows, m - 1))``, or ``pareto(0.25)`` as int32 modulo rows). The
   tables are written to disk in pieces (int32; 23 GB at MLPerf's sizes) in the order the
   reference draws them, so the stream of numbers and every bag are the reference's.
3. **Dense and labels** (``tsv_to_npys``): missing counts are 0, each file's counts are shifted
   by that file's smallest count to start at 2 and take the float32 log; labels are 0/1.
4. **Splits**: the ``--input`` files are train, in order (the reference shuffles days 0-22 as
   one array in memory; ``recsys train`` shuffles chunks and rows itself); the ``--valid`` file
   (day 23) is cut in halves as the reference cuts it: the first ``ceil(n / 2)`` rows are valid,
   the rest test. With ``--test`` as well, each file is its whole split.

Output: every categorical feature is a multi-hot list column (int32 ids, bags of the fixed size)
in the parquet layout of ``recsys.data.etl``; metadata.json has the table rows as cardinalities,
so ``recsys train --config configs/dlrm_dcnv2_mlperf.toml --data.path=DIR`` reads it. Memory:
12 bytes per distinct value of each column (its 64-bit value and id), plus a piece of input.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recsys.config import PreprocessConfig
from recsys.data import criteo
from recsys.data.etl_raw import RawWriter
from recsys.data.prepared import FORMAT_VERSION, SPLITS
from recsys.data.readers import MalformedLines, Roles

__all__ = ["DENSE_TRANSFORM", "FirstSeenIds", "MultiHotTables", "check_mlperf", "run_mlperf"]

DENSE_TRANSFORM = "missing -> 0, then log(x - min + 2) in float32, min over each input file"
_FIRST_ID = 2  # TorchRec's contiguous ids start at 2 (1 is its rare id, unused at threshold 0)
_DRAW_VALUES = 1 << 23  # numbers drawn per piece of a lookup table (64 MB as int64)


def check_mlperf(config: PreprocessConfig) -> None:
    """The options ``encoding = "mlperf"`` needs, checked before anything is read."""
    expected = criteo.NUM_CAT
    problems = []
    if config.format != "criteo":
        problems.append(
            f"format {config.format!r} (it reads Criteo TSV day files: --format criteo)"
        )
    if config.apply:
        problems.append("apply (nothing is fitted: run it on the day files themselves)")
    if config.normalize_dense:
        problems.append("normalize_dense = true (the reference's dense values are only logged)")
    if not config.valid:
        problems.append("no --valid file (the reference's day 23: half valid, half test)")
    for key in ("mlperf_table_rows", "mlperf_bag_sizes"):
        values = getattr(config, key)
        if len(values) != expected:
            problems.append(f"{key} has {len(values)} values, expected {expected}")
        elif min(values) < 1 or (key == "mlperf_table_rows" and max(values) >= 1 << 31):
            problems.append(f"{key} = {values}: each must be in [1, 2^31)")
    if problems:
        raise ValueError("preprocess.encoding = 'mlperf' cannot run: " + "; ".join(problems))


def run_mlperf(
    config: PreprocessConfig,
    sources: dict[str, list[Path]],
    work: Path,
    malformed: MalformedLines,
    clean: Callable[[pa.Table, Path], pa.Table],
) -> tuple[dict[str, int], dict[str, Any]]:
    """Write the splits into ``work``: (rows per split, the metadata keys of the columns).

    Args:
        config: checked by :func:`check_mlperf`.
        sources: the files of train, valid and (optionally) test.
        work: the output directory being written.
        malformed: collects the lines skipped.
        clean: counts what a piece holds (missing and negative counts) and returns it.
    """
    roles = Roles([], list(criteo.CAT_COLUMNS), list(criteo.INT_COLUMNS), [criteo.LABEL])
    need = 4 * sum(
        rows * (size - 1)
        for rows, size in zip(config.mlperf_table_rows, config.mlperf_bag_sizes, strict=True)
    )
    free = shutil.disk_usage(work).free
    if need > free:
        raise ValueError(
            f"the multi-hot lookup tables need {need / 1e9:.1f} GB of disk beside the output "
            f"('{work.parent}'), which has {free / 1e9:.1f} GB free; free space or write the "
            "output elsewhere"
        )
    start = time.perf_counter()
    tables = MultiHotTables(
        config.mlperf_table_rows,
        config.mlperf_bag_sizes,
        config.mlperf_bag_distribution,
        work / "_multi_hot_tables",
    )
    drawn = {"bytes": tables.nbytes, "seconds": round(time.perf_counter() - start, 3)}
    vocabularies = [FirstSeenIds() for _ in criteo.CAT_COLUMNS]
    bag = pa.list_(pa.int32())
    fingerprint = _fingerprint(config, sources)
    writer = RawWriter(work, roles, config, fingerprint, {name: bag for name in roles.multi_hot})
    try:
        for split, path in _files_in_order(sources):
            _materialize_file(
                config, path, split, sources, work, tables, vocabularies, writer, malformed, clean
            )
    except BaseException:
        writer.abort()
        raise
    rows = writer.close()
    tables.remove()
    (work / "_staging").rmdir()
    categorical = [
        {"name": name, "cardinality": rows_, "multi_hot": True, "bag_size": size}
        for name, rows_, size in zip(
            roles.multi_hot, config.mlperf_table_rows, config.mlperf_bag_sizes, strict=True
        )
    ]
    described = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "id_encoding": "index",
        "labels": roles.labels,
        "dense": roles.dense,
        "categorical": categorical,
        "dense_transform": DENSE_TRANSFORM,
        "mlperf": {
            "distinct_values": [len(v) for v in vocabularies],
            "vocabulary_sha256": _vocabulary_digest(vocabularies),
            "bag_distribution": config.mlperf_bag_distribution,
            "lookup_tables": drawn,
        },
    }
    return rows, described


class FirstSeenIds:
    """Ids numbered from 2 in the order values first appear, as TorchRec's
    ``sparse_to_contiguous`` numbers them, in sorted runs of (value, id) merged as they grow
    (a log-structured merge): 12 bytes per distinct value, each lookup a binary search per run.

    Example::

        ids = FirstSeenIds()
        ids.ids(np.array([7, 5, 7], np.uint64))   # [2, 3, 2]
        ids.ids(np.array([9, 5], np.uint64))      # [4, 3]
    """

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted values, their ids)
        self._next = _FIRST_ID

    def __len__(self) -> int:
        return self._next - _FIRST_ID

    def ids(self, values: np.ndarray) -> np.ndarray:
        """The id of each value (uint64), new values numbered in the order of this array."""
        unique, first, inverse = np.unique(values, return_index=True, return_inverse=True)
        ids = np.zeros(len(unique), np.int64)
        found = np.zeros(len(unique), bool)
        for run_values, run_ids in self._runs:
            at = np.minimum(np.searchsorted(run_values, unique), len(run_values) - 1)
            hit = run_values[at] == unique
            ids[hit] = run_ids[at[hit]]
            found |= hit
        new = np.flatnonzero(~found)
        ids[new[np.argsort(first[new], kind="stable")]] = np.arange(
            self._next, self._next + len(new)
        )
        self._next += len(new)
        if len(new):
            self._add_run(unique[new], ids[new].astype(np.uint32))
        return ids[inverse]

    def sorted_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (value, id), sorted by value: one run."""
        while len(self._runs) > 1:
            self._merge_last()
        return self._runs[0] if self._runs else (np.zeros(0, np.uint64), np.zeros(0, np.uint32))

    def _add_run(self, values: np.ndarray, ids: np.ndarray) -> None:
        self._runs.append((values, ids))
        while len(self._runs) > 1 and len(self._runs[-2][0]) <= 2 * len(self._runs[-1][0]):
            self._merge_last()

    def _merge_last(self) -> None:
        (values_b, ids_b), (values_a, ids_a) = self._runs.pop(), self._runs.pop()
        values = np.concatenate([values_a, values_b])
        order = np.argsort(values, kind="stable")
        self._runs.append((values[order], np.concatenate([ids_a, ids_b])[order]))


class MultiHotTables:
    """The reference's one-hot -> multi-hot lookup tables, drawn as it draws them and kept on
    disk (int32 ``.npy``, read through memory maps): row ``i`` of table ``j`` holds the
    ``bag_sizes[j] - 1`` ids that join id ``i`` in its bag.

    Args:
        rows: rows of each table (the reference's ``num_embeddings_per_feature``).
        bag_sizes: ids per bag of each feature (1: the id alone; no table).
        distribution: ``uniform`` or ``pareto``, the reference's ``multi_hot_distribution_type``.
        directory: where the tables go (created; :meth:`remove` deletes it).
        draw_values: numbers drawn per piece (memory; the numbers do not depend on it).
    """

    def __init__(
        self,
        rows: list[int],
        bag_sizes: list[int],
        distribution: str,
        directory: Path,
        draw_values: int = _DRAW_VALUES,
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        state = np.random.RandomState(0)  # the reference: np.random.seed(0), then each table
        self.tables: list[np.ndarray | None] = []
        for index, (count, size) in enumerate(zip(rows, bag_sizes, strict=True)):
            if size == 1:  # the reference draws a (rows, 0) array: no numbers
                self.tables.append(None)
                continue
            path = directory / f"table_{index}.npy"
            step = max(1, draw_values // (size - 1))
            with open(path, "wb") as out:  # written, not mapped: the pages stay out of RSS
                header = {"descr": "<i4", "fortran_order": False, "shape": (count, size - 1)}
                np.lib.format.write_array_header_1_0(out, header)
                for start in range(0, count, step):
                    shape = (min(step, count - start), size - 1)
                    if distribution == "uniform":
                        drawn = state.randint(0, count, size=shape)
                    else:  # as the reference: doubles past 2^31 cast to int32 (INT_MIN on x86)
                        with np.errstate(invalid="ignore"):
                            drawn = state.pareto(a=0.25, size=shape).astype(np.int32) % count
                    out.write(drawn.astype(np.int32, copy=False).tobytes())
            self.tables.append(np.load(path, mmap_mode="r"))

    @property
    def nbytes(self) -> int:
        """Bytes of the tables (on disk)."""
        return sum(table.nbytes for table in self.tables if table is not None)

    def bags(self, feature: int, ids: np.ndarray) -> pa.ListArray:
        """The bags of one-hot ``ids`` of ``feature``: a list array of int32, fixed size."""
        table = self.tables[feature]
        ids32 = ids.astype(np.int32)
        values = ids32 if table is None else np.column_stack([ids32, table[ids32]]).reshape(-1)
        size = 1 if table is None else table.shape[1] + 1
        offsets = np.arange(0, len(ids) * size + 1, size, dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32()))

    def remove(self) -> None:
        """Delete the tables' files."""
        self.tables = []
        for file in self.directory.glob("*.npy"):
            file.unlink()
        self.directory.rmdir()


def _files_in_order(sources: dict[str, list[Path]]) -> Iterator[tuple[str, Path]]:
    """(split, file): train, valid, test; within each, ``day_<n>`` files by n."""

    def day_order(path: Path) -> tuple:
        return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.name))

    for split in SPLITS:
        for path in sorted(sources.get(split, []), key=day_order):
            yield split, path


def _materialize_file(
    config: PreprocessConfig,
    path: Path,
    split: str,
    sources: dict[str, list[Path]],
    work: Path,
    tables: MultiHotTables,
    vocabularies: list[FirstSeenIds],
    writer: RawWriter,
    malformed: MalformedLines,
    clean: Callable[[pa.Table, Path], pa.Table],
) -> None:
    """One input file: ids and bags piece by piece into a staging directory (the dense shift
    needs the file's smallest count, known at its end), then dense values and splits."""
    staging = work / "_staging"
    staging.mkdir(exist_ok=True)
    smallest, pieces = None, []
    for piece in criteo.read_criteo(path, config.chunk_mb << 20, config.strict, malformed):
        piece = clean(piece, path)
        if piece.num_rows == 0:  # every line of this piece was malformed
            continue
        counts = np.column_stack(
            [piece.column(c).fill_null(0).to_numpy() for c in criteo.INT_COLUMNS]
        ).astype(np.int64)
        outside = (counts < -(1 << 31)) | (counts >= 1 << 31)
        if outside.any():
            raise ValueError(
                f"'{path}': count {counts[outside][0]} does not fit int32, the type the "
                "reference's layout stores counts in"
            )
        smallest = counts.min() if smallest is None else min(smallest, counts.min())
        columns = {criteo.LABEL: pc.cast(piece.column(criteo.LABEL), pa.float32())}
        columns.update(
            {c: pa.array(counts[:, i].astype(np.int32)) for i, c in enumerate(criteo.INT_COLUMNS)}
        )
        for feature, name in enumerate(criteo.CAT_COLUMNS):
            values = criteo.parse_hex(piece.column(name))
            ids = vocabularies[feature].ids(values) % config.mlperf_table_rows[feature]
            columns[name] = tables.bags(feature, ids)
        file = staging / f"piece_{len(pieces):06d}.parquet"
        pq.write_table(pa.table(columns), file)
        pieces.append(file)
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in pieces)
    halves = split == "valid" and "test" not in sources
    first_valid = math.ceil(total / 2)
    done = 0
    for file in pieces:
        table = _dense_logged(pq.read_table(file), smallest)
        file.unlink()
        if halves:
            keep = max(0, min(table.num_rows, first_valid - done))
            for part, rows in (("valid", table.slice(0, keep)), ("test", table.slice(keep))):
                if rows.num_rows:
                    writer.append(part, rows)
        else:
            writer.append(split, table)
        done += table.num_rows


def _dense_logged(table: pa.Table, smallest: int) -> pa.Table:
    """Counts -> log(x - smallest + 2) as float32, computed as the reference computes it (int32
    shift, then ``np.log(..., dtype=np.float32)``)."""
    for name in criteo.INT_COLUMNS:
        counts = table.column(name).to_numpy().astype(np.int32)
        counts -= np.int32(smallest - 2)
        logged = np.log(counts, dtype=np.float32)
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(logged))
    return table


def _fingerprint(config: PreprocessConfig, sources: dict[str, list[Path]]) -> str:
    """sha256 over the options and the input files in the order read (names and sizes): what
    decides the ids. (The vocabulary itself is known only after the last file, when the first
    ones are written; metadata.json has its own digest, ``mlperf.vocabulary_sha256``.)"""
    options = {
        "encoding": "mlperf",
        "table_rows": config.mlperf_table_rows,
        "bag_sizes": config.mlperf_bag_sizes,
        "bag_distribution": config.mlperf_bag_distribution,
        "dense_transform": DENSE_TRANSFORM,
        "inputs": [[s, p.name, p.stat().st_size] for s, p in _files_in_order(sources)],
    }
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()


def _vocabulary_digest(vocabularies: list[FirstSeenIds]) -> str:
    """sha256 over every column's (value, id) pairs, sorted by value."""
    digest = hashlib.sha256()
    for vocabulary in vocabularies:
        for array in vocabulary.sorted_pairs():
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
