"""`recsys preprocess`: Criteo, parquet and CSV inputs through NVTabular into training data."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.config import PreprocessConfig
from recsys.data.etl import file_fingerprint, preprocess, read_metadata
from recsys.data.parquet import ParquetDataset

from .conftest import CARDINALITIES, TRAIN_ROWS
from .test_criteo import line, write


def test_criteo_output_layout_and_metadata(criteo_dataset_dir):
    report = criteo_dataset_dir
    out = report.output
    metadata = read_metadata(out)
    assert json.loads((out / "metadata.json").read_text()) == metadata
    assert report.malformed.count == 2
    assert sum(report.rows.values()) == TRAIN_ROWS
    assert 0.08 < report.rows["valid"] / TRAIN_ROWS < 0.12
    assert metadata["labels"] == ["label"] and len(metadata["dense"]) == 13
    assert [c["name"] for c in metadata["categorical"]] == [f"cat_{i}" for i in range(26)]
    for entry, n in zip(metadata["categorical"], CARDINALITIES, strict=True):
        # ids 0..2 are reserved (padding, missing, rare); never more ids than distinct values
        assert 3 < entry["cardinality"] <= n + 3 and entry["multi_hot"] is False
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no work directory left over
    assert (out / "categories").is_dir() and (out / "workflow").is_dir()
    files = sorted((out / "train").glob("*.parquet"))
    assert files and max(pq.ParquetFile(f).metadata.row_group(0).num_rows for f in files) <= 2048
    fingerprint = metadata["fingerprint"]
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0  # sha256 hex
    for split in ("train", "valid", "test"):
        for file in (out / split).glob("*.parquet"):
            assert file_fingerprint(file) == fingerprint


def test_criteo_transforms_exactly(tmp_path):
    """Hand-made train / valid / test files: check every transformed value."""
    cats = lambda first: [first, *["aa"] * 25]  # noqa: E731
    train = [
        line("1", ["5", "", "-7", *["0"] * 10], cats("0000000f")),  # -7: sign kept
        line("0", ["0", *["1"] * 12], cats("0000000f")),
        line("1", ["99", *["1"] * 12], cats("0000000e")),  # seen once: rare with threshold 2
        line("0", ["3", *["1"] * 12], cats("")),  # missing
    ]
    valid = [line("1", ["2", *["1"] * 12], cats("00000bad"))]  # unseen in train
    test = [line("0", ["1", *["1"] * 12], cats("0000000f"))]
    out = tmp_path / "out"
    report = preprocess(
        PreprocessConfig(
            input=str(write(tmp_path / "train.txt", train)),
            valid=str(write(tmp_path / "valid.txt", valid)),
            test=str(write(tmp_path / "test.txt", test)),
            output=str(out),
            freq_threshold=2,
        )
    )
    data = ParquetDataset(out)
    batch = data.chunk("train", 0)
    np.testing.assert_allclose(
        batch.dense[:, :3].numpy(),
        np.sign([[5, 0, -7], [0, 1, 1], [99, 1, 1], [3, 1, 1]])
        * np.log1p([[5, 0, 7], [0, 1, 1], [99, 1, 1], [3, 1, 1]]),  # missing -> 0
        rtol=1e-6,
    )
    assert report.stats.negative_dense["int_2"] == 1 and report.stats.missing_dense["int_1"] == 1
    assert report.metadata["dense_transform"] == "missing -> 0, then sign(x) * log(1 + |x|)"
    assert "; negative values: int_2 1; missing: int_1 1" in report.notes()[0]
    assert batch.labels[:, 0].tolist() == [1, 0, 1, 0]
    cat0 = batch.sparse["cat_0"].values().tolist()
    assert cat0[0] == cat0[1] >= 3  # the frequent value gets its own id
    assert cat0[2:] == [2, 1]  # rare -> 2, missing -> 1
    assert data.chunk("valid", 0).sparse["cat_0"].values().tolist() == [2]  # unseen -> rare
    assert data.chunk("test", 0).sparse["cat_0"].values().tolist() == [cat0[0]]


def test_hash_encoding(tmp_path):
    train = [line(cats=[f"{i:08x}", *["ab"] * 25]) for i in range(40)]
    out = tmp_path / "out"
    preprocess(
        PreprocessConfig(
            input=str(write(tmp_path / "t.txt", train)),
            output=str(out),
            encoding="hash",
            hash_buckets=7,
            valid_fraction=0.25,
            test_fraction=0.25,
        )
    )
    data = ParquetDataset(out)
    assert data.spec.cardinalities == (7,) * 26
    ids = data.chunk("train", 0).sparse["cat_0"].values()
    assert ids.min() >= 0 and ids.max() < 7 and len(set(ids.tolist())) > 3


def table_input(tmp_path, bad_rows=True):
    rng = np.random.default_rng(0)
    n = 600
    genres = [
        list(rng.choice(["drama", "comedy", "noir", "sci-fi"], rng.integers(0, 4), replace=False))
        for _ in range(n)
    ]
    price = rng.gamma(2.0, 10.0, n)
    price[5] = np.nan  # malformed: NaN is not "missing"
    click = rng.integers(0, 2, n).astype(float)
    if bad_rows:
        click[7] = 2.0  # malformed label
    table = pa.table(
        {
            "user": rng.integers(0, 50, n),
            "item": [f"item{i}" for i in rng.integers(0, 80, n)],
            "genres": genres,
            "price": pa.array(price, mask=np.arange(n) == 9),  # row 9: missing, filled with 0
            "click": click,
            "purchase": rng.integers(0, 2, n),
            "unused": np.zeros(n),
        }
    )
    if not bad_rows:
        table = table.set_column(3, "price", pa.array(np.nan_to_num(price)))
    return table, genres


def test_parquet_input_with_multi_hot_and_two_labels(tmp_path):
    table, genres = table_input(tmp_path)
    pq.write_table(table, tmp_path / "events.parquet", row_group_size=100)
    out = tmp_path / "out"
    exit_code = main(
        [
            "preprocess",
            "--format",
            "parquet",
            "--input",
            str(tmp_path / "events.parquet"),
            "--output",
            str(out),
            "--categorical",
            "user,item",
            "--multi-hot",
            "genres",
            "--dense",
            "price",
            "--label",
            "click,purchase",
            "--preprocess.test_fraction=0.2",
        ]
    )
    assert exit_code == 0
    metadata = read_metadata(out)
    assert metadata["malformed_rows"] == 2
    assert [c["multi_hot"] for c in metadata["categorical"]] == [False, False, True]
    data = ParquetDataset(out)
    assert data.spec.label_names == ("click", "purchase")
    assert data.spec.sparse_names == ("user", "item", "genres")
    rows = sum(data.num_samples(s) for s in ("train", "valid", "test"))
    assert rows == 598
    batch = data.chunk("train", 0)
    assert batch.labels.shape[1] == 2
    lengths = batch.sparse["genres"].lengths()
    assert lengths.max() == 3 and lengths.min() == 0  # bags of 0..3 genres, order kept
    kept = [g for i, g in enumerate(genres) if i not in (5, 7)]
    assert sorted(set(lengths.tolist())) == sorted({len(g) for g in kept})


def test_csv_input_with_bags(tmp_path):
    rows = ["user,tags,age,click"] + [
        f"u{i % 7},{'|'.join(['a', 'b', 'c'][: i % 4])},{i},{i % 2}" for i in range(40)
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    preprocess(
        PreprocessConfig(
            format="csv",
            input=str(tmp_path / "t.csv"),
            output=str(out),
            categorical=["user"],
            multi_hot=["tags"],
            dense=["age"],
            label=["click"],
            valid_fraction=0.2,
            test_fraction=0.2,
        )
    )
    data = ParquetDataset(out)
    all_lengths = []
    for split in ("train", "valid", "test"):
        for i in range(data.num_chunks(split)):
            all_lengths += data.chunk(split, i).sparse["tags"].lengths().tolist()
    assert sorted(all_lengths) == sorted(i % 4 for i in range(40))


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(categorical=["usr"]), ValueError, r"no column\(s\) 'usr' \(did you mean 'user'\?\)"),
        (dict(label=[]), ValueError, "needs --label"),
        (dict(dense=["price", "user"]), ValueError, "more than one role"),
        (dict(input="/nonexistent/x.parquet"), FileNotFoundError, "no such file"),
        (dict(strict=True), ValueError, r"row 6: dense price nan is not finite"),
        (dict(valid_fraction=0.0), ValueError, "split 'valid' has no rows"),
        (dict(dense=["item"]), ValueError, "dense column 'item' is string, not numeric"),
        (dict(multi_hot=["purchase"]), ValueError, "multi-hot column 'purchase' is int64, not"),
        (dict(encoding="hash", multi_hot=["genres"]), ValueError, "hash' does not support multi"),
    ],
)
def test_bad_preprocess_options(tmp_path, changes, error, message):
    table, _ = table_input(tmp_path)
    pq.write_table(table, tmp_path / "events.parquet")
    options = dict(
        format="parquet",
        input=str(tmp_path / "events.parquet"),
        output=str(tmp_path / "out"),
        categorical=["user"],
        dense=["price"],
        label=["click"],
    )
    with pytest.raises(error, match=message):
        preprocess(PreprocessConfig(**{**options, **changes}))
    assert [p.name for p in tmp_path.iterdir()] == ["events.parquet"]  # nothing left over


def test_criteo_roles_are_fixed(tmp_path):
    log = write(tmp_path / "t.txt", [line()])
    with pytest.raises(ValueError, match="fixed for the criteo format"):
        preprocess(PreprocessConfig(input=str(log), output=str(tmp_path / "o"), dense=["a"]))


def test_cli_reports_and_suggests_training(
    criteo_dataset_dir, synthetic_criteo_log, tmp_path, capsys
):
    out = tmp_path / "again"
    args = [
        "preprocess",
        "--input",
        str(synthetic_criteo_log),
        "--output",
        str(out),
        "--preprocess.valid_fraction=0.1",
        "--preprocess.test_fraction=0.1",
    ]
    assert main([*args, "--preprocess.chunk_mb=1"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 malformed line(s)" in printed
    assert f"--data.path={out}" in printed
    # Pieces of 1 MB instead of 64 MB: the same rows land in the same splits.
    again = read_metadata(out)["splits"]
    before = read_metadata(criteo_dataset_dir.output)["splits"]
    assert {s: again[s]["rows"] for s in again} == {s: before[s]["rows"] for s in before}
    first = lambda d: ParquetDataset(d).chunk("valid", 0).dense[:50]  # noqa: E731
    assert first(out).equal(first(criteo_dataset_dir.output))


def test_parquet_null_bags_signed_dense_and_counts(tmp_path):
    """A null list is an empty bag, null items are dropped; N(0, 1) dense values keep their sign
    (they were clipped to 0); both are counted in the report."""
    rng = np.random.default_rng(1)
    n = 300
    genres = [["drama", "noir"][: i % 3] for i in range(n)]
    genres[4], genres[5], genres[7] = None, ["drama", None, "noir"], [None]
    x = rng.normal(size=n)
    x[9] = np.nan
    table = pa.table(
        {
            "user": rng.integers(0, 20, n),
            "genres": pa.array(genres, pa.list_(pa.string())),
            "x": pa.array(x, mask=np.arange(n) == 9),  # row 9: missing
            "click": rng.integers(0, 2, n).astype(float),
        }
    )
    for name, rows in (
        ("train", slice(0, 200)),
        ("valid", slice(200, 250)),
        ("test", slice(250, n)),
    ):
        pq.write_table(table[rows], tmp_path / f"{name}.parquet")
    report = preprocess(
        PreprocessConfig(
            format="parquet",
            input=str(tmp_path / "train.parquet"),
            valid=str(tmp_path / "valid.parquet"),
            test=str(tmp_path / "test.parquet"),
            output=str(tmp_path / "out"),
            categorical=["user"],
            multi_hot=["genres"],
            dense=["x"],
            label=["click"],
        )
    )
    batch = ParquetDataset(report.output).chunk("train", 0)
    bags = batch.sparse["genres"]
    lengths = bags.lengths().tolist()
    assert lengths[3:9] == [0, 0, 2, 0, 0, 2]  # rows 4 and 7: null -> []; row 5: None dropped
    ids = [bag.tolist() for bag in bags.to_dense()]
    assert ids[5] == ids[2] == ids[8] and ids[1] == ids[5][:1] and min(ids[5]) >= 3
    expected = np.nan_to_num(np.sign(x[:200]) * np.log1p(np.abs(x[:200])))  # missing -> 0
    np.testing.assert_allclose(batch.dense[:, 0].numpy(), expected, rtol=1e-6, atol=1e-7)
    assert (batch.dense[:, 0] < 0).sum() == (x[:200] < 0).sum() > 50
    stats = report.stats
    assert stats.negative_dense["x"] == (x < 0).sum() and stats.missing_dense["x"] == 1
    assert stats.null_bags["genres"] == 1 and stats.null_bag_items["genres"] == 2
    assert report.metadata["input"]["null_bags"] == {"genres": 1}
    assert "genres: 1 null list(s) read as empty bags, 2 null item(s) dropped" in report.notes()[1]


def test_csv_malformed_lines_are_skipped_and_reported(tmp_path, capsys):
    rows = ["user,tags,age,click"] + [f"u{i % 7},a|b,{i - 20},{i % 2}" for i in range(60)]
    rows[5] = "u1,a,,1"  # missing age: filled with 0
    rows[10] = "u1,a,abc,1"  # line 11: malformed
    rows[20] = "u1,a"  # line 21: short
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    args = ["preprocess", "--format", "csv", "--input", str(tmp_path / "t.csv")]
    args += ["--categorical", "user", "--multi-hot", "tags", "--dense", "age", "--label", "click"]
    assert main([*args, "--output", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "skipped 2 malformed line(s) (1 x age, 1 x field count); first: " in printed
    assert "t.csv:11: dense age 'abc' is not a finite number" in printed
    assert "t.csv:21: expected 4 comma-separated fields, found 2" in printed
    assert (
        "dense: missing -> 0, then sign(x) * log(1 + |x|); negative values: age 17; missing: age 1"
        in printed
    )
    assert read_metadata(tmp_path / "out")["input"]["missing_dense"] == {"age": 1}
    strict = [*args, "--output", str(tmp_path / "o2"), "--preprocess.strict=true"]
    assert main(strict) == 2
    error = capsys.readouterr().err
    assert (
        error == f"recsys: error: {tmp_path / 't.csv'}:11: malformed line: dense age 'abc' "
        "is not a finite number\n"
    )


def test_truncated_gzip_input_is_one_clear_error(tmp_path, capsys):
    data = gzip.compress(("\n".join(line() for _ in range(3000)) + "\n").encode())
    (tmp_path / "day.txt.gz").write_bytes(data[: len(data) // 2])
    args = ["preprocess", "--input", str(tmp_path / "day.txt.gz"), "--output", str(tmp_path / "o")]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"recsys: error: '{tmp_path / 'day.txt.gz'}' is truncated or corrupt")
    assert error.count("\n") == 1 and not (tmp_path / "o").exists()
