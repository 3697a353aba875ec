"""`recsys preprocess`: Criteo, parquet and CSV inputs through NVTabular into training data."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.config import PreprocessConfig
from recsys.data.etl import preprocess, read_metadata
from recsys.data.parquet import ParquetDataset
from recsys.train.cli import main

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
    assert not out.with_name(out.name + ".partial").exists()
    assert (out / "categories").is_dir() and (out / "workflow").is_dir()
    files = sorted((out / "train").glob("*.parquet"))
    assert files and max(pq.ParquetFile(f).metadata.row_group(0).num_rows for f in files) <= 2048


def test_criteo_transforms_exactly(tmp_path):
    """Hand-made train / valid / test files: check every transformed value."""
    cats = lambda first: [first, *["aa"] * 25]  # noqa: E731
    train = [
        line("1", ["5", "", "-7", *["0"] * 10], cats("0000000f")),
        line("0", ["0", *["1"] * 12], cats("0000000f")),
        line("1", ["99", *["1"] * 12], cats("0000000e")),  # seen once: rare with threshold 2
        line("0", ["3", *["1"] * 12], cats("")),  # missing
    ]
    valid = [line("1", ["2", *["1"] * 12], cats("00000bad"))]  # unseen in train
    test = [line("0", ["1", *["1"] * 12], cats("0000000f"))]
    out = tmp_path / "out"
    preprocess(
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
        np.log1p([[5, 0, 0], [0, 1, 1], [99, 1, 1], [3, 1, 1]]),  # missing -> 0, -7 -> 0
        rtol=1e-6,
    )
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
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        preprocess(PreprocessConfig(input="x", output=str(tmp_path / "out")))
    with pytest.raises(ValueError, match="fixed for the criteo format"):
        preprocess(PreprocessConfig(input="x", output=str(tmp_path / "o2"), dense=["a"]))


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
