"""Tiered tables in checkpoints: every stored row streamed to files in chunks, never whole.

Per tiered table ``<t>``, a checkpoint directory holds three files next to DCP's:

- ``tiered.<t>.json``: ``{"table": "<t>", "part": 0, "parts": 1, "rows": n,
  "record_bytes": r, "layout": [...]}``;
- ``tiered.<t>.keys``: ``n`` little-endian int64 keys (a fixed table's row numbers), ascending;
- ``tiered.<t>.rows``: ``n`` records of ``r`` bytes, the row's weights then its optimizer state
  (see :mod:`recsys.embedding.tiered.row_store`).

A table sharded over ``P`` ranks writes one part per rank, ``tiered.<t>.part<j>of<P>.*``, each
with the keys its rank holds, as keys of the whole table (a row-wise shard's rows renumbered
back). Loading reads every part and keeps the keys the loading table (or rank) holds, so a
checkpoint loads on any number of ranks, or in one process.

Only rows the store holds are written (a row never touched keeps its lazy initial value), and
the format does not depend on the tier: a table saved from disk loads into host memory and back.
The checkpoint's own commit (a directory rename, :mod:`recsys.checkpoint.io`) makes the files
atomic with the rest; loading replaces the store's content, so a crash during write-back after
the checkpoint leaves nothing of the crashed run in a resumed one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recsys.embedding.tiered.row_cache import RowCache

__all__ = ["CHUNK_ROWS", "TablePart", "TieredFiles"]

CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class TablePart:
    """Which keys of a table one part of it (a rank's shard) holds, and how they are numbered.

    A fixed table's part holds rows ``[offset, offset + rows)`` of the table's ``table_rows``
    as its rows ``0 .. rows - 1``; a dynamic table's part (``rows`` None) holds the keys
    ``owns`` marks (None: every key), under their own value. It is part ``index`` of the
    ``count`` parts the table is saved in (one per shard)."""

    offset: int = 0
    rows: int | None = None
    owns: Callable[[torch.Tensor], torch.Tensor] | None = None
    index: int = 0
    count: int = 1
    table_rows: int | None = None

    def select(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of the table's ``keys`` this part holds, their keys in this part)."""
        if self.owns is not None:
            return self.owns(keys), keys
        if self.rows is None:
            return torch.ones_like(keys, dtype=torch.bool), keys
        mask = (keys >= self.offset) & (keys < self.offset + self.rows)
        return mask, keys - self.offset


class TieredFiles:
    """Saves and loads the rows of tiered tables (their caches written back first).

    Args:
        caches: table name -> its :class:`~recsys.embedding.tiered.row_cache.RowCache` (and store).
        layouts: table name -> what its record holds (e.g. ``["weight:float32:16",
            "sum:float32:1"]``), checked on load.
        parts: table name -> the part of the table its cache holds (default: the whole).
    """

    def __init__(
        self,
        caches: dict[str, RowCache],
        layouts: dict[str, list[str]],
        parts: dict[str, TablePart] | None = None,
    ) -> None:
        self.caches, self.layouts = caches, layouts
        self.parts = {name: (parts or {}).get(name, TablePart()) for name in caches}

    def _stem(self, name: str, part: int, num_parts: int) -> str:
        return f"tiered.{name}" if num_parts == 1 else f"tiered.{name}.part{part}of{num_parts}"

    def save(self, directory: str | Path, chunk_rows: int = CHUNK_ROWS) -> None:
        """Write every table's stored rows under ``directory`` (fsynced), ``chunk_rows`` at a
        time."""
        directory = Path(directory)
        for name, cache in self.caches.items():
            cache.flush()
            part, rows = self.parts[name], 0
            stem, offset = self._stem(name, part.index, part.count), part.offset
            with (
                open(directory / f"{stem}.keys", "wb") as keys_file,
                open(directory / f"{stem}.rows", "wb") as rows_file,
            ):
                for keys, records in cache.store.items(chunk_rows):
                    keys_file.write((keys + offset).numpy().astype("<i8").tobytes())
                    rows_file.write(records.numpy().tobytes())
                    rows += len(keys)
                for file in (keys_file, rows_file):
                    file.flush()
                    os.fsync(file.fileno())
            header = {
                "table": name,
                "part": part.index,
                "parts": part.count,
                "rows": rows,
                "record_bytes": cache.store.record_bytes,
                "layout": self.layouts[name],
            }
            with open(directory / f"{stem}.json", "w") as file:
                file.write(json.dumps(header) + "\n")
                file.flush()
                os.fsync(file.fileno())

    def load(
        self, directory: str | Path, chunk_rows: int = CHUNK_ROWS, *, weights_only: bool = False
    ) -> None:
        """Replace every table's rows by those saved under ``directory`` (from every part of
        it, the keys this collection's part holds).

        Args:
            weights_only: take the saved weights and start every row's optimizer state fresh
                (fine-tuning: the optimizer may differ; only the weights must match).

        Raises:
            FileNotFoundError: a table's files, or one of its parts, are missing (named).
            ValueError: a table was saved with another row layout (named, both layouts)."""
        directory = Path(directory)
        compared = slice(0, 1) if weights_only else slice(None)
        for name, cache in self.caches.items():
            headers = self._headers(directory, name)
            for _, header in headers:
                if header["layout"][compared] != self.layouts[name][compared]:
                    raise ValueError(
                        f"tiered table '{name}': the checkpoint's rows hold {header['layout']}, "
                        f"this table's hold {self.layouts[name]}; load it with the same dim, "
                        "dtype and fused optimizer"
                    )
            cache.clear()
            cache.store.clear()
            for stem, header in headers:
                if header["rows"]:
                    self._stream_in(directory, name, stem, header, chunk_rows, weights_only)

    def _headers(self, directory: Path, name: str) -> list[tuple[str, dict]]:
        """(file stem, header) of every part table ``name`` was saved in."""
        single = directory / f"tiered.{name}.json"
        if single.is_file():
            return [(f"tiered.{name}", json.loads(single.read_text()))]
        found = {}
        for path in sorted(directory.glob(f"tiered.{name}.part*of*.json")):
            header = json.loads(path.read_text())
            if header.get("table") == name:
                found[header["part"]] = (path.name.removesuffix(".json"), header)
        if not found:
            raise FileNotFoundError(
                f"tiered table '{name}': the checkpoint '{directory}' has no {single.name} (nor "
                "parts of it); it was not saved with this table tiered"
            )
        num_parts = next(iter(found.values()))[1]["parts"]
        missing = [
            self._stem(name, j, num_parts) + ".json" for j in range(num_parts) if j not in found
        ]
        if missing:
            raise FileNotFoundError(
                f"tiered table '{name}': the checkpoint '{directory}' lacks {missing} of its "
                f"{num_parts} parts"
            )
        return [found[j] for j in range(num_parts)]

    def _stream_in(
        self,
        directory: Path,
        name: str,
        stem: str,
        header: dict,
        chunk_rows: int,
        weights_only: bool,
    ) -> None:
        cache, width, part = self.caches[name], header["record_bytes"], self.parts[name]
        keys = np.memmap(directory / f"{stem}.keys", dtype="<i8", mode="r")
        records = np.memmap(directory / f"{stem}.rows", dtype=np.uint8, mode="r")
        records = records.reshape(-1, width)
        if len(keys) != header["rows"] or len(records) != header["rows"]:
            raise ValueError(
                f"tiered table '{name}': {stem}.json says {header['rows']} rows; "
                f"the keys file has {len(keys)}, the rows file {len(records)}"
            )
        if part.table_rows is not None and len(keys) and int(keys.max()) >= part.table_rows:
            raise ValueError(
                f"tiered table '{name}': the checkpoint holds row {int(keys.max())}, this table "
                f"has {part.table_rows} rows; load it into a table at least as large"
            )
        for start in range(0, len(keys), chunk_rows):
            chunk = slice(start, start + chunk_rows)
            held, local = part.select(torch.from_numpy(np.array(keys[chunk], dtype=np.int64)))
            if bool(held.any()):
                keys_held, rows = local[held], torch.from_numpy(np.array(records[chunk]))[held]
                if weights_only:  # the saved weights, the optimizer's initial state
                    weights = cache.codec.widths[0]
                    fresh = cache.fresh(keys_held)[:, weights:]
                    rows = torch.cat([rows[:, :weights], fresh], dim=1)
                cache.store.write(keys_held, rows)
        del keys, records
