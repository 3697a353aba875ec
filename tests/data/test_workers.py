import multiprocessing
import time

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.data.batch import Batch, gather_batches
from recsys.data.workers import WorkerPool, pack_batches, shared_empty, unpack_batches


def weighted_batch(num_rows: int, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * num_rows,), dtype=torch.int32, generator=generator)
    total = int(lengths.sum())
    return Batch(
        dense=torch.randn(num_rows, 3, generator=generator),
        sparse=KeyedJaggedTensor(
            keys=["a", "b"],
            values=torch.randint(0, 100, (total,), generator=generator),
            lengths=lengths,
            weights=torch.rand(total, generator=generator),
        ),
        labels=torch.randint(0, 2, (num_rows, 2), generator=generator).float(),
    )


def assert_same(expected: Batch, actual: Batch) -> None:
    want, got = expected.sparse, actual.sparse
    for a, b in [
        (expected.dense, actual.dense),
        (expected.labels, actual.labels),
        (want.values(), got.values()),
        (want.weights(), got.weights()),
        (want.lengths(), got.lengths()),
        (want.offsets(), got.offsets()),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got.keys() == want.keys() and got.stride() == want.stride()
    assert got.length_per_key() == want.length_per_key()
    assert got.offset_per_key() == want.offset_per_key()


def test_pack_copies_private_tensors_and_unpack_restores_every_field():
    built = [(3, weighted_batch(5, seed=1).with_offsets()), (4, weighted_batch(2, seed=2))]
    buffers, layout = pack_batches(built)
    assert len(buffers) == 1 and buffers[0].is_shared()  # one copy for all of them
    for (index, batch), (got_index, got) in zip(
        built, unpack_batches((buffers, layout)), strict=True
    ):
        assert got_index == index
        assert_same(batch, got)
        assert got.dense.data_ptr() % 64 == 0 and got.sparse.values().data_ptr() % 64 == 0


def test_pack_sends_shared_tensors_in_place():
    source = weighted_batch(9)
    built = list(enumerate(gather_batches(source, torch.arange(9), [4, 5], shared_empty)))
    buffers, layout = pack_batches(built)
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    # Every tensor of every batch is in one of the buffers sent: nothing was copied.
    for _, batch in built:
        kjt = batch.sparse
        for t in (batch.dense, batch.labels, kjt.values(), kjt.weights(), kjt.lengths()):
            assert t.untyped_storage().data_ptr() in storages
    for (_, batch), (_, got) in zip(built, unpack_batches((buffers, layout)), strict=True):
        assert_same(batch, got)


def test_gather_batches_cuts_taken_rows_into_batches_with_their_offsets():
    source = weighted_batch(11)
    rows = torch.tensor([10, 0, 3, 3, 7, 1, 9])
    pieces = gather_batches(source, rows, [3, 1, 3])
    assert [len(p) for p in pieces] == [3, 1, 3]
    assert_same(source.take(rows[:3]).with_offsets(), pieces[0])
    assert_same(source.take(rows[3:4]).with_offsets(), pieces[1])
    assert_same(source.take(rows[4:]).with_offsets(), pieces[2])
    with pytest.raises(ValueError, match=r"batch sizes \[3, 3\] do not cut 7 rows"):
        gather_batches(source, rows, [3, 3])


def test_pool_hands_results_back_in_task_order():
    def build(task: int):
        time.sleep(0.05 * (task % 3 == 0))  # workers finish out of order
        return [(task, weighted_batch(2, seed=task))]

    pool = WorkerPool(build, num_tasks=7, num_workers=3, ahead=3)
    try:
        got = [built for built in pool.results()]
    finally:
        pool.close()
    assert [built[0][0] for built in got] == list(range(7))
    for task, built in enumerate(got):
        assert_same(weighted_batch(2, seed=task), built[0][1])
    assert not [p for p in multiprocessing.active_children() if "batch-worker" in p.name]
