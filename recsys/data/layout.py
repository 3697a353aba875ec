"""The layout of an epoch: which rows each rank reads, in which order, kept as a short list of
segments per rank, so that a run resumed on another number of ranks or with another batch size
continues exactly after the last row it trained.

Fresh, the chunks of an epoch are put in an order (a permutation seeded with (seed, epoch) when
shuffling) and rank r of W reads the chunks r, r + W, r + 2W, ... of it. Every ``buffer_chunks``
consecutive chunks of a rank's list form a shuffle buffer whose rows are permuted together (the
buffer's index in that list is its permutation key). A :class:`Segment` is a row range
[start, end) of one buffer's permuted rows, and a rank's epoch is the concatenation of its
segments: fresh, one whole buffer each. Batches are cut from it in order. With drop_last every
rank trains the same number n of full batches (the fewest rows of any rank // batch_size); the
rows past them are dropped from the epoch.

A reshard after k batches of b continues the epoch on W' ranks with batches of b'. The rows the
W ranks would still have trained (each rank's rows [k b, n b)) are put in the order they would
have trained them (by step, then rank, at segment granularity); the fewer than W' b' last ones,
which cannot fill a batch on every rank, are dropped, as drop_last drops rows at the end of every
epoch; the rest are dealt out segment by segment, each to the rank with the fewest rows so far
(as a fresh epoch deals chunks round-robin), and evened out to n' b' rows per rank,
n' = rows left // (W' b'): a rank's rows past n' b' go, earliest first, to the ranks short of
it. So every row of the epoch is trained at most once, whatever the shapes, and the new ranks go
through the rest of the epoch side by side (an unshuffled stream of days stays roughly in day
order). Reshards compose: an epoch's layout is a function of its chunk order and sizes, its
fresh shape and its list of :class:`Reshard` (each the shape left and the batches done in it),
all small. The bookkeeping is per segment, never per row: a reshard cuts at most W + 2 W'
segments, and a buffer cut in parts is read (whole) by each rank that holds one of them.

A run's :class:`DataPosition` is (epoch, batches done in the epoch's current layout, the epoch's
reshards); the next epoch starts fresh in the current shape.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of one shuffle buffer: the rows of ``chunks`` (in this order),
    permuted with the buffer's key ``buffer`` (its index in its rank's fresh list) when
    shuffling."""

    buffer: int
    chunks: tuple[int, ...]
    start: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


class Reshard(NamedTuple):
    """A layout an epoch was left in: its shape (ranks x batch size) and the batches every rank
    had trained in it."""

    world_size: int
    batch_size: int
    batches_done: int


@dataclass(frozen=True)
class EpochLayout:
    """Every rank's rows of one epoch.

    Attributes:
        streams: per rank, its segments in reading order.
        batch_size: rows per batch.
        num_batches: per rank, the batches it yields (with drop_last all equal).
        rows_left: at the last reshard, the rows of the epoch not yet trained (0: fresh).
        rows_dropped: at the last reshard, the rows of those past the last full batch.
    """

    streams: tuple[tuple[Segment, ...], ...]
    batch_size: int
    num_batches: tuple[int, ...]
    rows_left: int = 0
    rows_dropped: int = 0

    @property
    def world_size(self) -> int:
        return len(self.streams)


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its training data: ``epoch``, ``batch`` (batches every rank trained in
    the epoch's current layout) and ``reshards`` (the layouts the epoch was read in before).

    Example::

        saved = DataPosition(epoch=0, batch=20)  # saved on 1 rank x 512
        position = saved.continued(world_size=2, batch_size=512, saved_world_size=1,
                                   saved_batch_size=512)
        # DataPosition(epoch=0, batch=0, reshards=(Reshard(1, 512, 20),))
    """

    epoch: int = 0
    batch: int = 0
    reshards: tuple[Reshard, ...] = ()

    def continued(
        self, world_size: int, batch_size: int, saved_world_size: int, saved_batch_size: int
    ) -> DataPosition:
        """This position (saved by a run of ``saved_world_size`` x ``saved_batch_size``)
        continued by a run of ``world_size`` x ``batch_size``: the same position for the same
        shape, else a reshard at the batches done."""
        if (world_size, batch_size) == (saved_world_size, saved_batch_size):
            return self
        left = Reshard(saved_world_size, saved_batch_size, self.batch)
        return DataPosition(self.epoch, 0, (*self.reshards, left))


def fresh_layout(
    order: Sequence[int],
    chunk_rows: Sequence[int],
    world_size: int,
    batch_size: int,
    *,
    buffer_chunks: int = 1,
    drop_last: bool = True,
) -> EpochLayout:
    """The layout of an epoch read from its start: rank r reads ``order[r::world_size]`` in
    buffers of ``buffer_chunks`` chunks (``chunk_rows[c]``: the rows of chunk c)."""
    streams = []
    for rank in range(world_size):
        chunks = [int(c) for c in order[rank::world_size]]
        stream = []
        for buffer, first in enumerate(range(0, len(chunks), buffer_chunks)):
            group = tuple(chunks[first : first + buffer_chunks])
            stream.append(Segment(buffer, group, 0, sum(chunk_rows[c] for c in group)))
        streams.append(tuple(stream))
    rows = [num_rows(stream) for stream in streams]
    if drop_last:
        num_batches = (min(rows) // batch_size,) * world_size
    else:
        num_batches = tuple(-(-r // batch_size) for r in rows)
    return EpochLayout(tuple(streams), batch_size, num_batches)


def reshard(
    layout: EpochLayout, batches_done: int, world_size: int, batch_size: int
) -> EpochLayout:
    """``layout`` left after ``batches_done`` batches on every rank, continued on
    ``world_size`` ranks with batches of ``batch_size`` (see the module docstring).

    Raises:
        ValueError: ``batches_done`` outside [0, the layout's batches per rank], or a layout
            whose ranks yield different numbers of batches (not drop_last).
    """
    if len(set(layout.num_batches)) != 1:
        raise ValueError("only a drop_last layout (equal batches on every rank) can be resharded")
    num_batches = layout.num_batches[0]
    if not 0 <= batches_done <= num_batches:
        raise ValueError(
            f"{batches_done} batches done outside [0, {num_batches}]: the epoch has "
            f"{num_batches} batches of {layout.batch_size} on each of {layout.world_size} rank(s)"
        )
    left = _rows_left(layout, batches_done)
    rows_left = sum(segment.num_rows for _, segment in left)
    batches = rows_left // (world_size * batch_size)
    share = batches * batch_size
    streams = _deal(_first_rows(left, world_size * share), world_size, share)
    return EpochLayout(
        streams, batch_size, (batches,) * world_size, rows_left, rows_left - world_size * share
    )


# A piece of the rows left: ((step at which the saved layout trains its first row, its rank),
# segment). Sorted by that key, pieces are in the order the saved layout would train them.
_Piece = tuple[tuple[int, int], Segment]


def _rows_left(layout: EpochLayout, batches_done: int) -> list[_Piece]:
    """The rows ``layout`` trains after ``batches_done`` batches, in the order it would."""
    batch_size, end = layout.batch_size, layout.num_batches[0] * layout.batch_size
    left = []
    for rank, stream in enumerate(layout.streams):
        position = batches_done * batch_size
        for segment in take_rows(stream, position, end):
            left.append(((position // batch_size, rank), segment))
            position += segment.num_rows
    left.sort(key=lambda piece: piece[0])  # stable: a rank's segments keep their order
    return left


def _first_rows(pieces: list[_Piece], count: int) -> list[_Piece]:
    """The first ``count`` rows of ``pieces``."""
    first, position = [], 0
    for key, segment in pieces:
        if position >= count:
            break
        rows = min(segment.num_rows, count - position)
        first.append((key, replace(segment, end=segment.start + rows)))
        position += rows
    return first


def _deal(pieces: list[_Piece], world_size: int, share: int) -> tuple[tuple[Segment, ...], ...]:
    """``world_size`` streams of ``share`` rows each from ``pieces`` (world_size x share rows,
    in order): each piece goes to the rank with the fewest rows so far, as a fresh epoch deals
    chunks round-robin, so the ranks read the rows side by side; then the rows past ``share``
    of a rank go, earliest first, to the ranks short of it."""
    dealt: list[list[_Piece]] = [[] for _ in range(world_size)]
    fewest = [(0, rank) for rank in range(world_size)]
    for piece in pieces:
        rows, rank = heapq.heappop(fewest)
        dealt[rank].append(piece)
        heapq.heappush(fewest, (rows + piece[1].num_rows, rank))
    streams, spare = [], []
    for own in dealt:
        stream, position = [], 0
        for (step, rank), segment in own:
            head = min(max(share - position, 0), segment.num_rows)
            if head:
                stream.append(replace(segment, end=segment.start + head))
            if head < segment.num_rows:
                spare.append(((step, rank), replace(segment, start=segment.start + head)))
            position += segment.num_rows
        streams.append(stream)
    spare.sort(key=lambda piece: piece[0])
    spare_segments = [segment for _, segment in spare]
    given = 0
    for stream in streams:
        need = share - num_rows(stream)
        stream += take_rows(spare_segments, given, given + need)
        given += need
    return tuple(tuple(stream) for stream in streams)


def epoch_layout(
    order: Sequence[int],
    chunk_rows: Sequence[int],
    world_size: int,
    batch_size: int,
    *,
    buffer_chunks: int = 1,
    drop_last: bool = True,
    reshards: Sequence[Reshard] = (),
) -> EpochLayout:
    """The layout of an epoch on ``world_size`` ranks x ``batch_size``: fresh, or after
    ``reshards`` (the layouts the epoch was read in before, oldest first).

    Raises:
        ValueError: reshards without drop_last, or a reshard's batches done outside its layout.
    """
    if not reshards:
        return fresh_layout(
            order, chunk_rows, world_size, batch_size, buffer_chunks=buffer_chunks,
            drop_last=drop_last,
        )  # fmt: skip
    if not drop_last:
        raise ValueError("reshards need drop_last (every rank yields the same batches)")
    first = reshards[0]
    layout = fresh_layout(
        order, chunk_rows, first.world_size, first.batch_size, buffer_chunks=buffer_chunks
    )
    shapes = [(r.world_size, r.batch_size) for r in reshards[1:]] + [(world_size, batch_size)]
    for left, (new_world_size, new_batch_size) in zip(reshards, shapes, strict=True):
        layout = reshard(layout, left.batches_done, new_world_size, new_batch_size)
    return layout


def take_rows(segments: Sequence[Segment], start: int, stop: int) -> list[Segment]:
    """Rows [start, stop) of the concatenation of ``segments``, as segments."""
    taken = []
    position = 0
    for segment in segments:
        if position >= stop:
            break
        low, high = max(start - position, 0), min(stop - position, segment.num_rows)
        if low < high:
            taken.append(replace(segment, start=segment.start + low, end=segment.start + high))
        position += segment.num_rows
    return taken


def num_rows(segments: Sequence[Segment]) -> int:
    return sum(segment.num_rows for segment in segments)


def reshard_line(layout: EpochLayout, epoch: int, left: Reshard, recorded: bool = True) -> str:
    """What a resume that resharded ``epoch`` into ``layout`` reads, in one line: the rows not
    yet trained, its batches and the rows dropped. ``left`` is the layout the checkpoint was
    saved in; ``recorded``: False for a checkpoint without its epoch's earlier reshards."""
    world_size, batch_size = layout.world_size, layout.batch_size
    dropped = layout.rows_dropped
    line = (
        f"resuming epoch {epoch} on {world_size} rank(s) x batch {batch_size} (saved on "
        f"{left.world_size} x {left.batch_size} after {left.batches_done} batches): the "
        f"{layout.rows_left:,} samples of this epoch not yet trained, in "
        f"{layout.num_batches[0]} batches per rank; "
    )
    line += (
        f"the last {dropped:,} of them (fewer than {world_size} x {batch_size}) are dropped"
        if dropped
        else "none dropped"
    )
    if not recorded:
        line += (
            f" (the checkpoint records no earlier reshard: epoch {epoch} is taken to have been "
            f"read on {left.world_size} x {left.batch_size} from its start)"
        )
    return line
