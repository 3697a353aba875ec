import gzip

import numpy as np
import pyarrow as pa
import pytest

from recsys.data.criteo import COLUMNS, CriteoDataset, MalformedLines, hash_hex, read_criteo


def line(label="1", ints=None, cats=None) -> str:
    ints = [str(i) for i in range(13)] if ints is None else ints
    cats = [f"{i:08x}" for i in range(26)] if cats is None else cats
    return "\t".join([label, *ints, *cats])


def write(path, lines, compress=False):
    text = "\n".join(lines) + "\n"
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


MALFORMED = [
    line(),  # 1 ok
    "bad line",  # 2 wrong field count
    line(ints=["x", *[str(i) for i in range(12)]]),  # 3 int_0 not an integer
    "",  # 4 empty line
    line(label="2"),  # 5 label out of range
    line(cats=["zz", *["00"] * 25]),  # 6 cat_0 not hex
    line(ints=[""] * 13, cats=[""] * 26),  # 7 ok: everything missing
    line(ints=["-3", *[""] * 12]),  # 8 ok: negative count
    "1\t2",  # 9 wrong field count
    line(ints=["9" * 20, *[""] * 12]),  # 10 does not fit int64
]


@pytest.mark.parametrize("compress", [False, True])
def test_malformed_lines_are_counted_with_line_numbers(tmp_path, compress):
    path = write(tmp_path / ("log.txt.gz" if compress else "log.txt"), MALFORMED, compress)
    malformed = MalformedLines()
    table = pa.concat_tables(read_criteo(path, malformed=malformed))
    assert table.num_rows == 3
    assert table.column_names == COLUMNS
    assert malformed.count == 7
    assert [e.split(": ")[0] for e in malformed.examples] == [
        f"{path}:{n}" for n in (2, 3, 4, 5, 6, 9, 10)
    ]
    assert "int_0 'x' is not an integer" in malformed.examples[1]
    assert "cat_0 'zz' is not hexadecimal" in malformed.examples[4]
    assert malformed.examples[2] == f"{path}:4: empty line"
    assert malformed.reasons["field count"] == 2 and malformed.reasons["label"] == 1
    assert malformed.reasons["empty line"] == 1
    assert malformed.reasons["int_0"] == 2
    # missing fields stay null: nothing silently becomes zero
    assert table.column("int_0").to_pylist() == [0.0, None, -3.0]
    assert table.column("cat_5").to_pylist() == ["00000005", None, "00000005"]
    assert table.column("label").to_pylist() == [1, 1, 1]


def test_line_numbers_survive_tiny_chunks(tmp_path):
    lines = [line(label=str(i % 2)) for i in range(300)]
    for bad in (17, 150, 151, 299):
        lines[bad - 1] = "broken"
    path = write(tmp_path / "log.txt", lines)
    malformed = MalformedLines()
    pieces = list(read_criteo(path, chunk_bytes=2000, malformed=malformed))
    assert len(pieces) > 10
    assert sum(p.num_rows for p in pieces) == 296
    assert [int(e.split(":")[1]) for e in malformed.examples] == [17, 150, 151, 299]


def test_strict_mode_stops_at_the_first_bad_line(tmp_path):
    path = write(tmp_path / "log.txt", MALFORMED)
    with pytest.raises(ValueError, match=r"log.txt:2: malformed line: expected 40"):
        list(read_criteo(path, strict=True))
    path = write(tmp_path / "log2.txt", [line(), line(label="7")])
    with pytest.raises(ValueError, match=r"log2.txt:2: malformed line: label '7'"):
        list(read_criteo(path, strict=True))


def test_a_csv_read_as_criteo_says_the_delimiters_differ(tmp_path):
    header = ",".join(["label", *(f"int_{i}" for i in range(13)), *(f"cat_{i}" for i in range(26))])
    path = write(tmp_path / "events.csv", [header, line().replace("\t", ",")])
    message = r"events.csv:1: .*expected 40 tab-separated fields, found 1 \(no tab in the line"
    with pytest.raises(ValueError, match=message + r" but 39 comma\(s\): is it another format"):
        list(read_criteo(path, strict=True))
    # A line that is merely short says nothing of formats.
    with pytest.raises(ValueError, match=r"found 1$"):
        list(read_criteo(write(tmp_path / "short.txt", ["1"]), strict=True))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        list(read_criteo(tmp_path / "nope.txt"))


def test_hash_hex():
    values = pa.array(["ff", None, "10", "FFFFFFFFFFFFFFFF", "68fd1e64"])
    assert hash_hex(values, 2**62).tolist() == [
        255,
        0,
        16,
        int("f" * 16, 16) % 2**62,
        int("68fd1e64", 16),
    ]
    assert hash_hex(values, 7).tolist() == [
        255 % 7,
        0,
        16 % 7,
        int("f" * 16, 16) % 7,
        int("68fd1e64", 16) % 7,
    ]


def test_criteo_dataset_reads_a_small_file_whole(tmp_path):
    rng = np.random.default_rng(0)
    lines = [
        line(label=str(rng.integers(2)), cats=[f"{rng.integers(1000):08x}" for _ in range(26)])
        for _ in range(500)
    ]
    path = write(tmp_path / "small.txt", [*lines, "junk"])
    data = CriteoDataset(path, hash_buckets=97, valid_fraction=0.2, test_fraction=0.1, seed=1)
    assert data.malformed.count == 1
    total = sum(data.num_samples(s) for s in ("train", "valid", "test"))
    assert total == 500 and 60 < data.num_samples("valid") < 140
    chunk = data.chunk("train", 0)
    assert chunk.dense.shape == (data.num_samples("train"), 13)
    assert np.allclose(chunk.dense[0].numpy(), np.log1p(np.arange(13)))
    assert chunk.sparse.values().max() < 97 and data.spec.cardinalities == (97,) * 26
    with pytest.raises(ValueError, match="no valid Criteo lines"):
        CriteoDataset(write(tmp_path / "junk.txt", ["junk"]))


def test_truncated_gzip_is_named(tmp_path):
    data = gzip.compress(("\n".join(line() for _ in range(3000)) + "\n").encode())
    path = tmp_path / "day_0.txt.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"^'.*day_0.txt.gz' is truncated or corrupt \(") as error:
        list(read_criteo(path))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="day_0.txt.gz' is truncated or corrupt"):
        CriteoDataset(path)


def test_criteo_dataset_keeps_the_sign_of_negative_counts(tmp_path):
    path = write(tmp_path / "neg.txt", [line(ints=["-3", "", "5", *["0"] * 10]) for _ in range(20)])
    dense = CriteoDataset(path, valid_fraction=0, test_fraction=0).chunk("train", 0).dense
    np.testing.assert_allclose(dense[:, :3].numpy(), [[-np.log1p(3), 0, np.log1p(5)]] * 20)
