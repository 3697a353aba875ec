"""recsys preprocess --format interactions: per-user histories, leave-one-out, streaming."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from recsys.cli import main
from recsys.config import PreprocessConfig
from recsys.data.keys import value_keys
from recsys.data.prepared import read_metadata
from recsys.data.sequences import preprocess_interactions
from recsys.data.synthetic_sequences import SyntheticSequences, generate_log, oracle_metrics

LOG = """user,item,ts
u1,a,3
u1,b,1
u1,c,2
u1,d,4
u2,a,1
u2,b,1
u3,x,
u3,a,5
u4,b,7
u4,a,8
u4,c,9
"""


def _config(tmp_path: Path, source: Path, **options) -> PreprocessConfig:
    base = dict(
        format="interactions",
        input=str(source),
        output=str(tmp_path / "out"),
        user="user",
        item="item",
        time="ts",
    )
    return PreprocessConfig(**(base | options))


def _rows(output: Path, split: str) -> list[dict]:
    files = sorted((output / split).glob("part_*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return sorted(rows, key=lambda r: r["user"])


def test_a_small_log_becomes_leave_one_out_histories(tmp_path: Path) -> None:
    source = tmp_path / "log.csv"
    source.write_text(LOG)
    report = preprocess_interactions(_config(tmp_path, source, max_len=2))
    out = report.output
    # Train counts: b 3 (u1, u2, u4), a 2 (u2, u3), c 1 (u1): ids b=3, a=4, c=5; d is test only.
    b, a, c, rare = 3, 4, 5, 2
    assert _rows(out, "train") == [
        {"user": "u1", "items": [b, c], "times": [1.0, 2.0]},
        {"user": "u2", "items": [a, b], "times": [1.0, 1.0]},  # a tie: input order
    ]
    assert _rows(out, "valid") == [
        {"user": "u1", "items": [b, c], "times": [1.0, 2.0], "target": a, "target_time": 3.0},
        {"user": "u4", "items": [b], "times": [7.0], "target": a, "target_time": 8.0},
    ]
    assert _rows(out, "test") == [  # max_len 2: the last two events before the target
        {"user": "u1", "items": [c, a], "times": [2.0, 3.0], "target": rare, "target_time": 4.0},
        {"user": "u4", "items": [b, a], "times": [7.0, 8.0], "target": c, "target_time": 9.0},
    ]
    categories = pq.read_table(out / "categories" / "items.parquet").to_pylist()
    assert [(r["id"], r["item"], r["count"]) for r in categories] == [
        (3, "b", 3),
        (4, "a", 2),
        (5, "c", 1),
    ]
    assert report.rows == {"train": 2, "valid": 2, "test": 2}
    assert report.malformed.count == 1
    assert report.malformed.examples[0].startswith(f"{source}:8: time not a finite number")
    metadata = read_metadata(out)
    assert metadata["kind"] == "sequences"
    assert metadata["sequence"]["num_items"] == 6
    assert metadata["input"]["users_without_train_row"] == 2  # u3 (1 event), u4 (1 train event)
    fingerprint = metadata["fingerprint"].encode()
    for split in ("train", "valid", "test"):
        for name in metadata["splits"][split]["files"]:
            schema = pq.read_schema(out / split / name)
            assert schema.metadata[b"recsys.preprocess"] == fingerprint


def test_whole_histories_and_the_item_universe_of_the_log(tmp_path: Path) -> None:
    source = tmp_path / "log.csv"
    source.write_text(LOG)
    report = preprocess_interactions(_config(tmp_path, source, item_universe="log"))
    out = report.output
    # Counts over the whole log: b 3, a 4, c 2, d 1 (u1's test target): a=3, b=4, c=5, d=6.
    a, b, c, d = 3, 4, 5, 6
    assert _rows(out, "test") == [  # max_len 0: every event before the target
        {
            "user": "u1",
            "items": [b, c, a],
            "times": [1.0, 2.0, 3.0],
            "target": d,
            "target_time": 4.0,
        },
        {"user": "u4", "items": [b, a], "times": [7.0, 8.0], "target": c, "target_time": 9.0},
    ]
    metadata = read_metadata(out)
    assert metadata["sequence"]["num_items"] == 7 and metadata["sequence"]["max_len"] == 0
    assert metadata["preprocess"]["item_universe"] == "log"
    with pytest.raises(ValueError, match="item_universe = 'log'.*encoding = 'hash'"):
        preprocess_interactions(
            _config(tmp_path, source, item_universe="log", encoding="hash", overwrite=True)
        )


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_an_item_catalog_is_the_item_universe(tmp_path: Path, suffix: str) -> None:
    source = tmp_path / "log.csv"
    source.write_text(LOG)
    catalog = tmp_path / f"catalog.{suffix}"
    items = pa.table({"item": ["c", "z", "a", "d", "c"]})  # z: never logged; b: not listed
    if suffix == "csv":
        pcsv.write_csv(items, catalog)
    else:
        pq.write_table(items, catalog)
    options = dict(item_universe="catalog", item_catalog=str(catalog))
    out = preprocess_interactions(_config(tmp_path, source, **options)).output
    # Train counts of the catalog's items: a 2, c 1, d 0, z 0 (ties by raw key); b is rare.
    categories = pq.read_table(out / "categories" / "items.parquet").to_pylist()
    assert [(r["item"], r["count"]) for r in categories][:2] == [("a", 2), ("c", 1)]
    assert sorted(r["item"] for r in categories[2:]) == ["d", "z"]
    d = 3 + [r["item"] for r in categories].index("d")
    metadata = read_metadata(out)
    assert metadata["sequence"]["num_items"] == 7
    assert metadata["input"]["rare_train_events"] == 3  # b's 3 train events
    test = {r["user"]: r for r in _rows(out, "test")}
    assert test["u1"]["target"] == d and test["u1"]["items"] == [2, 4, 3]  # b is rare
    bad = dict(overwrite=True, item_universe="catalog")
    with pytest.raises(ValueError, match="a catalog file goes with item_universe = 'catalog'"):
        preprocess_interactions(_config(tmp_path, source, **bad))
    with pytest.raises(FileNotFoundError, match="item_catalog not found: '.*nowhere.csv'"):
        preprocess_interactions(_config(tmp_path, source, **bad, item_catalog="nowhere.csv"))
    pq.write_table(pa.table({"movie": ["a"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="has no column 'item'.*\\['movie'\\]"):
        preprocess_interactions(
            _config(tmp_path, source, **bad, item_catalog=str(tmp_path / "other.parquet"))
        )


def _reference(events: list[tuple[str, str, float]], max_len: int) -> tuple[dict, set]:
    """Leave-one-out from the definition, in plain Python, on raw item texts; and the items of
    the train parts (before truncation), which the vocabulary holds."""
    by_user = defaultdict(list)
    for position, (user, item, t) in enumerate(events):
        by_user[user].append((t, position, item))
    splits, vocabulary = {"train": [], "valid": [], "test": []}, set()
    for user, seq in by_user.items():
        items = [item for _, _, item in sorted(seq)]
        times = [t for t, _, _ in sorted(seq)]
        n = len(items)
        train_end = n - 2 if n >= 3 else n
        vocabulary.update(items[:train_end])
        if train_end >= 2:
            first = max(0, train_end - max_len - 1)
            splits["train"].append((user, items[first:train_end], times[first:train_end]))
        if n >= 3:
            for split, end in (("valid", n - 2), ("test", n - 1)):
                first = max(0, end - max_len)
                row = (user, items[first:end], times[first:end], items[end], times[end])
                splits[split].append(row)
    return {split: sorted(rows) for split, rows in splits.items()}, vocabulary


def _random_events(count: int, seed: int) -> list[tuple[str, str, float]]:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, count // 20, size=count)
    items = np.minimum(rng.zipf(1.3, size=count), 5000)
    times = rng.integers(0, 50, size=count)  # many ties
    return [(f"user{u}", f"it{i}", float(t)) for u, i, t in zip(users, items, times, strict=True)]


def _decoded(output: Path, split: str) -> list[tuple]:
    categories = pq.read_table(output / "categories" / "items.parquet")
    text = dict(zip(categories["id"].to_pylist(), categories["item"].to_pylist(), strict=True))
    rows = []
    for r in _rows(output, split):
        items = [text.get(i, "<rare>") for i in r["items"]]
        row = (r["user"], items, r["times"])
        if "target" in r:
            row += (text.get(r["target"], "<rare>"), r["target_time"])
        rows.append(row)
    return sorted(rows)


def test_streaming_in_buckets_matches_the_definition(tmp_path: Path) -> None:
    """A log of ~2.8 MB read in 1 MB pieces (several buckets) gives the same histories as the
    plain-Python definition (items outside the train parts read as rare)."""
    events = _random_events(160_000, seed=1)
    source = tmp_path / "log.csv"
    with source.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["user", "item", "ts"])
        writer.writerows((u, i, int(t)) for u, i, t in events)
    assert source.stat().st_size > 2 * 2**20
    report = preprocess_interactions(_config(tmp_path, source, max_len=7, chunk_mb=1))
    buckets = len(report.metadata["splits"]["train"]["files"])
    assert buckets >= 3
    expected, seen = _reference(events, max_len=7)
    for split in ("train", "valid", "test"):
        want = [
            (r[0], [i if i in seen else "<rare>" for i in r[1]], r[2])
            + ((r[3] if r[3] in seen else "<rare>", r[4]) if len(r) > 3 else ())
            for r in expected[split]
        ]
        assert _decoded(report.output, split) == sorted(want), split


def test_parquet_timestamps_int_ids_and_raw_and_hash_encodings(tmp_path: Path) -> None:
    times = pa.array([3, 1, 2, 4], pa.timestamp("s"))
    table = pa.table({"user": [7, 7, 7, 7], "item": [10, 11, 12, 13], "ts": times})
    source = tmp_path / "log.parquet"
    pq.write_table(table, source)
    raw = preprocess_interactions(_config(tmp_path, source, encoding="raw"))
    keys = value_keys(pa.array([11, 12, 10, 13])).tolist()  # time order: 11, 12, 10, 13
    assert _rows(raw.output, "test") == [
        {"user": "7", "items": keys[:3], "times": [1.0, 2.0, 3.0], "target": keys[3],
         "target_time": 4.0}
    ]  # fmt: skip
    assert read_metadata(raw.output)["id_encoding"] == "raw"
    assert not (raw.output / "categories").exists()
    hashed = preprocess_interactions(
        _config(tmp_path, source, encoding="hash", hash_buckets=97, overwrite=True)
    )
    assert _rows(hashed.output, "test")[0]["items"] == [k % 97 for k in keys[:3]]
    assert read_metadata(hashed.output)["sequence"]["num_items"] == 97


def test_bad_input_and_options_get_clear_errors(tmp_path: Path) -> None:
    source = tmp_path / "log.csv"
    source.write_text(LOG)
    with pytest.raises(ValueError, match=r"log.csv: line 8: time not a finite number"):
        preprocess_interactions(_config(tmp_path, source, strict=True))
    with pytest.raises(ValueError, match=r"no column\(s\) \['itm'\]"):
        preprocess_interactions(_config(tmp_path, source, item="itm"))
    with pytest.raises(ValueError, match="needs the time column"):
        preprocess_interactions(_config(tmp_path, source, time=""))
    with pytest.raises(ValueError, match="preprocess.label do not apply"):
        preprocess_interactions(_config(tmp_path, source, label=["y"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to replace"):
        preprocess_interactions(_config(tmp_path, source))
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"
    empty = tmp_path / "empty.csv"
    empty.write_text("user,item,ts\n,a,1\n")
    with pytest.raises(ValueError, match="no usable interaction"):
        preprocess_interactions(_config(tmp_path, empty, output=str(tmp_path / "o2")))
    assert not (tmp_path / "o2").exists()


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "log.csv"
    source.write_text(LOG)
    argv = ["preprocess", "--format", "interactions", "--input", str(source), "--output"]
    argv += [str(tmp_path / "out"), "--user", "user", "--item", "item", "--time", "ts"]
    assert main([*argv, "--max-len", "2"]) == 0
    printed = capsys.readouterr().out
    assert "10 interactions of 4 users" in printed
    assert "users train 2, valid 2, test 2; 6 item ids (categorify), max_len 2" in printed
    assert read_metadata(tmp_path / "out")["sequence"]["max_len"] == 2


def test_synthetic_log_and_its_oracle(tmp_path: Path) -> None:
    params = SyntheticSequences(num_users=300, num_items=200, num_topics=10, seed=3)
    table, truth = generate_log(params)
    again, _ = generate_log(params)
    assert table.equals(again)
    assert table.num_rows == int(truth.lengths.sum())
    frame = table.to_pandas()
    assert (frame.groupby("user")["time"].apply(lambda t: t.is_monotonic_increasing)).all()
    metrics = oracle_metrics(params, truth)
    assert 0 < metrics["hr@10"] < metrics["hr@50"] <= 1
    assert 0 < metrics["ndcg@10"] <= metrics["hr@10"]
    # The oracle beats ranking by popularity: top-10 items of the whole log.
    popular = frame["item"].value_counts().index[:10]
    last = frame.groupby("user").tail(1)
    assert metrics["hr@10"] > last["item"].isin(popular).mean()
    with pytest.raises(ValueError, match="num_items >= num_topics"):
        SyntheticSequences(num_items=5, num_topics=10)
    source = tmp_path / "syn.parquet"
    pq.write_table(table, source)
    report = preprocess_interactions(_config(tmp_path, source, time="time"))
    assert report.rows["test"] == int((truth.lengths >= 3).sum())
    assert math.isclose(report.metadata["input"]["interactions"], table.num_rows)
