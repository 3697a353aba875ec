"""`recsys preprocess --preprocess.encoding=mlperf`: Criteo 1TB day files -> MLPerf DLRM-DCNv2's
multi-hot data, checked id for id against a direct reimplementation of the reference's steps
(TorchRec's ``tsv_to_npys`` and ``sparse_to_contiguous``, then mlcommons' ``Multihot`` tables
and ``materialize_synthetic_multihot_dataset.py``) on the same generated lines."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from recsys.config import PreprocessConfig
from recsys.config.sections import MLPERF_BAG_SIZES
from recsys.data.etl import preprocess, read_metadata
from recsys.data.etl_mlperf import FirstSeenIds, MultiHotTables
from recsys.data.parquet import ParquetDataset

# Small tables (most smaller than their column's distinct values: ids wrap as the reference's
# modulo makes them) with MLPerf's bag sizes, 1 to 100 ids.
# fmt: off
ROWS = [97, 39, 17, 74, 20, 3, 71, 15, 63, 400, 30, 40, 10, 22, 11, 15, 4, 97, 14, 400, 300,
        401, 59, 12, 10, 36]
# fmt: on


def _day(path, lines, seed, malformed=False):
    """A Criteo 1TB day file: label, 13 counts (some missing, some negative), 26 categories of
    8 hex digits drawn with a skew from a pool per column (some missing)."""
    rng = np.random.default_rng(seed)
    pools = [rng.integers(0, 2**32, size=int(n)) for n in rng.integers(2, 600, size=26)]
    rows = []
    for _ in range(lines):
        counts = ["" if rng.random() < 0.1 else str(int(rng.integers(-3, 5000))) for _ in range(13)]
        cats = [
            "" if rng.random() < 0.05 else f"{int(p[min(int(rng.zipf(1.2)), len(p)) - 1]):08x}"
            for p in pools
        ]
        rows.append("\t".join([str(int(rng.random() < 0.25)), *counts, *cats]))
    if malformed:
        rows.insert(5, "1\t2\tnot-enough-fields")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Train days 0, 2 and 10 (read in day order, not name order), then day 23 (valid)."""
    raw = tmp_path_factory.mktemp("criteo_1tb")
    (raw / "train").mkdir()
    train = [_day(raw / "train" / f"day_{d}", n, d) for d, n in [(0, 9000), (2, 700), (10, 1200)]]
    return train, _day(raw / "day_23", 1001, 23, malformed=True)


def _reference(files, rows, sizes, distribution="uniform"):
    """The reference's steps, as its code does them, on whole files in memory: per file
    (labels, dense float32, bags per feature)."""
    days = []
    for file in files:  # tsv_to_npys
        dense, sparse, labels = [], [], []
        for line in file.read_text().splitlines():
            row = line.split("\t")
            if len(row) != 40:
                continue  # recsys skips (and reports) malformed lines
            labels.append(int(row[0] or "0"))
            dense.append([int(row[i] or "0") for i in range(1, 14)])
            sparse.append([int(row[i] or "0", 16) for i in range(14, 40)])
        dense_np = np.array(dense, dtype=np.int32)
        dense_np -= dense_np.min() - 2
        days.append([np.array(labels), np.log(dense_np, dtype=np.float32), np.array(sparse)])
    for col in range(26):  # sparse_to_contiguous, frequency_threshold 0
        running_sum, contiguous = 2, {}
        for day in days:
            for i, value in enumerate(day[2][:, col]):
                if value not in contiguous:
                    contiguous[value] = running_sum
                    running_sum += 1
                day[2][i, col] = contiguous[value]
    np.random.seed(0)  # Multihot.__make_multi_hot_indices_tables
    tables = []
    for count, size in zip(rows, sizes, strict=True):
        ids = np.arange(count)[:, np.newaxis]
        if distribution == "uniform":
            drawn = np.random.randint(0, count, size=(count, size - 1))
        else:
            with np.errstate(invalid="ignore"):  # the reference's cast of doubles past 2^31
                drawn = np.random.pareto(a=0.25, size=(count, size - 1)).astype(np.int32) % count
        tables.append(torch.from_numpy(np.concatenate((ids, drawn), axis=-1)).int())
    out = []
    for labels, dense, sparse in days:  # materialize_synthetic_multihot_dataset.main
        bags = [
            torch.nn.functional.embedding(torch.from_numpy(sparse[:, j] % n), table).numpy()
            for j, (table, n) in enumerate(zip(tables, rows, strict=True))
        ]
        out.append((labels, dense, bags))
    return out, tables


def _split(output, split):
    files = read_metadata(output)["splits"][split]["files"]
    return pq.read_table([output / split / f for f in files]) if files else None


def test_day_files_give_the_references_multi_hot_ids_dense_values_and_splits(days, tmp_path):
    train, valid = days
    config = PreprocessConfig(
        format="criteo",
        input=str(train[0].parent),
        valid=str(valid),
        output=str(tmp_path / "out"),
        encoding="mlperf",
        mlperf_table_rows=ROWS,
        chunk_mb=1,  # day 0 is read in two pieces
        row_group_rows=1000,
    )
    report = preprocess(config)
    expected, _ = _reference([*train, valid], ROWS, MLPERF_BAG_SIZES)
    labels, dense, bags = expected[-1]
    half = math.ceil(len(labels) / 2)  # the reference's val / test cut of day 23
    splits = {
        "train": [
            np.concatenate([day[0] for day in expected[:-1]]),
            np.concatenate([day[1] for day in expected[:-1]]),
            [np.concatenate([day[2][j] for day in expected[:-1]]) for j in range(26)],
        ],
        "valid": [labels[:half], dense[:half], [b[:half] for b in bags]],
        "test": [labels[half:], dense[half:], [b[half:] for b in bags]],
    }
    assert report.rows == {s: len(v[0]) for s, v in splits.items()}
    assert report.malformed.count == 1
    for split, (labels, dense, bags) in splits.items():
        table = _split(report.output, split)
        assert np.array_equal(table.column("label").to_numpy(), labels.astype(np.float32))
        ours = np.column_stack([table.column(f"int_{i}").to_numpy() for i in range(13)])
        assert ours.dtype == np.float32 and np.array_equal(ours, dense)  # bitwise
        for j in range(26):
            column = table.column(f"cat_{j}").combine_chunks()
            flat = column.flatten().to_numpy().reshape(len(labels), MLPERF_BAG_SIZES[j])
            assert np.array_equal(flat, bags[j]), (split, j)
    metadata = read_metadata(report.output)
    assert [c["cardinality"] for c in metadata["categorical"]] == ROWS
    assert [c["bag_size"] for c in metadata["categorical"]] == list(MLPERF_BAG_SIZES)
    assert metadata["mlperf"]["distinct_values"][5] > ROWS[5]  # ids wrapped
    assert not (report.output / "_multi_hot_tables").exists()
    # training reads it: fixed-size bags, ids inside their tables
    data = ParquetDataset(report.output)
    batch = data.chunk("valid", 0)
    lengths = batch.sparse.lengths().view(26, -1)
    assert lengths.tolist() == [[size] * batch.batch_size for size in MLPERF_BAG_SIZES]


def test_the_same_days_in_other_pieces_give_the_same_data_and_fingerprint(days, tmp_path):
    train, valid = days
    common = dict(format="criteo", valid=str(valid), encoding="mlperf", mlperf_table_rows=ROWS)
    whole = preprocess(
        PreprocessConfig(
            input=str(train[0].parent), output=str(tmp_path / "a"), row_group_rows=4096, **common
        )
    )
    pieces = preprocess(
        PreprocessConfig(
            input=str(train[0].parent),
            output=str(tmp_path / "b"),
            chunk_mb=1,
            row_group_rows=777,
            **common,
        )
    )
    a, b = read_metadata(whole.output), read_metadata(pieces.output)
    assert a["fingerprint"] == b["fingerprint"]
    assert a["mlperf"]["vocabulary_sha256"] == b["mlperf"]["vocabulary_sha256"]
    for split in ("train", "valid", "test"):
        assert _split(whole.output, split).equals(_split(pieces.output, split))
    # other days number the values otherwise: another fingerprint
    other = preprocess(PreprocessConfig(input=str(train[1]), output=str(tmp_path / "c"), **common))
    assert read_metadata(other.output)["fingerprint"] != a["fingerprint"]


def test_with_a_test_file_each_file_is_its_whole_split(days, tmp_path):
    train, valid = days
    report = preprocess(
        PreprocessConfig(
            format="criteo",
            input=str(train[1]),
            valid=str(train[2]),
            test=str(valid),
            output=str(tmp_path / "out"),
            encoding="mlperf",
            mlperf_table_rows=ROWS,
        )
    )
    assert report.rows == {"train": 700, "valid": 1200, "test": 1001}


@pytest.mark.parametrize("distribution", ["uniform", "pareto"])
def test_lookup_tables_are_the_references_drawn_in_any_pieces(distribution, tmp_path):
    rows, sizes = [50, 7, 300, 3, 1000], [3, 1, 100, 2, 27]
    _, reference = _reference([], rows, sizes, distribution)
    for draw_values in (7, 1 << 20):
        tables = MultiHotTables(
            rows, sizes, distribution, tmp_path / str(draw_values), draw_values=draw_values
        )
        for j, table in enumerate(reference):
            ids = np.arange(rows[j])
            bags = tables.bags(j, ids).flatten().to_numpy().reshape(rows[j], sizes[j])
            assert np.array_equal(bags, table.numpy()), (j, draw_values)
        tables.remove()
        assert not (tmp_path / str(draw_values)).exists()


def test_first_seen_ids_number_values_in_order_of_first_appearance():
    rng = np.random.default_rng(0)
    ids, expected = FirstSeenIds(), {}
    for size in [1, 5, 200, 3, 1000, 17, 4000, 2, 300]:  # runs of many sizes, merged
        values = rng.zipf(1.3, size).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for value in values.tolist():
            expected.setdefault(value, len(expected) + 2)
        assert ids.ids(values).tolist() == [expected[v] for v in values.tolist()]
    assert len(ids) == len(expected)
    keys, numbers = ids.sorted_pairs()
    assert keys.tolist() == sorted(expected) and numbers.tolist() == [
        expected[k] for k in sorted(expected)
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(format="csv"), "format 'csv'"),
        (dict(valid=""), "no --valid file"),
        (dict(mlperf_table_rows=[10] * 25), "mlperf_table_rows has 25 values, expected 26"),
        (dict(mlperf_bag_sizes=[0] * 26), "mlperf_bag_sizes = [0, 0"),
        (dict(normalize_dense=True), "normalize_dense = true"),
    ],
)
def test_bad_options_are_one_line_before_anything_is_read(days, tmp_path, options, message):
    train, valid = days
    config = dict(
        format="criteo",
        input=str(train[1]),
        valid=str(valid),
        encoding="mlperf",
        output=str(tmp_path / "out"),
    )
    if options.get("format") == "csv":
        config.update(categorical=["cat_0"], label=["label"])
    with pytest.raises(ValueError, match="encoding = 'mlperf' cannot run") as error:
        preprocess(PreprocessConfig(**{**config, **options}))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_lookup_tables_larger_than_the_free_disk_are_refused_before_drawing(
    days, tmp_path, monkeypatch
):
    import shutil

    from recsys.data import etl_mlperf

    train, valid = days
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(etl_mlperf.shutil, "disk_usage", lambda _: usage._replace(free=10**6))
    with pytest.raises(ValueError, match=r"need 23\.1 GB of disk .* has 0\.0 GB free"):
        preprocess(
            PreprocessConfig(
                format="criteo",
                input=str(train[1]),
                valid=str(valid),
                output=str(tmp_path / "out"),
                encoding="mlperf",
            )
        )
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_day_file_without_a_valid_line_adds_nothing(days, tmp_path):
    train, valid = days
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "day_0").write_text(train[1].read_text())
    bad_hex = "\t".join(["1", *["5"] * 13, *["zz"] * 26])  # every field there, none valid
    (tmp_path / "train" / "day_1").write_text(f"{bad_hex}\n{bad_hex}\n")
    common = dict(format="criteo", valid=str(valid), encoding="mlperf", mlperf_table_rows=ROWS)
    report = preprocess(
        PreprocessConfig(input=str(tmp_path / "train"), output=str(tmp_path / "a"), **common)
    )
    alone = preprocess(PreprocessConfig(input=str(train[1]), output=str(tmp_path / "b"), **common))
    assert report.rows == alone.rows and report.malformed.count == alone.malformed.count + 2
    assert _split(report.output, "train").equals(_split(alone.output, "train"))
