import multiprocessing
import os
import time

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

import recsys.data.loader as loader_module
from recsys.config import SyntheticConfig
from recsys.data.batch import Batch
from recsys.data.layout import Reshard
from recsys.data.loader import BatchLoader, default_workers
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
    with pytest.raises(ValueError, match=r"workers must be -1 \(auto\) or >= 0, got -2"):
        BatchLoader(data, "train", 8, workers=-2)


def test_take_gathers_rows_with_their_bags():
    batch = weighted_batch(9)
    order = torch.tensor([8, 0, 3, 3, 5])
    taken = batch.take(order)
    assert rows(taken) == [rows(batch)[i] for i in order.tolist()]
    assert torch.equal(taken.labels, batch.labels[order])
    kept = batch.take(torch.arange(9))
    assert torch.equal(kept.sparse.weights(), batch.sparse.weights())


def test_take_gathers_blocks_of_fixed_width_keys_and_ragged_keys():
    # Keys with every bag of 1, 2 and 0 ids (gathered as blocks) beside a ragged one.
    num_rows = 7
    lengths = torch.cat(
        [
            torch.ones(num_rows, dtype=torch.int32),
            torch.full((num_rows,), 2, dtype=torch.int32),
            torch.zeros(num_rows, dtype=torch.int32),
            torch.tensor([0, 3, 1, 0, 2, 5, 1], dtype=torch.int32),
        ]
    )
    total = int(lengths.sum())
    batch = Batch(
        dense=torch.randn(num_rows, 2),
        sparse=KeyedJaggedTensor(
            keys=["one", "two", "none", "ragged"],
            values=torch.randperm(total),
            lengths=lengths,
            weights=torch.rand(total),
        ),
        labels=torch.rand(num_rows, 1),
    )
    order = torch.tensor([6, 1, 1, 0, 5, 3])
    taken = batch.take(order)
    expected_values, expected_weights, expected_lengths = [], [], []
    for bag in batch.sparse.to_dict().values():
        offsets = bag.offsets()
        for i in order.tolist():
            expected_values.append(bag.values()[offsets[i] : offsets[i + 1]])
            expected_weights.append(bag.weights()[offsets[i] : offsets[i + 1]])
            expected_lengths.append(int(bag.lengths()[i]))
    assert taken.sparse.keys() == batch.sparse.keys()
    assert torch.equal(taken.sparse.values(), torch.cat(expected_values))
    assert torch.equal(taken.sparse.weights(), torch.cat(expected_weights))
    assert taken.sparse.lengths().tolist() == expected_lengths
    assert taken.sparse.lengths().dtype == torch.int32
    assert torch.equal(taken.dense, batch.dense[order])
    assert len(batch.take(torch.tensor([], dtype=torch.long))) == 0


def assert_same_batches(expected: list[Batch], actual: list[Batch]) -> None:
    """Bitwise the same batches: dense, labels, KJT keys, values, lengths, offsets, dtypes."""
    assert len(actual) == len(expected)
    for want, got in zip(expected, actual, strict=True):
        assert got.sparse.keys() == want.sparse.keys()
        pairs = [
            (want.dense, got.dense),
            (want.labels, got.labels),
            (want.sparse.values(), got.sparse.values()),
            (want.sparse.lengths(), got.sparse.lengths()),
            (want.sparse.offsets(), got.sparse.offsets()),
        ]
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_shuffled_epoch_is_each_buffer_permuted_then_cut(data):
    # The order a shuffled epoch has always had, rebuilt from its definition: the chunk order
    # permuted with (seed, epoch), every 2 chunks a buffer permuted with (seed, epoch, buffer, 1),
    # the buffers' rows cut into batches. Any loader path must keep it.
    seed, epoch, batch_size = 7, 3, 1500
    chunk_order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(4)
    buffers = []
    for b, first in enumerate(range(0, 4, 2)):
        rows_ = Batch.concat([data.chunk("train", int(c)) for c in chunk_order[first : first + 2]])
        perm = np.random.default_rng(np.random.SeedSequence([seed, epoch, b, 1])).permutation(
            len(rows_)
        )
        buffers.append(rows_.take(torch.from_numpy(perm)))
    epoch_rows = Batch.concat(buffers)
    count = len(epoch_rows) // batch_size
    expected = [
        epoch_rows.slice(i * batch_size, (i + 1) * batch_size).with_offsets() for i in range(count)
    ]
    for workers in (0, 2):
        loader = BatchLoader(
            data,
            "train",
            batch_size,
            shuffle=True,
            seed=seed,
            epoch=epoch,
            drop_last=True,
            shuffle_buffer_chunks=2,
            workers=workers,
        )
        assert_same_batches(expected, list(loader))


@pytest.mark.parametrize(
    "options",
    [
        dict(batch_size=1000, shuffle=True, drop_last=True),
        dict(batch_size=3000, shuffle=False, drop_last=True),
        dict(batch_size=700, shuffle=True, drop_last=True, start_batch=9),
        dict(batch_size=800, shuffle=True, drop_last=True, world_size=2, rank=1, start_batch=2),
        dict(
            batch_size=600,
            shuffle=True,
            drop_last=True,
            world_size=2,
            rank=0,
            start_batch=1,
            reshards=(Reshard(1, 2000, 5),),
        ),
        dict(batch_size=4096, shuffle=False, drop_last=False, world_size=2, rank=1),
    ],
)
def test_workers_yield_the_plain_loops_batches(data, options):
    plain = list(BatchLoader(data, "train", shuffle_buffer_chunks=2, seed=1, **options))
    for workers, prefetch in [(1, 0), (2, 3)]:
        ahead = BatchLoader(
            data,
            "train",
            shuffle_buffer_chunks=2,
            seed=1,
            workers=workers,
            prefetch=prefetch,
            **options,
        )
        assert_same_batches(plain, list(ahead))


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_carry_their_kjt_offsets(data, workers, monkeypatch):
    loader = BatchLoader(data, "train", 1000, shuffle=True, drop_last=True, workers=workers)
    batches = list(loader)
    fresh = [
        KeyedJaggedTensor(
            keys=b.sparse.keys(), values=b.sparse.values(), lengths=b.sparse.lengths()
        )
        for b in batches
    ]

    def no_host_read(self, *args, **kwargs):
        raise AssertionError("a KJT field was computed from a tensor instead of carried")

    # What a step asks of its KJT; computing any of it would read a tensor back (on a device:
    # a sync). Batch.to keeps these fields, so they reach the device with the batch.
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    carried = [
        (
            b.sparse.length_per_key(),
            b.sparse.offset_per_key(),
            b.sparse.offsets(),
            b.sparse.stride(),
        )
        for b in batches
    ]
    monkeypatch.undo()
    for (length_per_key, offset_per_key, offsets, stride), kjt in zip(carried, fresh, strict=True):
        assert length_per_key == kjt.length_per_key()
        assert offset_per_key == kjt.offset_per_key()
        assert torch.equal(offsets, kjt.offsets()) and stride == kjt.stride()


class BrokenData:
    """Two chunks of 10 rows; chunk 1 fails as ``failure`` says."""

    def __init__(self, data: SyntheticDataset, failure: str) -> None:
        self.spec = data.spec
        self.good = data.chunk("test", 0).slice(0, 10)
        self.failure = failure

    def num_chunks(self, split):
        return 2

    def chunk_rows(self, split, index):
        return 10

    def chunk(self, split, index):
        if index == 1 and self.failure == "raise":
            raise ValueError("disk on fire in chunk 1")
        if index == 1 and self.failure == "die":
            os._exit(3)
        return self.good


def test_worker_errors_reach_the_caller_with_their_message(data):
    loader = BatchLoader(BrokenData(data, "raise"), "test", 4, workers=1)
    with pytest.raises(ValueError, match="disk on fire in chunk 1") as raised:
        list(loader)
    assert any("batch loader worker" in note for note in raised.value.__notes__)
    loader = BatchLoader(BrokenData(data, "die"), "test", 4, workers=2)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        list(loader)
    assert not worker_processes()


def worker_processes() -> list:
    return [p for p in multiprocessing.active_children() if "batch-worker" in p.name]


def test_workers_stop_on_early_break_and_errors(data):
    start = time.perf_counter()
    for _ in BatchLoader(data, "train", 500, shuffle=True, drop_last=True, workers=2):
        assert len(worker_processes()) == 2
        break
    assert not worker_processes()
    with pytest.raises(KeyError, match="the step failed"):
        for _ in BatchLoader(data, "train", 500, shuffle=True, workers=2, prefetch=2):
            raise KeyError("the step failed")
    assert not worker_processes()
    iterator = iter(BatchLoader(data, "train", 500, workers=1))
    next(iterator)
    iterator.close()  # an abandoned loop (the pipeline closes its loader like this)
    assert not worker_processes()
    assert time.perf_counter() - start < 30.0


def test_default_workers(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cpus, world_size, expected in [
        (2, 1, 1),
        (2, 2, 0),
        (1, 1, 0),
        (16, 1, 8),
        (64, 1, 8),
        (16, 4, 2),
    ]:
        monkeypatch.setattr(loader_module, "usable_cpus", lambda cpus=cpus: cpus)
        assert default_workers(world_size) == expected, (cpus, world_size)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: the ranks of this machine
    assert default_workers(8) == 4
