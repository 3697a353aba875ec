"""The item vocabulary of an interaction log (``recsys preprocess --format interactions``,
``encoding = "categorify"``): which items get ids (``preprocess.item_universe``: the train
events' items, every item of the log, or a catalog file's) and the encoder from raw item keys to
ids (:mod:`recsys.data.sequences` counts the events and writes the histories with it).

Ids go by count, most frequent first (ties by raw key), from ``FIRST_ID`` = 3 (0 padding, 1
missing, 2 rare or unseen); an item without an id is rare. ``hash`` and ``raw`` encodings fit
nothing: raw key mod ``hash_buckets``, or the raw 64-bit key itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from recsys.config import PreprocessConfig
from recsys.data.keys import value_keys

__all__ = [
    "FIRST_ID",
    "RARE_ID",
    "ItemCounts",
    "ItemEncoder",
    "catalog_column",
    "catalog_counts",
    "is_parquet",
    "read_catalog",
]

RARE_ID, FIRST_ID = 2, 3
_PARQUET_SUFFIXES = (".parquet", ".pq")


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is read as parquet (by suffix), else as CSV."""
    return path.name.endswith(_PARQUET_SUFFIXES)


@dataclass
class ItemCounts:
    """Distinct raw item keys (sorted), their counts and their texts; ``min_count`` (None:
    freq_threshold) the count an item needs to get an id."""

    keys: np.ndarray
    counts: np.ndarray
    texts: pa.Array
    min_count: int | None = None
    total: int | None = None  # the events counted, when more than ``counts`` sums


def catalog_column(config: PreprocessConfig) -> pa.ChunkedArray:
    """The item column of ``config.item_catalog`` (parquet or CSV by suffix).

    Raises:
        FileNotFoundError / ValueError: no such file, unreadable, or no such column."""
    path = Path(config.item_catalog)
    if not path.is_file():
        raise FileNotFoundError(f"preprocess.item_catalog not found: '{path}'")
    try:
        if is_parquet(path):
            names = pq.ParquetFile(path).schema_arrow.names
            table = pq.read_table(path, columns=[config.item]) if config.item in names else None
        else:
            options = pcsv.ConvertOptions(column_types={config.item: pa.string()})
            table = pcsv.read_csv(path, convert_options=options)
            names = table.column_names
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"'{path}' could not be read: {' '.join(str(error).split())}") from None
    if table is None or config.item not in names:
        raise ValueError(
            f"preprocess.item_catalog '{path}' has no column {config.item!r} (the item column); "
            f"its columns: {names}"
        )
    return table.column(config.item).drop_null()


def read_catalog(config: PreprocessConfig) -> ItemCounts:
    """The catalog's distinct item keys (sorted) and texts, with zero counts."""
    items = catalog_column(config).combine_chunks()
    keys, first = np.unique(value_keys(items), return_index=True)
    return ItemCounts(keys, np.zeros(len(keys), np.int64), items.cast(pa.string()).take(first))


def catalog_counts(counts: ItemCounts, catalog: ItemCounts) -> ItemCounts:
    """The catalog's items with their train counts (0 for those never trained), every one kept
    whatever the count (``min_count`` 0)."""
    at = np.searchsorted(counts.keys, catalog.keys).clip(max=max(len(counts.keys) - 1, 0))
    found = counts.keys[at] == catalog.keys if len(counts.keys) else np.zeros(0, bool)
    trained = np.where(found, counts.counts[at] if len(counts.keys) else 0, 0)
    total = int(counts.counts.sum())
    return ItemCounts(catalog.keys, trained.astype(np.int64), catalog.texts, 0, total)


class ItemEncoder:
    """Raw item keys -> the ids ``config.encoding`` gives (see the module docstring)."""

    def __init__(self, config: PreprocessConfig, counts: ItemCounts | None) -> None:
        self.encoding = config.encoding
        self.hash_buckets = config.hash_buckets
        if counts is not None:  # categorify: by count, most frequent first, ties by key
            least = max(config.freq_threshold, 1) if counts.min_count is None else 0
            kept = np.flatnonzero(counts.counts >= least)
            kept = kept[np.lexsort((counts.keys[kept], -counts.counts[kept]))]
            self.keys, self.counts = counts.keys[kept], counts.counts[kept]
            self.texts = counts.texts.take(pa.array(kept))
            order = np.argsort(self.keys, kind="stable")
            self.sorted_keys, self.sorted_ids = self.keys[order], FIRST_ID + order
            total = counts.counts.sum() if counts.total is None else counts.total
            self.rare = int(total - self.counts.sum())

    @property
    def cardinality(self) -> int:
        """Rows an item table needs (0: raw keys, a dynamic table)."""
        if self.encoding == "categorify":
            return FIRST_ID + len(self.keys)
        return self.hash_buckets if self.encoding == "hash" else 0

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        if self.encoding == "raw":
            return keys
        if self.encoding == "hash":
            return keys % self.hash_buckets
        at = np.searchsorted(self.sorted_keys, keys).clip(max=max(len(self.sorted_keys) - 1, 0))
        if not len(self.sorted_keys):
            return np.full_like(keys, RARE_ID)
        return np.where(self.sorted_keys[at] == keys, self.sorted_ids[at], RARE_ID)

    def fingerprint(self, options: dict[str, Any]) -> str:
        digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
        if self.encoding == "categorify":
            digest.update(self.keys.tobytes())
            digest.update(self.counts.tobytes())
        return digest.hexdigest()[:16]

    def write_categories(self, work: Path) -> None:
        """categorify: ``categories/items.parquet`` (id, the item's text, raw key, train
        count), in id order."""
        if self.encoding != "categorify":
            return
        (work / "categories").mkdir()
        ids = np.arange(FIRST_ID, FIRST_ID + len(self.keys), dtype=np.int64)
        table = pa.table({"id": ids, "item": self.texts, "key": self.keys, "count": self.counts})
        pq.write_table(table, work / "categories" / "items.parquet")
