"""A parquet file written piece by piece and committed atomically (the outputs of ``recsys
predict`` for sequence and ranking models)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import pyarrow as pa
import pyarrow.parquet as pq

from recsys._files import remove_quietly

__all__ = ["ParquetPieces"]


class ParquetPieces:
    """Tables of one schema written one after another into ``output``: the file appears
    (replacing one already there) when the ``with`` block ends without an error and at least
    one piece was written; otherwise nothing is left behind. ``rows`` and ``columns`` say what
    was written.

    Example::

        with ParquetPieces(Path("out.parquet")) as out:
            for piece in pieces:
                out.write(piece)
        out.rows, out.columns
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.tmp = output.with_name(f".tmp-{os.getpid()}-{output.name}")
        self.rows = 0
        self.columns: list[str] = []
        self._writer: pq.ParquetWriter | None = None

    def __enter__(self) -> ParquetPieces:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        return self

    def write(self, table: pa.Table) -> None:
        """Append ``table`` (the first one sets the schema)."""
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.tmp, table.schema)
            self.columns = table.column_names
        self._writer.write_table(table)
        self.rows += table.num_rows

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.close()
                if kind is None:
                    os.replace(self.tmp, self.output)
        finally:
            remove_quietly(self.tmp)
