"""`recsys preprocess --apply DATA_DIR`: new raw data through an already fitted workflow, and the
fingerprint that tells preprocessed data from raw data."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.config import PreprocessConfig
from recsys.data.batch import Batch
from recsys.data.etl import file_fingerprint, preprocess, read_metadata
from recsys.data.parquet import ParquetDataset

ROLES = dict(categorical=["user", "item"], multi_hot=["genres"], dense=["price"], label=["click"])


def events(n: int, seed: int, unseen: bool = False) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 30, n)
    items = np.array([f"item{k}" for k in rng.integers(0, 50, n)])
    if unseen:
        users[::7], items[::5] = 999, "brand-new"
    return pa.table(
        {
            "user": users,
            "item": items,
            "genres": [["drama", "noir", "sci-fi"][: i % 4] for i in range(n)],
            "price": rng.normal(0, 5, n),
            "click": rng.integers(0, 2, n).astype(float),
        }
    )


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A dataset fitted on 400 rows (train in input order: valid and test are given)."""
    root = tmp_path_factory.mktemp("fitted")
    train = events(400, seed=0)
    for name, table in (("train", train), ("valid", events(50, 1)), ("test", events(50, 2))):
        pq.write_table(table, root / f"{name}.parquet")
    report = preprocess(
        PreprocessConfig(
            format="parquet",
            input=str(root / "train.parquet"),
            valid=str(root / "valid.parquet"),
            test=str(root / "test.parquet"),
            output=str(root / "data"),
            **ROLES,
        )
    )
    batch = ParquetDataset(report.output).chunk("train", 0)
    vocabulary = {
        name: dict(
            zip(train.column(name).to_pylist(), batch.sparse[name].values().tolist(), strict=True)
        )
        for name in ("user", "item")
    }
    return report.output, vocabulary


def expected_ids(values, vocabulary) -> list[int]:
    return [vocabulary.get(v, 2) for v in values]  # unseen -> 2 (rare or unseen)


def test_apply_keeps_vocabulary_sizes_fingerprint_and_row_order(fitted, tmp_path):
    source, vocabulary = fitted
    day = events(300, seed=3, unseen=True)
    (tmp_path / "day").mkdir()
    for i in range(3):  # three files: row order must hold across pieces
        pq.write_table(day[i * 100 : (i + 1) * 100], tmp_path / "day" / f"part{i}.parquet")
    report = preprocess(
        PreprocessConfig(
            apply=str(source),
            format="parquet",
            input=str(tmp_path / "day"),
            output=str(tmp_path / "out"),
            valid_fraction=0,
            test_fraction=0,
        )
    )
    metadata, before = read_metadata(report.output), read_metadata(source)
    assert metadata["categorical"] == before["categorical"]  # the same table sizes
    assert metadata["fingerprint"] == before["fingerprint"] != ""
    assert metadata["dense_transform"] == before["dense_transform"]
    assert {s: metadata["splits"][s]["rows"] for s in metadata["splits"]} == {
        "train": 300,
        "valid": 0,
        "test": 0,
    }
    data = ParquetDataset(report.output)
    assert data.num_chunks("valid") == data.num_samples("test") == 0
    batch = Batch.concat([data.chunk("train", i) for i in range(data.num_chunks("train"))])
    for name in ("user", "item"):
        ids = batch.sparse[name].values().tolist()
        assert ids == expected_ids(day.column(name).to_pylist(), vocabulary[name])
    assert 2 in batch.sparse["user"].values().tolist()
    price = day.column("price").to_numpy()
    expected = np.sign(price) * np.log1p(np.abs(price))  # the saved workflow's dense transform
    np.testing.assert_allclose(batch.dense[:, 0].numpy(), expected, rtol=1e-6)
    assert batch.labels[:, 0].tolist() == day.column("click").to_pylist()
    assert batch.sparse["genres"].lengths().tolist() == [i % 4 for i in range(300)]
    files = sorted((report.output / "train").glob("*.parquet"))
    assert {file_fingerprint(f) for f in files} == {before["fingerprint"]}
    assert file_fingerprint(tmp_path / "day" / "part0.parquet") is None  # raw input
    assert metadata["preprocess"]["apply"] == str(source)


def test_apply_to_unlabeled_csv(fitted, tmp_path, capsys):
    """Scoring input: no label column, and the ids of a column fitted as integers read from
    CSV text get the same ids."""
    source, vocabulary = fitted
    day = events(60, seed=4, unseen=True)
    rows = ["item,user,genres,price"] + [
        f"{i},{u},{'|'.join(g)},{p!r}"
        for i, u, g, p in zip(
            *(day.column(c).to_pylist() for c in ("item", "user", "genres", "price")), strict=True
        )
    ]
    (tmp_path / "day.csv").write_text("\n".join(rows) + "\n")
    args = ["preprocess", "--format", "csv", "--apply", str(source), "--input"]
    args += [str(tmp_path / "day.csv"), "--output", str(tmp_path / "out")]
    args += ["--preprocess.valid_fraction=0", "--preprocess.test_fraction=0"]
    assert main(args) == 0, capsys.readouterr().err
    metadata = read_metadata(tmp_path / "out")
    assert (
        metadata["labels"] == [] and metadata["fingerprint"] == read_metadata(source)["fingerprint"]
    )
    table = pq.read_table(tmp_path / "out" / "train")
    assert table.column_names == ["price", "user", "item", "genres"]
    assert table.column("user").to_pylist() == expected_ids(
        day.column("user").to_pylist(), vocabulary["user"]
    )


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(categorical=["item"]), ValueError, r"categorical = \['item'\] conflicts with"),
        (dict(encoding="hash"), ValueError, r"encoding = 'hash' conflicts with .*'categorify'"),
        (dict(format="criteo"), ValueError, "was not preprocessed from the criteo format"),
        (dict(apply="/nonexistent"), FileNotFoundError, "is not a preprocessed dataset"),
    ],
)
def test_apply_refuses_conflicting_options(fitted, tmp_path, changes, error, message):
    pq.write_table(events(10, 5), tmp_path / "day.parquet")
    options = dict(
        apply=str(fitted[0]),
        format="parquet",
        input=str(tmp_path / "day.parquet"),
        output=str(tmp_path / "out"),
    )
    with pytest.raises(error, match=message):
        preprocess(PreprocessConfig(**{**options, **changes}))
    assert not (tmp_path / "out").exists()


def test_directories_from_before_fingerprints_still_read(fitted, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(fitted[0], old)
    metadata = json.loads((old / "metadata.json").read_text())
    for key in ("fingerprint", "dense_transform", "input"):
        del metadata[key]
    (old / "metadata.json").write_text(json.dumps(metadata))
    metadata = read_metadata(old)
    assert metadata["fingerprint"] == ""
    assert metadata["dense_transform"] == "missing -> 0, then log(1 + max(x, 0))"
    assert ParquetDataset(old).num_samples("train") == 400
