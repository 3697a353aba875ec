"""Tables behind a cache for inference: the tiered tables of an export
(:mod:`recsys.serve.tiered_export`) looked up outside its program, in the row stores training
uses, through a bounded in-memory cache of hot rows.

Per tiered table, :class:`CachedTables` keeps every row of the export's checkpoint in a
:class:`~recsys.embedding.tiered.row_store.FixedStore` / :class:`~recsys.embedding.tiered.row_store.
KeyedStore` on the table's tier (``host``: a tensor in RAM; ``disk``: a sparse memory-mapped file
in a temporary directory of its own, ``$TMPDIR/recsys-serve-tables-*``), loaded by streaming the
checkpoint's ``tiered.<table>.*`` files in chunks, and a :class:`~recsys.embedding.tiered.row_cache.
RowCache` of ``cache_rows`` rows in front. A batch's ids::

    ids of a tiered table -> distinct keys -> cache (hit | miss: evict the coldest rows, read
    the row from the store; a fixed table's row the store never held: its lazy initial row, as
    in training; a dynamic table's unknown key: no row) -> cache rows -> F.embedding_bag over
    the cache's weights (the row past the cache is zero: unknown keys read it)

gives the program's ``tiered`` input. Rows move as bytes and pooling reads a bag's rows in
order, so the pooled vectors do not depend on the cache size or policy: a request scores the
same through a cache of 1% of the table as through one holding it whole. A batch with more
distinct keys than a cache holds is pooled in runs of samples that fit.

Concurrency: one lock per :class:`CachedTables` covers the cache bookkeeping and the pooling;
the dense program runs outside it. Serving never writes to a store (nothing trains), so a
store stays the rows of its checkpoint for its life. A copy of the program for a new delta
version (:func:`copy_program`) shares its :class:`CachedTables`: deltas carry dynamic in-memory
tables only (training writes none for tiered tables), so every version of one base reads the
same tiered rows; a new base gets its own stores and cache.
"""

from __future__ import annotations

import copy
import math
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recsys.embedding.row_init import initial_rows
from recsys.embedding.tiered.files import TablePart, TieredFiles
from recsys.embedding.tiered.row_cache import RowCache, RowCodec
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore, HostRecords, KeyedStore

__all__ = ["CachedTables", "attach_cached_tables", "copy_program"]


class _Table:
    """One tiered table's store, cache and the buffers the cache fills."""

    def __init__(
        self, name: str, info: dict[str, Any], cache_rows: int, directory: Path | None
    ) -> None:
        self.name, self.info = name, info
        self.dynamic = bool(info["dynamic"])
        self.dim = int(info["dim"])
        self.num_rows = cache_rows
        # Buffers of cache_rows + 1 rows in the checkpoint's record layout (weights, then the
        # optimizer state the records carry); the last row stays zero.
        self.tensors = []
        for entry in info["layout"]:
            _, dtype, numel = entry.split(":")
            shape = (cache_rows + 1, int(numel))
            self.tensors.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
        self.weight = self.tensors[0]  # [cache_rows + 1, D]
        codec = RowCodec(lambda: self.tensors)
        width = codec.record_bytes
        size = 1024 if self.dynamic else int(info["num_embeddings"])
        if info["tier"] == "disk" and directory is not None:
            records = DiskRecords(directory / f"{name}.rows", size, width)
        else:
            records = HostRecords(size, width)
        store = KeyedStore(records, name) if self.dynamic else FixedStore(records)

        def fresh(keys: torch.Tensor) -> torch.Tensor:  # a fixed table's lazy initial rows
            dtype = getattr(torch, info["dtype"])
            rows = keys.cpu() + info["offset"]
            weights = initial_rows(rows, info["seed"], self.dim, info["bound"], dtype)
            states = [torch.zeros(len(keys), *t.shape[1:], dtype=t.dtype) for t in self.tensors[1:]]
            return codec.encode([weights, *states])

        self.cache = RowCache(cache_rows, store, codec, fresh, policy=info["policy"], name=name)
        rows = None if self.dynamic else int(info["num_embeddings"])
        part = TablePart(0, rows, table_rows=rows)
        TieredFiles({name: self.cache}, {name: info["layout"]}, {name: part}).load(
            info["checkpoint"]
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The cache row of each of ``ids`` (the zero row for a dynamic table's unknown key),
        after giving the distinct ones rows. The caller made room (:meth:`fits`)."""
        if not self.dynamic and len(ids):
            low, high = torch.aminmax(ids)
            if int(low) < 0 or int(high) >= int(self.info["num_embeddings"]):
                bad = ids[(ids < 0) | (ids >= int(self.info["num_embeddings"]))][0].item()
                raise ValueError(
                    f"table '{self.name}' (features {self.info['features']}): id {bad} is "
                    f"outside [0, {self.info['num_embeddings']})"
                )
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        cache = self.cache
        cache.begin(cache.next_ticket)  # nothing before this batch is in flight any more
        admit = None
        if self.dynamic:  # serving admits no key: an unknown one reads the zero row
            admit = lambda keys, counts: torch.zeros(len(keys), dtype=torch.bool)  # noqa: E731
        rows, _ = cache.prepare(keys, counts, train=False, admit=admit)
        return torch.where(rows >= 0, rows, self.num_rows)[inverse]

    def stats(self) -> dict[str, float]:
        stats = dict(self.cache.stats)
        stats["rows_resident"] = self.num_rows - len(self.cache.free)
        stats["cache_rows"] = self.num_rows
        return stats


class CachedTables:
    """The tiered tables of an export behind caches, as the forward pre-hook of its program
    (see the module docstring): ``program(dense, values, lengths)`` then looks the tiered
    features' rows up here and passes their pooled vectors as the program's ``tiered`` input.

    Args:
        info: the export's ``tiered.json`` (:func:`~recsys.serve.tiered_export.tiered_info`).
        feature_names: the program's sparse feature names, in its order (``spec.sparse_names``).
        cache_rows: rows of each table's cache (None: the training run's cache size).

    Raises:
        FileNotFoundError: the directory of the rows (beside the export; an older export's
            checkpoint) is gone.
        ValueError: ``cache_rows`` < 1.
    """

    def __init__(
        self, info: dict[str, Any], feature_names: list[str], cache_rows: int | None = None
    ) -> None:
        if cache_rows is not None and cache_rows < 1:
            raise ValueError(f"cache_rows must be >= 1, got {cache_rows}")
        checkpoint = Path(info["checkpoint"])
        if not checkpoint.is_dir():
            raise FileNotFoundError(
                f"the export's tiered tables are read from '{checkpoint}', which is gone; keep "
                "the '<export>.tables' directory `recsys export` writes beside the export (an "
                "older export: its checkpoint), or export again"
            )
        self.info = info
        self.features = list(feature_names)
        self.width = int(info["width"])
        self._lock = threading.Lock()
        disk = any(t["tier"] == "disk" for t in info["tables"].values())
        self._directory = (
            tempfile.TemporaryDirectory(prefix="recsys-serve-tables-") if disk else None
        )
        directory = Path(self._directory.name) if self._directory else None
        self.tables = {
            name: _Table(
                name,
                {**entry, "checkpoint": str(checkpoint)},
                cache_rows or int(entry["cache_rows"]),
                directory,
            )
            for name, entry in info["tables"].items()
        }
        self.columns = info["columns"]

    def __deepcopy__(self, memo: dict) -> CachedTables:
        return self  # shared by the copies of one base's program (see copy_program)

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        dense, values, lengths = args
        return (dense, values, lengths, self.pooled(values, lengths, dense.shape[0]))

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The ``tiered`` input for a batch: f32 [B, width].

        Args:
            values: int64 [L], key-major (the program's ``values``).
            lengths: int64 [F * B] (the program's ``lengths``).
            batch_size: B.
        """
        B = batch_size
        lengths = lengths.long()
        per_key = lengths.reshape(len(self.features), B)  # [F, B]
        starts = torch.cumsum(per_key.sum(1), 0) - per_key.sum(1)  # [F]
        with self._lock:
            return self._pool(values, per_key, starts, 0, B)

    def _pool(self, values, per_key, starts, first: int, stop: int) -> torch.Tensor:
        """The pooled columns of samples [first, stop), halving the run while a cache cannot
        hold its distinct keys."""
        bags = {}  # feature -> (its ids in the run, bag offsets [n + 1])
        for column in self.columns:
            k = self.features.index(column["feature"])
            before = int(per_key[k, :first].sum())
            offsets = torch.cumsum(per_key[k, first:stop], 0)
            offsets = torch.cat([offsets.new_zeros(1), offsets])
            begin = int(starts[k]) + before
            bags[column["feature"]] = (values[begin : begin + int(offsets[-1])], offsets)
        ids_of = {name: [] for name in self.tables}
        for column in self.columns:
            ids_of[column["table"]].append(bags[column["feature"]][0])
        ids_of = {name: torch.cat(ids) if ids else values[:0] for name, ids in ids_of.items()}
        too_big = {
            name: int(torch.unique(ids).numel())
            for name, ids in ids_of.items()
            if int(torch.unique(ids).numel()) > self.tables[name].num_rows
        }
        if too_big:
            if stop - first > 1:
                half = (first + stop) // 2
                return torch.cat(
                    [
                        self._pool(values, per_key, starts, first, half),
                        self._pool(values, per_key, starts, half, stop),
                    ]
                )
            raise ValueError(
                "a cache of tiered tables is smaller than one sample's distinct ids: "
                + "; ".join(
                    f"'{n}' holds {self.tables[n].num_rows} rows, the sample needs {k}"
                    for n, k in too_big.items()
                )
                + "; serve with a larger --cache-rows"
            )
        out = torch.empty(stop - first, self.width, dtype=torch.float32)
        for name, table in self.tables.items():
            rows = table.rows(ids_of[name])  # every feature of the table: one batch of rows
            weight = table.weight if table.weight.dtype == torch.float32 else table.weight.float()
            at = 0
            for column in (c for c in self.columns if c["table"] == name):
                ids, offsets = bags[column["feature"]]
                mean = self.info["tables"][name]["mean"]
                out[:, column["start"] : column["stop"]] = F.embedding_bag(
                    rows[at : at + len(ids)],
                    weight,
                    offsets,
                    mode="mean" if mean else "sum",
                    include_last_offset=True,
                )
                at += len(ids)
        return out

    def stats(self) -> dict[str, dict[str, float]]:
        """Per table: ``lookups`` and ``hits`` (distinct keys per batch), ``misses``,
        ``fetched`` (rows read from the store), ``initialized`` (a fixed table's rows the
        checkpoint did not hold), ``evicted``, ``rows_resident`` and ``cache_rows``."""
        with self._lock:
            return {name: table.stats() for name, table in self.tables.items()}

    def hit_rate(self) -> float:
        """Hits over lookups of every table so far (nan before the first)."""
        stats = self.stats().values()
        lookups = sum(s["lookups"] for s in stats)
        return sum(s["hits"] for s in stats) / lookups if lookups else math.nan


def attach_cached_tables(
    module: nn.Module, info: dict[str, Any], feature_names: list[str], cache_rows: int | None
) -> CachedTables:
    """Put :class:`CachedTables` of ``info`` in front of a loaded tiered export's program
    (``module``, in place): it is then called with ``(dense, values, lengths)`` like any
    export. Returns them."""
    tables = CachedTables(info, feature_names, cache_rows)
    module.register_forward_pre_hook(tables, prepend=True)  # before the input check
    module.cached_tables = tables
    return tables


def copy_program(module: nn.Module) -> nn.Module:
    """A deep copy of a loaded export's program (``copy.deepcopy`` of a GraphModule drops its
    hooks), sharing its :class:`CachedTables` if it has them (see the module docstring)."""
    tables = getattr(module, "cached_tables", None)
    with warnings.catch_warnings():
        # torch's pytree copies the program's input spec through a deprecated class
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
        copied = copy.deepcopy(module)
    if tables is not None:
        copied.register_forward_pre_hook(tables, prepend=True)
        copied.cached_tables = tables
    return copied
