"""An epoch resumed on another number of ranks or batch size trains every sample of the epoch at
most once and continues exactly after the last trained one (recsys.data.layout)."""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys.data.batch import Batch, DatasetSpec
from recsys.data.layout import DataPosition, Reshard, reshard_line
from recsys.data.loader import BatchLoader

# Uneven chunks (a last short one, like a dataset's tail): 2,797 rows in 11 chunks.
CHUNK_ROWS = [300, 300, 300, 250, 300, 300, 120, 300, 300, 300, 27]


class NumberedRows:
    """A chunked dataset whose every row carries its own number (dense value and id)."""

    spec = DatasetSpec(("n",), ("id",), (sum(CHUNK_ROWS),), ("label",))

    def num_chunks(self, split: str) -> int:
        return len(CHUNK_ROWS)

    def chunk_rows(self, split: str, index: int) -> int:
        return CHUNK_ROWS[index]

    def chunk(self, split: str, index: int) -> Batch:
        first = sum(CHUNK_ROWS[:index])
        numbers = torch.arange(first, first + CHUNK_ROWS[index])
        return Batch(
            dense=numbers.float()[:, None],
            sparse=KeyedJaggedTensor(
                keys=["id"], values=numbers, lengths=torch.ones(len(numbers), dtype=torch.int32)
            ),
            labels=torch.zeros(len(numbers), 1),
        )


DATA = NumberedRows()


def loader(world_size, batch_size, rank, position=None, shuffle=True):
    position = position or DataPosition(1)
    return BatchLoader(
        DATA,
        "train",
        batch_size,
        shuffle=shuffle,
        seed=7,
        epoch=position.epoch,
        drop_last=True,
        rank=rank,
        world_size=world_size,
        shuffle_buffer_chunks=2,
        start_batch=position.batch,
        reshards=position.reshards,
    )


def numbers(batch: Batch) -> list[int]:
    assert torch.equal(batch.dense[:, 0].long(), batch.sparse.values())  # rows kept whole
    return batch.sparse.values().tolist()


def train(world_size, batch_size, position, num_batches=None, shuffle=True):
    """Every rank of ``world_size`` x ``batch_size`` trains ``num_batches`` batches (None: to
    the epoch's end) from ``position``; per rank, the row numbers trained, in order."""
    trained = []
    for rank in range(world_size):
        rows = []
        for index, batch in enumerate(loader(world_size, batch_size, rank, position, shuffle)):
            if index == num_batches:
                break
            assert batch.batch_size == batch_size
            rows += numbers(batch)
        trained.append(rows)
    return trained


def in_rank_order(trained: list[list[int]]) -> list[int]:
    return [number for rows in trained for number in rows]


def dropped_by_drop_last(world_size, batch_size, shuffle=True) -> int:
    """Rows an epoch read from its start on this shape leaves untrained."""
    first = loader(world_size, batch_size, 0, shuffle=shuffle)
    return sum(CHUNK_ROWS) - world_size * first.num_batches * batch_size


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 64, 20), (2, 64, None)],  # 1 -> 2 ranks
        [(2, 64, 9), (1, 64, None)],  # 2 -> 1
        [(2, 48, 11), (3, 32, None)],  # 2 -> 3 ranks with another batch size
        [(1, 64, 20), (2, 64, 7), (1, 64, None)],  # 1 -> 2 -> 1
        [(3, 40, 5), (2, 100, 0), (1, 33, 13), (2, 64, None)],  # a reshard with 0 batches done
    ],
)
def test_a_resumed_epoch_trains_every_sample_once_but_the_documented_drops(shapes, shuffle):
    """Train ``k`` batches on each (ranks, batch size, k) in turn, each resuming the last: the
    rows after a reshard are rows the previous layout had not trained yet, and over the epoch no
    row is trained twice and every untrained row is one of the documented drops (drop_last of
    the first layout; at each reshard, fewer than ranks x batch size, from the saved layout's
    last rows)."""
    position = DataPosition(1)
    saved_shape = None
    everything: list[int] = []
    dropped = dropped_by_drop_last(*shapes[0][:2], shuffle=shuffle)
    for world_size, batch_size, num_batches in shapes:
        if saved_shape is not None:
            # what the saved layout still had to train, had it gone on
            pending = in_rank_order(train(*saved_shape, position, shuffle=shuffle))
            position = position.continued(world_size, batch_size, *saved_shape)
            layout = loader(world_size, batch_size, 0, position, shuffle).layout
            assert layout.rows_left == len(pending)
            assert layout.rows_dropped < world_size * batch_size
            resumed = in_rank_order(train(world_size, batch_size, position, shuffle=shuffle))
            assert set(resumed) <= set(pending)  # after the last trained row
            assert len(pending) - len(resumed) == layout.rows_dropped
            if saved_shape[0] == 1:  # one stream: its last rows are the ones dropped
                assert set(pending) - set(resumed) == set(pending[len(resumed) :])
            dropped += layout.rows_dropped
        trained = train(world_size, batch_size, position, num_batches, shuffle)
        everything += in_rank_order(trained)
        done = len(trained[0]) // batch_size
        position = DataPosition(position.epoch, position.batch + done, position.reshards)
        saved_shape = (world_size, batch_size)
    assert len(everything) == len(set(everything))  # no row twice
    assert len(everything) + dropped == sum(CHUNK_ROWS)  # every row but the dropped ones


def test_ranks_resumed_in_order_read_the_rest_side_by_side():
    """Unshuffled (a stream of days, say), rows are numbered in reading order: after a reshard
    the ranks go through the rest of the epoch together, each in order, never one rank on the
    epoch's end while another is on its middle."""
    position = DataPosition(1, 0, (Reshard(1, 64, 20),))
    trained = [list(loader(2, 64, rank, position, shuffle=False)) for rank in range(2)]
    for rank in trained:
        assert in_rank_order([numbers(b) for b in rank]) == sorted(
            in_rank_order([numbers(b) for b in rank])
        )
    for batches in zip(*trained, strict=True):  # one step of both ranks
        rows = [n for batch in batches for n in numbers(batch)]
        assert max(rows) - min(rows) < 2 * max(CHUNK_ROWS), (min(rows), max(rows))


def test_same_shape_resume_reads_what_an_uninterrupted_run_reads():
    position = DataPosition(1).continued(2, 64, 2, 64)
    assert position == DataPosition(1)  # no reshard: the saved position as it is
    whole = train(2, 64, DataPosition(1))
    first = train(2, 64, DataPosition(1), 5)
    rest = train(2, 64, DataPosition(1, 5))
    assert [a + b for a, b in zip(first, rest, strict=True)] == whole


def test_a_reshard_reads_only_the_buffers_it_needs():
    """Each new rank reads the buffers of its own rows (a buffer cut by the reshard: by the
    ranks on either side of the cut), never every chunk."""
    position = DataPosition(1, 0, (Reshard(1, 64, 20),))
    read = [set(loader(2, 64, rank, position).chunks) for rank in range(2)]
    fresh, start, needed = loader(1, 64, 0), 0, set()
    for segment in fresh.segments:  # whole buffers, in order
        if start + segment.num_rows > 20 * 64 and start < 43 * 64:  # rows not yet trained
            needed |= set(segment.chunks)
        start += segment.num_rows
    assert read[0] | read[1] == needed
    assert len(needed) < len(CHUNK_ROWS)
    assert len(read[0] & read[1]) <= 2  # at most the buffer cut to even the ranks out


def test_reshard_line_says_what_is_trained_and_dropped():
    position = DataPosition(1, 0, (Reshard(1, 64, 20),))
    layout = loader(2, 100, 0, position).layout
    assert layout.rows_left == (2797 // 64 - 20) * 64 == 1472
    assert layout.num_batches == (7, 7) and layout.rows_dropped == 1472 - 1400
    line = reshard_line(layout, 1, position.reshards[-1], recorded=False)
    assert line.startswith(
        "resuming epoch 1 on 2 rank(s) x batch 100 (saved on 1 x 64 after 20 batches): the "
        "1,472 samples of this epoch not yet trained, in 7 batches per rank; the last 72 of "
        "them (fewer than 2 x 100) are dropped (the checkpoint records no earlier reshard"
    )


def test_reshard_errors_name_the_values():
    with pytest.raises(ValueError, match=r"44 batches done outside \[0, 43\]"):
        loader(2, 64, 0, DataPosition(1, 0, (Reshard(1, 64, 44),)))
    with pytest.raises(ValueError, match="reshards need drop_last"):
        BatchLoader(DATA, "train", 8, reshards=[Reshard(1, 8, 1)])
