"""`recsys preprocess --preprocess.encoding=raw`: stable 64-bit keys in one pass, no vocabulary."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys.config import PreprocessConfig
from recsys.data import criteo
from recsys.data.batch import DatasetSpec
from recsys.data.etl import preprocess, read_metadata
from recsys.data.keys import value_keys
from recsys.data.loader import BatchLoader
from recsys.data.parquet import ParquetDataset, table_to_batch

from .conftest import TRAIN_ROWS
from .test_criteo import line, write


def _raw(tmp_path, name, **options):
    defaults = dict(encoding="raw", output=str(tmp_path / name), row_group_rows=1000)
    return preprocess(PreprocessConfig(**{**defaults, **options}))


def _split_keys(output, split, column):
    files = sorted((output / split).glob("*.parquet"))
    return np.concatenate([pq.read_table(f, columns=[column]).column(0).to_numpy() for f in files])


def test_raw_criteo_keys_are_stable_across_runs_and_chunk_sizes(synthetic_criteo_log, tmp_path):
    big = _raw(tmp_path, "a", input=str(synthetic_criteo_log), chunk_mb=64)
    small = _raw(tmp_path, "b", input=str(synthetic_criteo_log), chunk_mb=1)
    assert big.rows == small.rows and sum(big.rows.values()) == TRAIN_ROWS
    assert big.malformed.count == 2
    metadata = read_metadata(big.output)
    assert metadata["id_encoding"] == "raw"
    assert metadata["fingerprint"] == read_metadata(small.output)["fingerprint"]
    assert [c["cardinality"] for c in metadata["categorical"]] == [0] * 26
    assert not (big.output / "workflow").exists()  # nothing fitted
    for split in ("train", "valid", "test"):
        for column in ("cat_0", "cat_13", "int_3", "label"):
            assert np.array_equal(
                _split_keys(big.output, split, column), _split_keys(small.output, split, column)
            )
    # every key is the hash of the lowercase hex text; missing values get key 0
    texts = pa.concat_tables(list(criteo.read_criteo(synthetic_criteo_log))).column("cat_5")
    all_keys = np.concatenate(
        [_split_keys(big.output, s, "cat_5") for s in ("train", "valid", "test")]
    )
    assert np.array_equal(np.sort(all_keys), np.sort(value_keys(texts)))
    groups = [
        pq.ParquetFile(f).metadata.row_group(g).num_rows
        for f in sorted((big.output / "train").glob("*.parquet"))
        for g in range(pq.ParquetFile(f).num_row_groups)
    ]
    assert set(groups[:-1]) == {1000} and 0 < groups[-1] <= 1000


def test_raw_keys_match_values_and_dense_transform(tmp_path):
    cats = lambda first: [first, *["aa"] * 25]  # noqa: E731
    rows = [
        line("1", ["5", "", "-7", *["0"] * 10], cats("0000000F")),
        line("0", ["0", *["1"] * 12], cats("0000000f")),
        line("1", ["99", *["1"] * 12], cats("0000000e")),
        line("0", ["3", *["1"] * 12], cats("")),
    ]
    path = write(tmp_path / "day_0.tsv", rows)
    out = _raw(tmp_path, "out", input=str(path), valid=str(path), test=str(path)).output
    data = ParquetDataset(out)
    batch = data.chunk("train", 0)
    keys = batch.sparse["cat_0"].values().tolist()
    assert keys[0] == keys[1] != keys[2] and keys[3] == 0  # hex is case-insensitive; missing: 0
    assert keys[2] == value_keys(pa.array(["0000000e"]))[0]
    assert len(set(batch.sparse["cat_1"].values().tolist())) == 1
    np.testing.assert_allclose(
        batch.dense[:2, :3].numpy(),
        np.sign([[5, 0, -7], [0, 1, 1]]) * np.log1p([[5, 0, 7], [0, 1, 1]]),
        rtol=1e-6,
    )
    assert batch.labels[:, 0].tolist() == [1, 0, 1, 0]


def test_raw_parquet_multi_hot_and_loader(tmp_path):
    rng = np.random.default_rng(0)
    n = 3000
    user = rng.integers(0, 10**12, n)  # far past any table: a raw id
    tags = [[f"t{v}" for v in rng.integers(0, 50, rng.integers(0, 4))] for _ in range(n)]
    tags[3] = None
    tags[4] = ["t1", None, "t2"]
    table = pa.table(
        {
            "user": pa.array(user),
            "city": pa.array([None if i % 7 == 0 else f"c{i % 5}" for i in range(n)]),
            "tags": pa.array(tags, pa.list_(pa.string())),
            "age": pa.array(rng.uniform(-5, 80, n)),
            "click": pa.array(rng.integers(0, 2, n)),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    common = dict(
        format="parquet",
        categorical=["user", "city"],
        multi_hot=["tags"],
        dense=["age"],
        label=["click"],
        valid_fraction=0.1,
        test_fraction=0.1,
    )
    report = _raw(tmp_path, "out", input=str(tmp_path / "in.parquet"), **common)
    data = ParquetDataset(report.output, validate=True)
    assert data.spec.id_encoding == "raw" and data.spec.cardinalities == (0, 0, 0)
    distinct = {c["name"]: c["distinct_estimate"] for c in report.metadata["categorical"]}
    assert distinct["city"] == 5 and 0.95 < distinct["user"] / (0.8 * n) < 1.05
    assert report.stats.null_bags["tags"] == 1 and report.stats.null_bag_items["tags"] == 1
    loaded = list(BatchLoader(data, "train", 256))
    users = torch.cat([b.sparse["user"].values() for b in loaded])
    assert users.dtype == torch.int64
    assert np.array_equal(users.numpy(), _split_keys(report.output, "train", "user"))
    # the keys are the values' hashes, rows in input order: the parquet int is its decimal text
    train_rows = report.rows["train"]
    assert set(users.tolist()) <= set(value_keys(pa.array(user)).tolist())
    bags = torch.cat([b.sparse["tags"].values() for b in loaded])
    lengths = torch.cat([b.sparse["tags"].lengths() for b in loaded])
    assert int(lengths.sum()) == len(bags) and len(lengths) == train_rows
    assert set(bags.tolist()) <= set(value_keys(pa.array([f"t{v}" for v in range(50)])).tolist())


def test_raw_csv_apply_and_errors(tmp_path):
    csv = tmp_path / "in.csv"
    csv.write_text("click,item,tags,price\n1,12,a|b,3\n0,13,,\n1,12,b,-2\n0,,a||c,1\n")
    common = dict(format="csv", categorical=["item"], multi_hot=["tags"], dense=["price"])
    report = _raw(
        tmp_path, "out", input=str(csv), valid=str(csv), test=str(csv), label=["click"], **common
    )
    batch = ParquetDataset(report.output).chunk("train", 0)
    items = batch.sparse["item"].values().tolist()
    assert items[0] == items[2] == value_keys(pa.array([12]))[0] and items[3] == 0
    assert batch.sparse["tags"].lengths().tolist() == [2, 0, 1, 2]
    # apply: nothing fitted, the same hashing on new (unlabeled) data, the same fingerprint
    new = tmp_path / "new.csv"
    new.write_text("item,tags,price\n12,b,1\n99,,\n")
    applied = preprocess(
        PreprocessConfig(
            apply=str(report.output),
            format="csv",
            input=str(new),
            output=str(tmp_path / "applied"),
            valid_fraction=0,
            test_fraction=0,
        )
    )
    metadata = json.loads((applied.output / "metadata.json").read_text())
    assert metadata["fingerprint"] == report.metadata["fingerprint"]
    assert metadata["id_encoding"] == "raw" and metadata["labels"] == []
    scored = pq.read_table(applied.output / "train" / "part_000000.parquet")
    assert scored.column("item").to_pylist()[0] == items[0]
    assert scored.column("tags").to_pylist()[0] == [batch.sparse["tags"].values().tolist()[1]]
    with pytest.raises(ValueError, match="normalize_dense = true needs a fitting pass"):
        _raw(tmp_path, "bad", input=str(csv), label=["click"], normalize_dense=True, **common)


def test_table_to_batch_checks_ranges_of_index_ids_only():
    table = pa.table({"x": [1.0, 2.0], "c": pa.array([5, -(2**62)], pa.int64()), "y": [0.0, 1.0]})
    raw = DatasetSpec(("x",), ("c",), (0,), ("y",), id_encoding="raw")
    batch = table_to_batch(table, raw, set(), validate=True)
    assert batch.sparse.values().tolist() == [5, -(2**62)]
    with pytest.raises(ValueError, match="outside its table of 10 rows"):
        table_to_batch(table, DatasetSpec(("x",), ("c",), (10,), ("y",)), set(), "t")
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        table_to_batch(table.set_column(2, "y", pa.array([0.0, 3.0])), raw, set())


def test_spec_id_encoding_round_trips_and_old_specs_load():
    spec = DatasetSpec(("x",), ("c",), (0,), ("y",), "f" * 64, id_encoding="raw")
    fields = json.loads(json.dumps(spec.__dict__))
    assert DatasetSpec.from_json(fields) == spec
    old = {"dense_names": ["x"], "sparse_names": ["c"], "cardinalities": [4], "label_names": ["y"]}
    assert DatasetSpec.from_json(old).id_encoding == "index"
    with pytest.raises(ValueError, match="id_encoding = 'hashed'; expected one of index, raw"):
        DatasetSpec(("x",), ("c",), (4,), ("y",), id_encoding="hashed")
    with pytest.raises(ValueError, match="every cardinality must be 0"):
        DatasetSpec(("x",), ("c",), (4,), ("y",), id_encoding="raw")


def test_raw_ids_carve_the_same_rows_as_a_vocabulary(
    synthetic_criteo_log, criteo_dataset_dir, tmp_path
):
    """The splits are drawn per input row, whatever the encoding: the same file gives the same
    rows (and labels, in order) in each split with raw keys as with a fitted vocabulary."""
    raw = _raw(
        tmp_path, "raw", input=str(synthetic_criteo_log), valid_fraction=0.1, test_fraction=0.1
    )
    assert raw.rows == criteo_dataset_dir.rows
    for split in ("train", "valid", "test"):
        labels = _split_keys(criteo_dataset_dir.output, split, "label")
        assert np.array_equal(_split_keys(raw.output, split, "label"), labels)


def test_the_guides_quote_the_same_rows_for_both_encodings_of_one_file():
    """The guides preprocess data/raw/day_0.txt twice (a vocabulary, then raw keys): by the
    test above, both runs print the same rows per split."""
    guides = Path(__file__).parents[2] / "docs" / "guides"
    readme = "\n".join((guides / page).read_text() for page in ("data.md", "dynamic-tables.md"))
    rows = {
        line.split(" in ")[0]: line.split(": rows ")[1]
        for line in readme.splitlines()
        if line.startswith("recsys: preprocessed into data/day_0")
    }
    assert set(rows) == {
        "recsys: preprocessed into data/day_0",
        "recsys: preprocessed into data/day_0_raw",
    }
    assert len(set(rows.values())) == 1, rows
