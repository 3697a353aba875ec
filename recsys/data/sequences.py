"""User histories from an interaction log: ``recsys preprocess --format interactions``.

Input: parquet or CSV files (by suffix: ``.parquet`` / ``.pq``, else CSV, ``.gz`` allowed), one
row per interaction with a ``user``, an ``item`` and a ``time`` column, in any order. Output: the
directory layout of :mod:`recsys.data.prepared`, one row per user and split, with the standard
leave-one-out split of sequential recommendation. For a user with events e_1 .. e_n in time
order (ties in input order):

- n >= 3: ``valid`` predicts e_(n-1) from e_1 .. e_(n-2), ``test`` predicts e_n from
  e_1 .. e_(n-1), and ``train`` holds e_1 .. e_(n-2);
- n <= 2: every event is ``train``; such a user has no valid or test row.

A train row holds the user's whole train part, and is written when it has at least 2 events
(a target); a valid or test row holds every event before its target (the loader cuts what a
model reads to its ``max_len`` and, for training, cuts long histories into rows as
``train.next_item.train_rows`` says; ranking masks the whole history with ``exclude_history``).
``max_len`` > 0 caps what is stored: a train row keeps the last ``max_len + 1`` events of its
part, a valid or test row the last ``max_len`` before its target. Columns: ``user`` (the
user's text), ``items`` (list<int64>: the history, oldest first), ``times`` (list<double>);
valid and test add ``target`` (int64) and ``target_time`` (double).

Items are encoded as ``encoding`` says, fitted on the events ``item_universe`` names: the
train events only (every event of a train part, before any cap; an item seen only as a valid
or test target is then rare, never a candidate) or every event of the log (``log``).
``categorify``: ids by count (train events, or the log's), most frequent first (ties by raw
key), from 3 (0 padding, 1 missing, 2 rare or unseen; ``freq_threshold`` as for CTR data),
with ``categories/items.parquet`` mapping each id back to the item's text; ``hash``:
raw key mod ``hash_buckets``; ``raw``: the raw 64-bit key (:mod:`recsys.data.keys`; dynamic
tables).

Streaming, memory bounded by about ``chunk_mb`` per piece: the log is read in pieces, malformed
rows dropped (missing user or item, time missing or not a finite number; counted with file and
row, fatal with ``strict``), and each row appended to one of K bucket files by a hash of its user
(K from the input's size, so a bucket fits in memory); a user's events all land in one bucket,
which is then sorted by (user, time, input position) and cut into histories. With
``categorify`` the buckets are read twice: once to count the train items, once to write.
Times are read as float64: numbers as they are (exact for integers below 2^53), parquet
timestamps and dates in seconds since the epoch.

Nothing is lost: the output is built beside the target and renamed in, as for CTR data
(:func:`recsys.data.prepared.replace_output`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from recsys._files import write_failure, write_text_atomic
from recsys.config import PreprocessConfig
from recsys.data.item_vocabulary import (
    RARE_ID,
    ItemCounts,
    ItemEncoder,
    catalog_column,
    catalog_counts,
    is_parquet,
    read_catalog,
)
from recsys.data.keys import value_keys
from recsys.data.prepared import (
    FINGERPRINT_KEY,
    FORMAT_VERSION,
    METADATA,
    SPLITS,
    check_output,
    input_files,
    new_directory_beside,
    replace_output,
)
from recsys.data.readers import MalformedLines

__all__ = ["SEQUENCE_KIND", "SequenceReport", "preprocess_interactions", "segment_index"]

SEQUENCE_KIND = "sequences"  # metadata.json "kind"
PADDING_ID, MISSING_ID = 0, 1  # RARE_ID, FIRST_ID: recsys.data.item_vocabulary
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
_EVENT_SCHEMA = pa.schema(
    [("user_key", pa.int64()), ("user", pa.string()), ("item_key", pa.int64()),
     ("item", pa.string()), ("time", pa.float64()), ("position", pa.int64())]
)  # fmt: skip


@dataclass
class SequenceReport:
    """What :func:`preprocess_interactions` wrote: rows (users) per split, the rows it dropped,
    metadata.json's content and the seconds it took."""

    output: Path
    rows: dict[str, int]
    malformed: MalformedLines
    metadata: dict[str, Any]
    seconds: float
    notes_: list[str] = field(default_factory=list)

    def notes(self) -> list[str]:
        return self.notes_


def preprocess_interactions(config: PreprocessConfig) -> SequenceReport:
    """Turn the interaction log ``config.input`` into per-user histories in ``config.output``
    (see the module docstring).

    Raises:
        ValueError: a missing option or column, an output directory preprocess may not
            replace, an unreadable file, no usable interaction, or (strict) a malformed row.
        FileNotFoundError: an input does not exist.
    """
    start = time.perf_counter()
    _check_options(config)
    output, files = Path(config.output), input_files(config.input, "input")
    check_output(output, config.overwrite, files)
    work = new_directory_beside(output, "partial")
    try:
        malformed = MalformedLines()
        buckets, read = _partition(config, files, work / "buckets", malformed)
        if not sum(read.values()) - malformed.count:
            raise ValueError(f"input '{config.input}' has no usable interaction")
        counts = None
        if config.encoding == "categorify":
            counts = _item_counts(buckets, whole_log=config.item_universe == "log")
            if config.item_universe == "catalog":
                counts = catalog_counts(counts, read_catalog(config))
        encoder = ItemEncoder(config, counts)
        rows, written, stats = _write_splits(buckets, work, encoder, config)
        shutil.rmtree(work / "buckets")
        encoder.write_categories(work)
        metadata = _metadata(config, files, rows, written, stats, read, malformed, encoder)
        write_text_atomic(work / METADATA, json.dumps(metadata, indent=1) + "\n")
        replace_output(output, work)
    except BaseException as error:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(error, OSError) and (failure := write_failure(error, output)) is not error:
            raise failure from error
        raise
    notes = []
    if stats["users_too_short"]:
        notes.append(
            f"{stats['users_too_short']:,} user(s) with fewer than 2 training events have no "
            "train row (no next-item target)"
        )
    seconds = time.perf_counter() - start
    return SequenceReport(output, rows, malformed, metadata, seconds, notes)


def _check_options(config: PreprocessConfig) -> None:
    if not config.output:
        raise ValueError("preprocess.output is empty; give the directory to write (--output DIR)")
    missing = [k for k in ("user", "item", "time") if not getattr(config, k)]
    if missing:
        flags = ", ".join(f"--{k} COLUMN" for k in missing)
        raise ValueError(f"format 'interactions' needs the {', '.join(missing)} column(s): {flags}")
    if len({config.user, config.item, config.time}) < 3:
        raise ValueError(
            f"user {config.user!r}, item {config.item!r} and time {config.time!r} must be three "
            "different columns"
        )
    ignored = [k for k in ("categorical", "multi_hot", "dense", "label") if getattr(config, k)]
    if ignored or config.apply or config.valid or config.test:
        given = ignored + [k for k in ("apply", "valid", "test") if getattr(config, k)]
        raise ValueError(
            f"format 'interactions' takes user / item / time columns and splits by leave-one-out;"
            f" preprocess.{', preprocess.'.join(given)} do not apply to it"
        )
    if config.normalize_dense:
        raise ValueError("format 'interactions' has no dense columns to normalize")
    if config.item_universe != "train" and config.encoding != "categorify":
        raise ValueError(
            f"preprocess.item_universe = {config.item_universe!r} chooses the items categorify "
            f"fits; encoding = {config.encoding!r} fits no vocabulary (use 'train', the default)"
        )
    if (config.item_universe == "catalog") != bool(config.item_catalog):
        raise ValueError(
            f"preprocess.item_universe = {config.item_universe!r} with item_catalog = "
            f"{config.item_catalog!r}: a catalog file goes with item_universe = 'catalog', and "
            "only with it"
        )
    if config.item_catalog:
        catalog_column(config)  # exists, readable, has the item column: before any work


# ---------------------------------------------------------------------------------------------
# Pass 1: read the log, drop malformed rows, partition by user


def _partition(
    config: PreprocessConfig, files: list[Path], directory: Path, malformed: MalformedLines
) -> tuple[list[Path], dict[str, int]]:
    """Write every good row to bucket ``hash(user) mod K``; the bucket files and the rows read
    per input file."""
    chunk_bytes = config.chunk_mb * 2**20
    size = sum(p.stat().st_size * (4 if p.suffix == ".gz" else 1) for p in files)
    buckets = max(1, math.ceil(size / chunk_bytes))
    directory.mkdir()
    paths = [directory / f"bucket_{b:05d}.parquet" for b in range(buckets)]
    writers: dict[int, pq.ParquetWriter] = {}
    read: dict[str, int] = {}
    position = 0
    try:
        for path in files:
            read[str(path)] = 0
            for piece, first_row in _pieces(path, config, chunk_bytes, malformed):
                read[str(path)] += piece.num_rows
                where = _Where(path, first_row, "row" if is_parquet(path) else "line")
                events = _clean(piece, where, position, config, malformed)
                position += piece.num_rows
                bucket = events.column("user_key").to_numpy() % buckets
                for b in np.unique(bucket):
                    part = events.filter(pa.array(bucket == b))
                    if b not in writers:
                        writers[b] = pq.ParquetWriter(paths[b], _EVENT_SCHEMA)
                    writers[b].write_table(part)
    finally:
        for writer in writers.values():
            writer.close()
    return [paths[b] for b in sorted(writers)], read


def _pieces(
    path: Path, config: PreprocessConfig, chunk_bytes: int, malformed: MalformedLines
) -> Iterator[tuple[pa.Table, int]]:
    """The user, item and time columns of ``path`` in pieces, with the number of each piece's
    first row: its line in a CSV (the header is line 1; a line per row), its row in a parquet
    file (from 1)."""
    columns = [config.user, config.item, config.time]
    try:
        if is_parquet(path):
            file = pq.ParquetFile(path)
            absent = [c for c in columns if c not in file.schema_arrow.names]
            if absent:
                raise ValueError(
                    f"'{path}' has no column(s) {absent}; its columns: {file.schema_arrow.names}"
                )
            rows = max(1, chunk_bytes // 64)
            first = 1
            for batch in file.iter_batches(batch_size=rows, columns=columns):
                yield pa.Table.from_batches([batch]), first
                first += batch.num_rows
            return
        yield from _csv_pieces(path, columns, chunk_bytes, config.strict, malformed)
    except (pa.ArrowInvalid, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"'{path}' could not be read: {' '.join(str(error).split())}") from None


def _csv_pieces(
    path: Path, columns: list[str], chunk_bytes: int, strict: bool, malformed: MalformedLines
) -> Iterator[tuple[pa.Table, int]]:
    def invalid(row: pcsv.InvalidRow) -> str:
        detail = f"{row.actual_columns} fields, expected {row.expected_columns}"
        if strict:
            raise ValueError(f"{path}:{row.number}: malformed line: {detail}")
        malformed.add(path, row.number or 0, "wrong field count", detail)
        return "skip"

    header = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=1 << 16))
    names = header.schema.names
    absent = [c for c in columns if c not in names]
    if absent:
        raise ValueError(f"'{path}' has no column(s) {absent}; its header: {names}")
    reader = pcsv.open_csv(
        path,
        read_options=pcsv.ReadOptions(block_size=max(1 << 16, min(chunk_bytes, 1 << 30))),
        parse_options=pcsv.ParseOptions(invalid_row_handler=invalid),
        convert_options=pcsv.ConvertOptions(
            include_columns=columns,
            column_types={c: pa.string() for c in columns},
            strings_can_be_null=True,
        ),
    )
    first = 2
    for batch in reader:
        yield pa.Table.from_batches([batch]), first
        first += batch.num_rows


@dataclass(frozen=True)
class _Where:
    """Where a piece starts: its file, the number of its first row, and what a number counts
    (``line`` of a CSV, ``row`` of a parquet file)."""

    path: Path
    first: int
    unit: str


def _clean(
    piece: pa.Table,
    where: _Where,
    position: int,
    config: PreprocessConfig,
    malformed: MalformedLines,
) -> pa.Table:
    """The piece's good rows as events (user key and text, item key, time, input position)."""
    users, items = piece.column(config.user), piece.column(config.item)
    times = _times(piece.column(config.time))
    checks = {
        "missing user": users.is_null().to_numpy(zero_copy_only=False),
        "missing item": items.is_null().to_numpy(zero_copy_only=False),
        "time not a finite number": ~np.isfinite(times),
    }
    bad = np.zeros(piece.num_rows, dtype=bool)
    for kind, rows in checks.items():
        for row in np.flatnonzero(rows & ~bad):
            column = {"missing user": config.user, "missing item": config.item}.get(kind)
            value = piece.column(config.time)[int(row)].as_py()
            detail = f"{kind} (column {column or config.time!r}" + (
                ")" if column else f", value {value!r})"
            )
            number = where.first + int(row)
            if config.strict:
                raise ValueError(f"{where.path}: {where.unit} {number}: {detail}")
            noted = detail if where.unit == "line" else f"row {number}: {detail}"
            malformed.add(where.path, number, kind, noted)
        bad |= rows
    keep = pa.array(~bad)
    users, items = users.filter(keep), items.filter(keep)
    return pa.table(
        {
            "user_key": value_keys(users),
            "user": users.cast(pa.string()),
            "item_key": value_keys(items),
            "item": items.cast(pa.string()),
            "time": times[~bad],
            "position": position + np.flatnonzero(~bad),
        },
        schema=_EVENT_SCHEMA,
    )


def _times(column: pa.ChunkedArray) -> np.ndarray:
    """float64 times; NaN where missing or not a number."""
    kind = column.type
    if pa.types.is_timestamp(kind) or pa.types.is_duration(kind):  # seconds
        counts = column.cast(pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64)
        return counts / _PER_SECOND[kind.unit]
    if pa.types.is_date(kind):
        days = column.cast(pa.date32()).cast(pa.int32()).to_numpy(zero_copy_only=False)
        return days.astype(np.float64) * 86400.0
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return column.cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)
    text = column.cast(pa.string()).to_pandas()
    return pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


# ---------------------------------------------------------------------------------------------
# Pass 2: histories per bucket, the leave-one-out split


@dataclass
class _Histories:
    """One bucket's events in (user, time, position) order and each user's slice of them."""

    user: pa.Array  # text of each user's first event
    item_key: np.ndarray  # [N]
    item: pa.ChunkedArray  # [N] text
    time: np.ndarray  # [N]
    starts: np.ndarray  # [U]
    ends: np.ndarray  # [U]

    @property
    def train_ends(self) -> np.ndarray:
        """Where each user's train part ends: before the last two events when there are 3+."""
        return np.where(self.ends - self.starts >= 3, self.ends - 2, self.ends)


def _histories(path: Path) -> _Histories:
    table = pq.read_table(path)
    key = table.column("user_key").to_numpy()
    times = table.column("time").to_numpy()
    order = np.lexsort((table.column("position").to_numpy(), times, key))
    key = key[order]
    boundaries = np.flatnonzero(key[1:] != key[:-1]) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int64)
    ends = np.concatenate([boundaries, [len(key)]]).astype(np.int64)
    users = table.column("user").take(pa.array(order[starts])).combine_chunks()
    item_key = table.column("item_key").to_numpy()[order]
    items = table.column("item").take(pa.array(order))
    return _Histories(users, item_key, items, times[order], starts, ends)


def segment_index(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated indices of ``[starts[i], ends[i])`` and the list offsets (int32) of the
    pieces."""
    lengths = ends - starts
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    index = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    return index, offsets


def _item_counts(buckets: list[Path], whole_log: bool) -> ItemCounts:
    """How many train events (``whole_log``: events) hold each item, over every bucket."""
    keys, counts, texts = [], [], []
    for path in buckets:
        h = _histories(path)
        index, _ = segment_index(h.starts, h.ends if whole_log else h.train_ends)
        k, first, c = np.unique(h.item_key[index], return_index=True, return_counts=True)
        keys.append(k)
        counts.append(c)
        texts.append(h.item.take(pa.array(index[first])).combine_chunks())
    all_keys, all_counts = np.concatenate(keys), np.concatenate(counts)
    merged, first, inverse = np.unique(all_keys, return_index=True, return_inverse=True)
    totals = np.bincount(inverse, weights=all_counts).astype(np.int64)
    text = pa.concat_arrays(texts).take(pa.array(first))
    return ItemCounts(merged, totals, text)


# ---------------------------------------------------------------------------------------------
# Pass 3: write the splits


def _write_splits(
    buckets: list[Path], work: Path, encoder: ItemEncoder, config: PreprocessConfig
) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int]]:
    """Each bucket's rows of each split in ``<work>/<split>/part_<bucket>.parquet``; the rows and
    files per split, and the counts of users and events."""
    rows, files = dict.fromkeys(SPLITS, 0), {split: [] for split in SPLITS}
    stats = {"users": 0, "users_too_short": 0, "events": 0}
    for split in SPLITS:
        (work / split).mkdir()
    fingerprint = encoder.fingerprint(_options(config))
    for number, path in enumerate(buckets):
        h = _histories(path)
        stats["users"] += len(h.starts)
        stats["events"] += len(h.item_key)
        for split, table in _split_tables(h, encoder, config.max_len, stats).items():
            if not table.num_rows:
                continue
            table = table.replace_schema_metadata({FINGERPRINT_KEY: fingerprint.encode()})
            name = f"part_{number:05d}.parquet"
            pq.write_table(table, work / split / name, row_group_size=config.row_group_rows)
            rows[split] += table.num_rows
            files[split].append(name)
    return rows, files, stats


def _split_tables(
    h: _Histories, encoder: ItemEncoder, max_len: int, stats: dict[str, int]
) -> dict[str, pa.Table]:
    n, train_ends = h.ends - h.starts, h.train_ends
    trainable = train_ends - h.starts >= 2
    stats["users_too_short"] += int((~trainable).sum())
    evaluated = n >= 3

    def first(end: np.ndarray, kept: int) -> np.ndarray:  # the first event kept before end
        return np.maximum(h.starts, end - kept) if max_len else h.starts

    plans = {  # split -> (users, history start, history end, target index or None)
        "train": (trainable, first(train_ends, max_len + 1), train_ends, None),
        "valid": (evaluated, first(h.ends - 2, max_len), h.ends - 2, h.ends - 2),
        "test": (evaluated, first(h.ends - 1, max_len), h.ends - 1, h.ends - 1),
    }
    tables = {}
    for split, (users, first, last, target) in plans.items():
        index, offsets = segment_index(first[users], last[users])
        columns = {
            "user": h.user.filter(pa.array(users)),
            "items": pa.ListArray.from_arrays(offsets, encoder(h.item_key[index])),
            "times": pa.ListArray.from_arrays(offsets, h.time[index]),
        }
        if target is not None:
            columns["target"] = encoder(h.item_key[target[users]])
            columns["target_time"] = h.time[target[users]]
        tables[split] = pa.table(columns)
    return tables


def _options(config: PreprocessConfig) -> dict[str, Any]:
    names = ("user", "item", "time", "max_len", "encoding", "freq_threshold", "hash_buckets")
    options = {name: getattr(config, name) for name in names}
    if config.item_universe != "train":  # absent: the fingerprints of older outputs hold
        options["item_universe"] = config.item_universe
    if config.item_catalog:
        options["item_catalog"] = config.item_catalog
    return options


def _metadata(
    config: PreprocessConfig,
    inputs: list[Path],
    rows: dict[str, int],
    files: dict[str, list[str]],
    stats: dict[str, int],
    read: dict[str, int],
    malformed: MalformedLines,
    encoder: ItemEncoder,
) -> dict[str, Any]:
    columns = {"user": "string", "items": "list<int64>", "times": "list<double>"}
    evaluated = {**columns, "target": "int64", "target_time": "double"}
    splits = {split: {"rows": rows[split], "files": files[split]} for split in SPLITS}
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": SEQUENCE_KIND,
        "id_encoding": "raw" if encoder.encoding == "raw" else "index",
        "encoding": encoder.encoding,
        "fingerprint": encoder.fingerprint(_options(config)),
        "preprocess": _options(config),
        "sequence": {
            "max_len": config.max_len,
            "num_items": encoder.cardinality,
            "columns": {"train": columns, "valid": evaluated, "test": evaluated},
            "reserved_ids": (
                {"padding": PADDING_ID, "missing": MISSING_ID, "rare": RARE_ID}
                if encoder.encoding == "categorify"
                else {}
            ),
        },
        "categorical": [{"name": "items", "cardinality": encoder.cardinality}],
        "splits": splits,
        "input": {
            "files": [str(p) for p in inputs],
            "rows_read": sum(read.values()),
            "rows_malformed": malformed.count,
            "interactions": stats["events"],
            "users": stats["users"],
            "users_without_train_row": stats["users_too_short"],
            "rare_train_events": getattr(encoder, "rare", 0),
        },
    }
    return metadata
