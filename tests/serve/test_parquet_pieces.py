"""ParquetPieces: pieces written into one file that appears only when every piece is there."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.serve.parquet_pieces import ParquetPieces


def test_pieces_land_in_one_file_and_a_failure_leaves_the_old_one(tmp_path):
    output = tmp_path / "sub" / "out.parquet"
    with ParquetPieces(output) as out:
        out.write(pa.table({"a": [1, 2]}))
        out.write(pa.table({"a": [3]}))
    assert (out.rows, out.columns) == (3, ["a"])
    assert pq.read_table(output)["a"].to_pylist() == [1, 2, 3]
    with pytest.raises(RuntimeError, match="mid-way"), ParquetPieces(output) as out:
        out.write(pa.table({"a": [9]}))
        raise RuntimeError("mid-way")
    assert pq.read_table(output)["a"].to_pylist() == [1, 2, 3]  # the previous file intact
    assert sorted(p.name for p in output.parent.iterdir()) == ["out.parquet"]  # no .tmp left
    with ParquetPieces(tmp_path / "none.parquet") as out:
        pass
    assert out.rows == 0 and not (tmp_path / "none.parquet").exists()
