"""Criteo click logs: a streaming, validating TSV reader and a direct in-memory dataset.

A Criteo Kaggle / Terabyte line is ``label \\t int_0 .. int_12 \\t cat_0 .. cat_25``: a 0/1
label, 13 integer count features and 26 categorical features as hex strings; any field but
the label may be empty (missing). Files may be gzip-compressed (``.gz``).

:func:`read_criteo` streams a file in chunks (bounded memory) and checks every line: a wrong
column count, a label other than 0/1, a non-integer count or a non-hex category makes the line
*malformed*; so does an empty line. Malformed lines are counted and skipped, with file and line
number reported (:class:`MalformedLines`), or stop the read in strict mode. Nothing is silently
turned into a zero: a missing field stays null until a transform fills it on purpose. A
truncated ``.gz`` is an error naming the file. (The line-tracking reader is shared with the CSV
input of ``recsys preprocess``: ``recsys.data.readers``.)

:class:`CriteoDataset` reads a small file whole (hashing ids into a fixed number of buckets,
sign(x) log(1 + |x|) on counts) for quick experiments without a preprocessing step; large logs
go through ``recsys preprocess`` (``recsys.data.etl``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec import KeyedJaggedTensor

from recsys.data.batch import Batch, DatasetSpec
from recsys.data.readers import (
    MalformedLines,
    empty_to_null,
    field_failures,
    matching,
    read_delimited,
    signed_log1p,
)

NUM_INT = 13
NUM_CAT = 26
LABEL = "label"
INT_COLUMNS = [f"int_{i}" for i in range(NUM_INT)]
CAT_COLUMNS = [f"cat_{i}" for i in range(NUM_CAT)]
COLUMNS = [LABEL, *INT_COLUMNS, *CAT_COLUMNS]
_INTEGER = r"^-?[0-9]{1,18}$"  # fits int64
_HEX = r"^[0-9a-fA-F]{1,16}$"


def read_criteo(
    path: str | Path,
    chunk_bytes: int = 64 << 20,
    strict: bool = False,
    malformed: MalformedLines | None = None,
) -> Iterator[pa.Table]:
    """Stream a Criteo TSV (optionally gzip) as validated tables.

    Args:
        path: the file.
        chunk_bytes: bytes parsed per chunk; memory stays a small multiple of this.
        strict: raise ``ValueError`` at the first malformed line instead of skipping it.
        malformed: collects what was skipped (a new one is used when None).

    Yields:
        Tables with ``label`` int8, ``int_*`` float64 (null when missing) and ``cat_*`` strings
        (null when missing), one row per valid line, in file order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a malformed line in strict mode, or a file that cannot be read (a
            truncated ``.gz``), naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Criteo file not found: '{path}'")
    pieces = read_delimited(
        path,
        column_names=COLUMNS,
        columns=COLUMNS,
        delimiter="\t",
        quote_char=False,
        chunk_bytes=chunk_bytes,
        strict=strict,
        malformed=malformed if malformed is not None else MalformedLines(),
        check=lambda table: field_failures(table, _CHECKS),
    )
    for table in pieces:
        yield _convert(table)


_CHECKS = [
    (LABEL, matching(r"^[01]$", False), "label {!r} is not 0 or 1"),
    *[
        (c, matching(_INTEGER, True), c + " {!r} is not an integer of up to 18 digits")
        for c in INT_COLUMNS
    ],
    *[(c, matching(_HEX, True), c + " {!r} is not hexadecimal") for c in CAT_COLUMNS],
]


def _convert(table: pa.Table) -> pa.Table:
    columns = {LABEL: pc.cast(table.column(LABEL), pa.int8())}
    for c in INT_COLUMNS:
        columns[c] = pc.cast(pc.cast(empty_to_null(table.column(c)), pa.int64()), pa.float64())
    for c in CAT_COLUMNS:
        columns[c] = pc.utf8_lower(empty_to_null(table.column(c)))
    return pa.table(columns)


def hash_hex(values: pa.ChunkedArray | pa.Array, buckets: int) -> np.ndarray:
    """int(hex) mod ``buckets`` for each hex string (up to 16 digits; null -> 0), vectorized."""
    return (parse_hex(values) % np.uint64(buckets)).astype(np.int64)


def parse_hex(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """int(hex) as uint64 for each hex string of up to 16 digits (null -> 0), vectorized."""
    array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    strings = np.asarray(array.fill_null("").to_numpy(zero_copy_only=False), dtype="S16")
    digits = strings.view(np.uint8).reshape(len(strings), 16)
    nibble = np.zeros(256, dtype=np.uint64)
    nibble[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint64)
    nibble[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
    nibble[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
    parsed = np.zeros(len(strings), dtype=np.uint64)
    for i in range(16):  # Horner over the left-aligned digits; padding bytes end a string
        present = digits[:, i] != 0
        parsed = np.where(present, parsed * np.uint64(16) + nibble[digits[:, i]], parsed)
    return parsed


class CriteoDataset:
    """A small Criteo TSV read whole into memory, with the same interface as the others.

    Categories are hashed: id = int(hex) mod ``hash_buckets`` (a missing one is id 0, shared
    with the ids that hash there); counts become sign(x) log(1 + |x|) (log(1 + x) for counts >= 0,
    as ``recsys preprocess`` does) with missing as 0. Rows are
    split into train / valid / test by a seeded draw.

    Args:
        path: the TSV file (``.gz`` allowed).
        hash_buckets: table size of every categorical feature.
        valid_fraction, test_fraction: shares of rows for evaluation splits.
        seed: seed of the split draw.
        strict: fail on the first malformed line instead of skipping it.
    """

    CHUNK_ROWS = 65_536

    def __init__(
        self,
        path: str | Path,
        hash_buckets: int = 100_000,
        valid_fraction: float = 0.05,
        test_fraction: float = 0.05,
        seed: int = 0,
        strict: bool = False,
    ) -> None:
        if hash_buckets < 1:
            raise ValueError(f"hash_buckets must be >= 1, got {hash_buckets}")
        if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
            raise ValueError(
                f"valid_fraction {valid_fraction} + test_fraction {test_fraction} must be in [0, 1)"
            )
        self.malformed = MalformedLines()
        tables = list(read_criteo(path, strict=strict, malformed=self.malformed))
        table = pa.concat_tables(tables) if tables else None
        if table is None or table.num_rows == 0:
            raise ValueError(f"'{path}' has no valid Criteo lines ({self.malformed.summary()})")
        self.spec = DatasetSpec(
            dense_names=tuple(INT_COLUMNS),
            sparse_names=tuple(CAT_COLUMNS),
            cardinalities=(hash_buckets,) * NUM_CAT,
            label_names=(LABEL,),
        )
        self.max_ids_per_sample = dict.fromkeys(CAT_COLUMNS, 1)  # one id per feature and line
        counts = np.column_stack(
            [table.column(c).fill_null(0).to_numpy() for c in INT_COLUMNS]
        ).astype(np.float32)
        dense = torch.from_numpy(signed_log1p(counts))  # [N, 13]
        ids = np.stack([hash_hex(table.column(c), hash_buckets) for c in CAT_COLUMNS])  # [26, N]
        labels = torch.from_numpy(table.column(LABEL).to_numpy().astype(np.float32))[:, None]
        draw = np.random.default_rng(seed).random(table.num_rows)
        split_of = np.where(
            draw < test_fraction, 2, np.where(draw < test_fraction + valid_fraction, 1, 0)
        )
        self._splits = {}
        for index, split in enumerate(("train", "valid", "test")):
            rows = np.flatnonzero(split_of == index)
            self._splits[split] = Batch(
                dense=dense[rows],
                sparse=KeyedJaggedTensor(
                    keys=list(CAT_COLUMNS),
                    values=torch.from_numpy(ids[:, rows].reshape(-1)),
                    lengths=torch.ones(NUM_CAT * len(rows), dtype=torch.int32),
                ),
                labels=labels[rows],
            )

    def num_samples(self, split: str) -> int:
        return self._splits[split].batch_size

    def num_chunks(self, split: str) -> int:
        return math.ceil(self.num_samples(split) / self.CHUNK_ROWS)

    def chunk_rows(self, split: str, index: int) -> int:
        return min(self.CHUNK_ROWS, self.num_samples(split) - index * self.CHUNK_ROWS)

    def chunk(self, split: str, index: int) -> Batch:
        start = index * self.CHUNK_ROWS
        return self._splits[split].slice(start, start + self.chunk_rows(split, index))
