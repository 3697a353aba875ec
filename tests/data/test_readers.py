"""Raw input readers: CSV lines checked like Criteo lines, unreadable files named."""

import gzip

import numpy as np
import pyarrow as pa
import pytest

from recsys.data.readers import MalformedLines, Roles, read_table, signed_log1p

from .test_criteo import write

ROLES = Roles(categorical=["user"], multi_hot=["tags"], dense=["x"], labels=["click"])
CSV = [
    "user,tags,x,unused,click",  # 1 header
    "u1,a|b,1.5,z,1",  # 2 ok
    "u2,,,z,0",  # 3 ok: empty dense is missing, empty bag
    "u3,a,abc,z,1",  # 4 dense not a number
    "u4,a,2",  # 5 short row
    "u5,a,3,z,2",  # 6 label not 0/1
    "",  # 7 empty line
    "u7,a,nan,z,1",  # 8 nan is not a finite number
    "u8,a,1e999,z,0",  # 9 overflows float32
    '"u,9",a||b,-2e1,"q,q",1.0',  # 10 ok: quoted commas, an empty item in the bag
    ",c,4,z,0",  # 11 ok: user missing
]


def test_csv_malformed_lines_name_file_line_and_column(tmp_path):
    path = write(tmp_path / "events.csv", CSV)
    malformed = MalformedLines()
    table = pa.concat_tables(read_table("csv", path, ROLES, 1 << 20, False, malformed))
    assert malformed.examples == [
        f"{path}:4: dense x 'abc' is not a finite number",
        f"{path}:5: expected 5 comma-separated fields, found 3",
        f"{path}:6: label click '2' is not 0 or 1",
        f"{path}:7: empty line",
        f"{path}:8: dense x 'nan' is not a finite number",
        f"{path}:9: dense x '1e999' is not a finite number",
    ]
    assert malformed.reasons == {"x": 3, "field count": 1, "click": 1, "empty line": 1}
    assert table.column_names == ["click", "x", "user", "tags"]
    assert table.column("user").to_pylist() == ["u1", "u2", "u,9", None]
    assert table.column("x").to_pylist() == [1.5, None, -20.0, 4.0]  # empty: missing
    assert table.column("click").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    assert table.column("tags").to_pylist() == [["a", "b"], [], ["a", None, "b"], ["c"]]


def test_csv_strict_mode_names_the_line(tmp_path):
    path = write(tmp_path / "events.csv", CSV)
    with pytest.raises(ValueError, match=r"events.csv:4: malformed line: dense x 'abc' is not a"):
        list(read_table("csv", path, ROLES, 1 << 20, True, MalformedLines()))
    path = write(tmp_path / "short.csv", [CSV[0], CSV[1], CSV[4]])
    with pytest.raises(ValueError, match=r"short.csv:3: malformed line: expected 5 comma-sep"):
        list(read_table("csv", path, ROLES, 1 << 20, True, MalformedLines()))


def test_csv_line_numbers_survive_tiny_chunks(tmp_path):
    lines = [CSV[0]] + [f"u{i},a,{i},z,{i % 2}" for i in range(400)]
    for bad in (17, 150, 151, 401):  # line numbers, the header being line 1
        lines[bad - 1] = f"u,a,{'x' if bad % 2 else ''},z"
    path = write(tmp_path / "events.csv", lines)
    malformed = MalformedLines()
    pieces = list(read_table("csv", path, ROLES, 1000, False, malformed))
    assert len(pieces) > 5 and sum(p.num_rows for p in pieces) == 396
    assert [int(e.split(":")[1]) for e in malformed.examples] == [17, 150, 151, 401]


def truncated_gzip(path, text: str):
    data = gzip.compress(text.encode())
    path.write_bytes(data[: len(data) // 2])
    return path


def test_truncated_gzip_csv_is_named(tmp_path):
    lines = [CSV[0]] + [f"u{i},a|b,{i},z,{i % 2}" for i in range(5000)]
    path = truncated_gzip(tmp_path / "events.csv.gz", "\n".join(lines))
    with pytest.raises(ValueError, match=r"^'.*events.csv.gz' is truncated or corrupt \(") as error:
        list(read_table("csv", path, ROLES, 1 << 20, False, MalformedLines()))
    assert "\n" not in str(error.value)


def test_signed_log1p():
    x = np.array([-1e6, -3.0, -0.5, 0.0, 0.5, 3.0, 1e6])
    np.testing.assert_allclose(signed_log1p(x), np.sign(x) * np.log(1 + np.abs(x)))
    np.testing.assert_allclose(signed_log1p(x[3:]), np.log1p(x[3:]))  # counts: log(1 + x)
