"""Tiered tables in checkpoints: every stored row streamed to files in chunks, never whole.

Per tiered table ``<t>``, a checkpoint directory holds three files next to DCP's:

- ``tiered.<t>.json``: ``{"rows": n, "record_bytes": r, "layout": [...]}``;
- ``tiered.<t>.keys``: ``n`` little-endian int64 keys (a fixed table's row numbers), ascending;
- ``tiered.<t>.rows``: ``n`` records of ``r`` bytes, the row's weights then its optimizer state
  (see :mod:`recsys.embedding.row_store`).

Only rows the store holds are written (a row never touched keeps its lazy initial value), and
the format does not depend on the tier: a table saved from disk loads into host memory and back.
The checkpoint's own commit (a directory rename, :mod:`recsys.train.checkpoint`) makes the files
atomic with the rest; loading replaces the store's content, so a crash during write-back after
the checkpoint leaves nothing of the crashed run in a resumed one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from recsys.embedding.row_cache import RowCache

__all__ = ["CHUNK_ROWS", "TieredFiles"]

CHUNK_ROWS = 1 << 16


class TieredFiles:
    """Saves and loads the rows of tiered tables (their caches written back first).

    Args:
        caches: table name -> its :class:`~recsys.embedding.row_cache.RowCache` (and store).
        layouts: table name -> what its record holds (e.g. ``["weight:float32:16",
            "sum:float32:1"]``), checked on load.
    """

    def __init__(self, caches: dict[str, RowCache], layouts: dict[str, list[str]]) -> None:
        self.caches, self.layouts = caches, layouts

    def save(self, directory: str | Path, chunk_rows: int = CHUNK_ROWS) -> None:
        """Write every table's stored rows under ``directory`` (fsynced), ``chunk_rows`` at a
        time."""
        directory = Path(directory)
        for name, cache in self.caches.items():
            cache.flush()
            rows = 0
            with (
                open(directory / f"tiered.{name}.keys", "wb") as keys_file,
                open(directory / f"tiered.{name}.rows", "wb") as rows_file,
            ):
                for keys, records in cache.store.items(chunk_rows):
                    keys_file.write(keys.numpy().astype("<i8").tobytes())
                    rows_file.write(records.numpy().tobytes())
                    rows += len(keys)
                for file in (keys_file, rows_file):
                    file.flush()
                    os.fsync(file.fileno())
            header = {
                "rows": rows,
                "record_bytes": cache.store.record_bytes,
                "layout": self.layouts[name],
            }
            with open(directory / f"tiered.{name}.json", "w") as file:
                file.write(json.dumps(header) + "\n")
                file.flush()
                os.fsync(file.fileno())

    def load(self, directory: str | Path, chunk_rows: int = CHUNK_ROWS) -> None:
        """Replace every table's rows by those saved under ``directory``.

        Raises:
            FileNotFoundError: a table's files are missing (named).
            ValueError: a table was saved with another row layout (named, both layouts)."""
        directory = Path(directory)
        for name, cache in self.caches.items():
            header_path = directory / f"tiered.{name}.json"
            if not header_path.is_file():
                raise FileNotFoundError(
                    f"tiered table '{name}': the checkpoint '{directory}' has no "
                    f"{header_path.name}; it was not saved with this table tiered"
                )
            header = json.loads(header_path.read_text())
            if header["layout"] != self.layouts[name]:
                raise ValueError(
                    f"tiered table '{name}': the checkpoint's rows hold {header['layout']}, "
                    f"this table's hold {self.layouts[name]}; load it with the same dim, dtype "
                    "and fused optimizer"
                )
            cache.clear()
            cache.store.clear()
            if header["rows"]:
                self._stream_in(directory, name, header, chunk_rows)

    def _stream_in(self, directory: Path, name: str, header: dict, chunk_rows: int) -> None:
        cache, width = self.caches[name], header["record_bytes"]
        header_name = f"tiered.{name}.json"
        keys = np.memmap(directory / f"tiered.{name}.keys", dtype="<i8", mode="r")
        records = np.memmap(directory / f"tiered.{name}.rows", dtype=np.uint8, mode="r")
        records = records.reshape(-1, width)
        if len(keys) != header["rows"] or len(records) != header["rows"]:
            raise ValueError(
                f"tiered table '{name}': {header_name} says {header['rows']} rows; "
                f"the keys file has {len(keys)}, the rows file {len(records)}"
            )
        for start in range(0, len(keys), chunk_rows):
            part = slice(start, start + chunk_rows)
            cache.store.write(
                torch.from_numpy(np.array(keys[part], dtype=np.int64)),
                torch.from_numpy(np.array(records[part])),
            )
        del keys, records
