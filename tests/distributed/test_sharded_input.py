"""The input check of a sharded collection: a bad batch on one rank raises on every rank, at
the counts exchange (no host read of its own), before any id moves or any table changes; the
next good batch trains as if the bad one had never come."""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import Adagrad
from recsys.ops.input_checks import INPUT_ERRORS
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import FEATURES, configs, make_plan, random_kjt


def _bad_batch_on_one_rank(rank: int, world: int, mode: str) -> None:
    torch.manual_seed(0)
    plans = make_plan(["tw", "rw", "cw", "dp"], world)

    def build(weighted: bool) -> ShardedEmbeddingBagCollection:
        module = EmbeddingBagCollection(
            configs(), is_weighted=weighted, optimizer=Adagrad(lr=0.1), validate=mode
        )
        return ShardedEmbeddingBagCollection(module, plans)

    sharded = build(False)
    before = local_state(sharded)
    good = random_kjt(10 + rank, 3, FEATURES, weighted=False)
    bad_values = good.values().clone()
    bad_values[-1] = 99  # out of range for every table
    bad = KeyedJaggedTensor(keys=FEATURES, values=bad_values, lengths=good.lengths())
    with pytest.raises(ValueError) as raised:
        sharded(bad if rank == 1 else good).values().sum().backward()
    if rank == 1:
        assert "id 99 is out of range" in str(raised.value)
    else:
        assert "the batch of rank 1 failed its input check" in str(raised.value)
    INPUT_ERRORS.raise_first()  # nothing left recorded
    assert _equal(local_state(sharded), before)  # no table changed
    # The ranks are still in step: the next good batch trains.
    sharded(good).values().sum().backward()
    assert not _equal(local_state(sharded), before)
    # A per-sample weight that is not finite, on rank 0 this time.
    weighted = build(True)
    kjt = random_kjt(20 + rank, 3, FEATURES, weighted=True)
    weights = kjt.weights().clone()
    if rank == 0:
        weights[0] = float("nan")
    kjt = KeyedJaggedTensor(
        keys=FEATURES, values=kjt.values(), lengths=kjt.lengths(), weights=weights
    )
    with pytest.raises(ValueError, match="not finite|the batch of rank 0"):
        weighted(kjt)


def local_state(sharded: ShardedEmbeddingBagCollection) -> dict[str, list[torch.Tensor]]:
    """This rank's part of every state entry (its local shards of a sharded one)."""
    out = {}
    for key, value in sharded.state_dict().items():
        parts = (
            [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        )
        out[key] = [p.clone() for p in parts]
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)) for k in a
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bad_batch_on_one_rank_raises_on_every_rank_and_changes_nothing(mode):
    run_ranks(2, _bad_batch_on_one_rank, mode)
