import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.config import SyntheticConfig
from recsys.data.batch import Batch
from recsys.data.loader import BatchLoader
from recsys.data.synthetic import CHUNK_SIZE, SyntheticDataset


@pytest.fixture(scope="module")
def data() -> SyntheticDataset:
    return SyntheticDataset(
        SyntheticConfig(
            cardinalities=[100, 30, 5000],
            bag_sizes=[1, 3, 2],
            num_train_samples=3 * CHUNK_SIZE + 1000,
            num_valid_samples=1500,
            num_test_samples=100,
        ),
        seed=0,
    )


def weighted_batch(num_rows: int) -> Batch:
    lengths = torch.randint(0, 4, (2 * num_rows,), dtype=torch.int32)
    total = int(lengths.sum())
    return Batch(
        dense=torch.randn(num_rows, 3),
        sparse=KeyedJaggedTensor(
            keys=["a", "b"],
            values=torch.randint(0, 100, (total,)),
            lengths=lengths,
            weights=torch.rand(total),
        ),
        labels=torch.randint(0, 2, (num_rows, 1)).float(),
    )


def rows(*batches: Batch) -> list[tuple]:
    """Every sample of the batches, in order, as a hashable tuple (dense values + bags)."""
    out = []
    for batch in batches:
        bags = batch.sparse.to_dict()
        for i in range(batch.batch_size):
            sample = [tuple(batch.dense[i].tolist())]
            for bag in bags.values():
                sample.append(tuple(bag.values()[bag.offsets()[i] : bag.offsets()[i + 1]].tolist()))
            out.append(tuple(sample))
    return out


def test_slice_then_concat_is_identity():
    batch = weighted_batch(37)
    parts = [batch.slice(0, 10), batch.slice(10, 11), batch.slice(11, 11), batch.slice(11, 37)]
    joined = Batch.concat(parts)
    assert rows(joined) == rows(batch)
    assert torch.equal(joined.sparse.values(), batch.sparse.values())
    assert torch.equal(joined.sparse.weights(), batch.sparse.weights())
    assert torch.equal(joined.labels, batch.labels)


def test_concat_rejects_mismatched_keys():
    other = weighted_batch(3)
    other.sparse = KeyedJaggedTensor(
        keys=["b", "a"],
        values=other.sparse.values(),
        lengths=other.sparse.lengths(),
        weights=other.sparse.weights(),
    )
    with pytest.raises(ValueError, match="cannot concat"):
        Batch.concat([weighted_batch(3), other])


def test_eval_epoch_covers_every_row_once_in_order(data):
    expected = rows(data.chunk("valid", 0))
    batches = list(BatchLoader(data, "valid", 400))
    assert [b.batch_size for b in batches] == [400, 400, 400, 300]
    assert rows(*batches) == expected


def test_train_batches_cross_chunk_boundaries(data):
    loader = BatchLoader(data, "train", 3000, drop_last=True)
    batches = list(loader)
    assert len(loader) == len(batches) == (3 * CHUNK_SIZE + 1000) // 3000
    assert all(b.batch_size == 3000 for b in batches)
    everything = Batch.concat([data.chunk("train", i) for i in range(4)])
    assert rows(*batches) == rows(everything)[: 3000 * len(batches)]


def test_shuffle_changes_chunk_order_per_epoch_deterministically(data):
    def first_rows(epoch: int, seed: int = 0):
        batch = next(iter(BatchLoader(data, "train", 64, shuffle=True, seed=seed, epoch=epoch)))
        return batch.dense

    orders = {tuple(first_rows(e)[0].tolist()) for e in range(6)}
    assert len(orders) > 1
    assert torch.equal(first_rows(2), first_rows(2))


def test_ranks_get_disjoint_rows_and_equal_batch_counts(data):
    loaders = [
        BatchLoader(data, "train", 1000, shuffle=True, drop_last=True, rank=r, world_size=3)
        for r in range(3)
    ]
    counts = {len(loader) for loader in loaders}
    assert len(counts) == 1  # DDP never waits on a rank that ran out
    seen = [set(rows(b)) for loader in loaders for b in loader]
    union = set().union(*seen)
    assert len(union) == sum(len(s) for s in seen)


def test_prefetch_yields_the_same_batches(data):
    plain = list(BatchLoader(data, "valid", 333))
    ahead = list(BatchLoader(data, "valid", 333, prefetch=2))
    assert [rows(b) for b in plain] == [rows(b) for b in ahead]


def test_prefetch_forwards_worker_errors(data):
    class Broken:
        spec = data.spec

        def num_chunks(self, split):
            return 2

        def chunk_rows(self, split, index):
            return 10

        def chunk(self, split, index):
            if index == 1:
                raise RuntimeError("disk on fire")
            return data.chunk("test", 0).slice(0, 10)

    with pytest.raises(RuntimeError, match="disk on fire"):
        list(BatchLoader(Broken(), "test", 4, prefetch=2))


def test_bad_arguments(data):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchLoader(data, "train", 0)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        BatchLoader(data, "train", 8, rank=2, world_size=2)


def test_take_gathers_rows_with_their_bags():
    batch = weighted_batch(9)
    order = torch.tensor([8, 0, 3, 3, 5])
    taken = batch.take(order)
    assert rows(taken) == [rows(batch)[i] for i in order.tolist()]
    assert torch.equal(taken.labels, batch.labels[order])
    kept = batch.take(torch.arange(9))
    assert torch.equal(kept.sparse.weights(), batch.sparse.weights())
