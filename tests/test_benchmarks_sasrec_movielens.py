"""The data side of benchmarks/sasrec_movielens.py on tiny synthetic logs: the log read out of a
wheel, its CSV for ``recsys preprocess``, the export of a recsys split to RecBole's atomic files,
and the peer's ranking against recsys' definition (no RecBole needed)."""

from __future__ import annotations

import zipfile

import pyarrow.parquet as pq
import pytest
import torch

from benchmarks._movielens import LogSource, export_recbole, find_log, write_interactions_csv
from benchmarks._sasrec_recbole import metrics_from_ranks
from benchmarks._sasrec_recbole import target_ranks as peer_ranks
from recsys.config import PreprocessConfig
from recsys.data.sequences import preprocess_interactions
from recsys.train.ranking_metrics import RankingMetrics, target_ranks

INTER = (
    "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    "u1\tm5\t3\t10\nu2\tm7\t4\t1\nu1\tm6\t5\t12\nu1\tm7\t1\t11\nu1\tm5\t2\t13\n"
    "u1\tm8\t2\t14\nu1\tm9\t2\t15\nu2\tm5\t4\t2\nu2\tm6\t4\t3\nu2\tm5\t4\t4\nu3\tm6\t1\t5\n"
)


def test_the_log_is_read_out_of_a_wheel_and_written_as_a_csv(tmp_path):
    source = LogSource("tiny", "pkg==1", "pkg/data/tiny.inter", len(INTER))
    wheel = tmp_path / "pkg-1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(source.member, INTER)
    data = find_log(source, wheel, None)
    assert data == INTER.encode()
    assert write_interactions_csv(data, tmp_path / "log.csv") == 11
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[:3] == ["user,item,time", "u1,m5,10", "u2,m7,1"]
    with pytest.raises(SystemExit, match="holds no other/file.inter"):
        find_log(LogSource("x", "pkg==1", "other/file.inter", 0), wheel, None)
    with pytest.raises(ValueError, match="lacks one of the columns"):
        write_interactions_csv(b"user_id:token\titem_id:token\n1\t2\n", tmp_path / "bad.csv")


def test_the_export_holds_exactly_the_pairs_and_rows_of_the_recsys_split(tmp_path):
    write_interactions_csv(INTER.encode(), tmp_path / "log.csv")
    config = PreprocessConfig(
        format="interactions",
        input=str(tmp_path / "log.csv"),
        output=str(tmp_path / "split"),
        user="user",
        item="item",
        time="time",
        max_len=3,
    )
    metadata = preprocess_interactions(config).metadata
    num_items = metadata["sequence"]["num_items"]
    counts = export_recbole(tmp_path / "split", tmp_path / "atomic", "t", num_items)
    categories = pq.read_table(tmp_path / "split" / "categories" / "items.parquet").to_pydict()
    name = dict(zip(map(str, categories["id"]), categories["item"], strict=True)) | {"2": "rare"}

    def read(split):
        lines = (tmp_path / "atomic" / "t" / f"t.{split}.inter").read_text().splitlines()
        assert lines[0] == "user_id:token\titem_id_list:token_seq\titem_id:token"
        rows = [line.split("\t") for line in lines[1:]]
        return sorted((u, [name[i] for i in h.split()], name[t]) for u, h, t in rows)

    # u1 by time: m5 m7 m6 m5 m8 m9 -> train m5 m7 m6 m5, kept: the last max_len + 1 = 4;
    # u2: m7 m5 m6 m5 -> train m7 m5; u3 (one event): nothing to predict.
    assert read("train") == [
        ("u1", ["m5"], "m7"),
        ("u1", ["m5", "m7"], "m6"),
        ("u1", ["m5", "m7", "m6"], "m5"),
        ("u2", ["m7"], "m5"),
    ]
    # m8 and m9 were never trained on: the rare id 2, as recsys ranks them (a miss).
    assert read("valid") == [("u1", ["m7", "m6", "m5"], "rare"), ("u2", ["m7", "m5"], "m6")]
    assert read("test") == [("u1", ["m6", "m5", "rare"], "rare"), ("u2", ["m7", "m5", "m6"], "m5")]
    assert counts == {"train": 4, "valid": 2, "test": 2}
    items = (tmp_path / "atomic" / "t" / "t.item").read_text().splitlines()
    assert items == ["item_id:token"] + [str(i) for i in range(3, num_items)]
    assert sorted(name[i] for i in items[1:]) == ["m5", "m6", "m7"]


def test_the_peer_ranks_by_the_definition_of_recsys_ranking_metrics():
    generator = torch.Generator().manual_seed(0)
    batch, num_items, dim, first = 64, 40, 4, 3
    queries = torch.randint(-2, 3, (batch, dim), generator=generator).double()  # many ties
    items = torch.randint(-2, 3, (num_items, dim), generator=generator).double()
    targets = torch.randint(first, num_items, (batch,), generator=generator)
    targets[:3] = torch.tensor([0, 2, first])  # reserved targets are misses
    ours = target_ranks(queries, items, targets, first_item=first)
    theirs = peer_ranks(queries @ items.t(), targets, torch.arange(first, num_items))
    assert torch.equal(ours, theirs)
    assert (ours[:2] == -1).all() and (ours[2:] >= 0).all()
    metrics = RankingMetrics(ks=(10,), first_item=first)
    metrics.update(queries, items, targets)
    expected = metrics.compute()
    got = metrics_from_ranks(theirs.tolist())
    assert got == pytest.approx({k: expected[k] for k in ("hr@10", "ndcg@10", "mrr")})
    assert 0 < got["hr@10"] < 1
