"""Full-corpus ranking metrics against a brute-force reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys.train.ranking_metrics import RankingMetrics, target_ranks
from tests.distributed.spawn import run_ranks


def _reference_ranks(queries, items, targets, first_item, history) -> list[int]:
    """From the definition, one user at a time, in numpy float64."""
    scores = queries.double().numpy() @ items.double().numpy().T
    ranks = []
    for b, t in enumerate(targets.tolist()):
        if t < first_item:
            ranks.append(-1)
            continue
        excluded = set(history[b]) - {t} if history is not None else set()
        others = [i for i in range(first_item, items.shape[0]) if i != t and i not in excluded]
        ranks.append(int(sum(scores[b, i] >= scores[b, t] for i in others)))
    return ranks


def _case(seed: int, batch: int = 9, num_items: int = 37, dim: int = 5):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, dim, generator=g)
    items = torch.randn(num_items, dim, generator=g)
    targets = torch.randint(0, num_items, (batch,), generator=g)
    lengths = torch.randint(0, 6, (batch,), generator=g)
    values = torch.randint(0, num_items, (int(lengths.sum()),), generator=g)
    values[:1] = targets[0]  # a target inside its own history
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    history = [values[offsets[b] : offsets[b + 1]].tolist() for b in range(batch)]
    return queries, items, targets, (values, offsets), history


@pytest.mark.parametrize("chunk_items", [1, 7, 1000])
@pytest.mark.parametrize("first_item", [0, 3])
@pytest.mark.parametrize("with_history", [False, True])
def test_ranks_match_the_definition(chunk_items, first_item, with_history):
    queries, items, targets, exclude, history = _case(seed=chunk_items + first_item)
    ranks = target_ranks(
        queries,
        items,
        targets,
        first_item=first_item,
        exclude=exclude if with_history else None,
        chunk_items=chunk_items,
    )
    want = _reference_ranks(queries, items, targets, first_item, history if with_history else None)
    assert ranks.tolist() == want


@pytest.mark.parametrize("with_history", [False, True])
def test_ranks_over_keys_are_the_ranks_of_their_rows(with_history):
    """A dynamic table's corpus: row i is key keys[i]; a target it lacks is a miss and history
    items it lacks exclude nothing."""
    queries, items, targets, exclude, history = _case(seed=11)
    generator = torch.Generator().manual_seed(2)
    keys = torch.randint(-(2**40), 2**40, (100,), generator=generator).unique()[:37]
    assert len(keys) == 37
    targets[1] = 36
    absent = keys.max() + 1
    values, offsets = exclude
    keyed_values = keys[values]
    keyed_values[-1:] = absent  # a history item outside the corpus
    keyed_targets = keys[targets]
    keyed_targets[1] = absent  # a held-out item the table lacks
    ranks = target_ranks(
        queries,
        items,
        keyed_targets,
        exclude=(keyed_values, offsets) if with_history else None,
        chunk_items=7,
        keys=keys,
    )
    last = int(torch.searchsorted(offsets, len(values) - 1, right=True)) - 1
    history[last] = history[last][:-1]  # its last item is not in the corpus: excludes nothing
    want = _reference_ranks(queries, items, targets, 0, history if with_history else None)
    want[1] = -1
    assert ranks.tolist() == want
    empty = target_ranks(queries, items[:0], keyed_targets, keys=keys[:0])
    assert empty.tolist() == [-1] * len(targets)


def test_ties_count_against_the_target():
    """A model that scores every item alike ranks each target last."""
    queries, items = torch.ones(4, 3), torch.ones(20, 3)
    ranks = target_ranks(queries, items, torch.tensor([3, 5, 19, 0]), first_item=3)
    assert ranks.tolist() == [16, 16, 16, -1]  # 17 candidates, the other 16 ahead; 0 reserved
    metrics = RankingMetrics(ks=(10,), first_item=3)
    metrics.update(queries, items, torch.tensor([3, 5, 19, 0]))
    out = metrics.compute()
    assert out["hr@10"] == 0.0 and out["mrr"] == pytest.approx(3 / 17 / 4)


def test_metrics_from_known_ranks():
    # Item scores q . e_i = i for q = [1]: the target t has rank (N - 1 - t).
    items = torch.arange(100, dtype=torch.float32)[:, None]
    queries = torch.ones(5, 1)
    targets = torch.tensor([99, 98, 90, 60, 0])  # ranks 0, 1, 9, 39, 99
    metrics = RankingMetrics(ks=(10, 50))
    metrics.update(queries[:2], items, targets[:2])
    metrics.update(queries[2:], items, targets[2:])  # accumulates over batches
    out = metrics.compute()
    ranks = np.array([0, 1, 9, 39, 99])
    assert out["hr@10"] == pytest.approx(3 / 5)
    assert out["hr@50"] == pytest.approx(4 / 5)
    ndcg10 = sum(1 / math.log2(r + 2) for r in ranks if r < 10) / 5
    assert out["ndcg@10"] == pytest.approx(ndcg10)
    assert out["mrr"] == pytest.approx(float(np.mean(1 / (ranks + 1))))


def test_bad_arguments_are_named():
    items, queries = torch.zeros(10, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"target ids span \[3, 12\]; the item table has 10 rows"):
        target_ranks(queries, items, torch.tensor([3, 12]))
    with pytest.raises(ValueError, match="same D"):
        target_ranks(torch.zeros(2, 3), items, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="expected one per query"):
        target_ranks(queries, items, torch.tensor([1]))
    with pytest.raises(ValueError, match="cut-offs >= 1"):
        RankingMetrics(ks=(0,))
    with pytest.raises(ValueError, match="no users"):
        RankingMetrics().compute()


def _two_ranks(rank: int, world_size: int) -> None:
    queries, items, targets, exclude, _ = _case(seed=5, batch=8)
    whole = RankingMetrics(first_item=2)
    whole.update(queries, items, targets, exclude)
    values, offsets = exclude
    half = slice(rank * 4, rank * 4 + 4)
    lo, hi = int(offsets[half.start]), int(offsets[half.stop])
    mine = (values[lo:hi], offsets[half.start : half.stop + 1] - lo)
    split = RankingMetrics(first_item=2)
    split.update(queries[half], items, targets[half], mine)
    got = split.compute()  # sums the two halves over the ranks
    assert whole._sums is not None
    want = whole._sums.tolist()  # this rank's sums over all 8 users, before any reduction
    assert got["mrr"] == pytest.approx(want[-2] / want[-1])
    assert got["hr@10"] == pytest.approx(want[0] / want[-1])
    assert got["ndcg@50"] == pytest.approx(want[3] / want[-1])


def test_ranks_share_their_users_under_torch_distributed():
    run_ranks(2, _two_ranks)
