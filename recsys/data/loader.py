"""BatchLoader: training batches cut from a dataset's chunks, built ahead in a background thread.

A dataset (synthetic today; Criteo and parquet share the interface) exposes its splits as
chunks, each a :class:`~recsys.data.batch.Batch` of many rows:

    num_chunks(split) -> int
    chunk_rows(split, i) -> int        (cheap: no data is built)
    chunk(split, i) -> Batch

Each epoch the loader orders the chunks (a seeded permutation when shuffling), gives rank r the
chunks r, r + W, r + 2W, ... of that order, permutes the rows of every ``shuffle_buffer_chunks``
consecutive chunks when shuffling, and cuts the rows into batches of ``batch_size``. Everything
is a function of (seed, epoch), so the position (epoch, batches done) is enough to resume with
the same ranks and batch size. With ``drop_last`` (training) every rank yields the same number of
full batches, so collective ops (DDP's all-reduce) never wait for a rank that ran out of data;
the up to W x batch_size rows this leaves over are dropped from that epoch. Without it
(evaluation) every row is read once.

A resume on another number of ranks or batch size passes ``reshards``, the layouts the epoch was
read in before: the loader then reads exactly the rows of the epoch not yet trained, cut anew
for this shape (:mod:`recsys.data.layout`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from recsys.data.batch import Batch, DatasetSpec
from recsys.data.layout import Reshard, Segment, epoch_layout


class ChunkedDataset(Protocol):
    spec: DatasetSpec

    def num_chunks(self, split: str) -> int: ...

    def chunk_rows(self, split: str, index: int) -> int: ...

    def chunk(self, split: str, index: int) -> Batch: ...


class BatchLoader:
    """Iterable over one epoch of ``split``'s batches for this rank.

    Args:
        dataset: a chunked dataset (see module docstring).
        split: ``"train"``, ``"valid"`` or ``"test"``.
        batch_size: rows per batch on this rank.
        shuffle: permute the chunk order with (seed, epoch).
        seed: seed of the chunk permutation.
        epoch: epoch number, so each epoch gets its own order.
        drop_last: drop the final partial batch and equalize the batch count across ranks.
        rank: this rank's index.
        world_size: number of ranks W.
        prefetch: batches built ahead by a background thread (0: build in the caller).
        device: where batches are delivered; on CUDA they are pinned in the background thread
            and copied with ``non_blocking=True``.
        shuffle_buffer_chunks: with ``shuffle``, rows of this many consecutive chunks (of this
            rank's order) are permuted together before batches are cut.
        start_batch: resume inside the epoch: skip this many batches (the chunks they came
            from are not read). The data position of a run is (epoch, batches done).
        reshards: with ``drop_last``, the layouts (ranks x batch size, batches done) this epoch
            was read in before, oldest first (see :mod:`recsys.data.layout`); the loader reads
            the rows none of them trained, and ``start_batch`` counts batches of this layout.

    Example::

        for batch in BatchLoader(dataset, "train", 1024, shuffle=True, drop_last=True):
            logits = model(batch.dense, batch.sparse)
    """

    def __init__(
        self,
        dataset: ChunkedDataset,
        split: str,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 0,
        device: torch.device | str | None = None,
        shuffle_buffer_chunks: int = 1,
        start_batch: int = 0,
        reshards: Sequence[Reshard] = (),
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.dataset = dataset
        self.split = split
        if shuffle_buffer_chunks < 1:
            raise ValueError(f"shuffle_buffer_chunks must be >= 1, got {shuffle_buffer_chunks}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.shuffle_buffer_chunks = shuffle_buffer_chunks
        self.seed = seed
        self.epoch = epoch
        self.prefetch = prefetch
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        num_chunks = dataset.num_chunks(split)
        if shuffle:
            order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(
                num_chunks
            )
        else:
            order = np.arange(num_chunks)
        self.layout = epoch_layout(
            order,
            [dataset.chunk_rows(split, c) for c in range(num_chunks)],
            world_size,
            batch_size,
            buffer_chunks=shuffle_buffer_chunks if shuffle else 1,
            drop_last=drop_last,
            reshards=reshards,
        )
        self.segments = self.layout.streams[rank]
        self.chunks = list(dict.fromkeys(c for s in self.segments for c in s.chunks))
        self.num_batches = self.layout.num_batches[rank]
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch {start_batch} outside [0, {self.num_batches}]")
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        pin = self.device.type == "cuda"
        batches = self._cpu_batches(pin)
        if self.prefetch > 0:
            batches = _background(batches, self.prefetch)
        for batch in batches:
            yield batch.to(self.device, non_blocking=pin) if self.device.type != "cpu" else batch

    def _pieces(self) -> Iterator[Batch]:
        """This rank's rows of the epoch in order, as pieces of one segment each, starting
        ``start_batch * batch_size`` rows in (segments before that point are not even read)."""
        skip = self.start_batch * self.batch_size
        built_key, built = None, None  # the last buffer read: a reshard may cut one in two
        for segment in self.segments:
            if skip >= segment.num_rows:
                skip -= segment.num_rows
                continue
            if (segment.buffer, segment.chunks) != built_key:
                built_key, built = (segment.buffer, segment.chunks), self._buffer(segment)
            piece = built
            start, skip = segment.start + skip, 0
            if start or segment.end != len(piece):
                piece = piece.slice(start, segment.end)
            yield piece

    def _buffer(self, segment: Segment) -> Batch:
        """The rows of ``segment``'s whole buffer: its chunks, permuted when shuffling."""
        buffer = Batch.concat([self.dataset.chunk(self.split, c) for c in segment.chunks])
        if self.shuffle:
            seed = np.random.SeedSequence([self.seed, self.epoch, segment.buffer, 1])
            order = np.random.default_rng(seed).permutation(len(buffer))
            buffer = buffer.take(torch.from_numpy(order))
        return buffer

    def _cpu_batches(self, pin: bool) -> Iterator[Batch]:
        produced = self.start_batch
        pending: list[Batch] = []
        pending_rows = 0
        for piece in self._pieces():
            position = 0
            while position < len(piece) and produced < self.num_batches:
                take = min(self.batch_size - pending_rows, len(piece) - position)
                whole = position == 0 and take == len(piece)
                pending.append(piece if whole else piece.slice(position, position + take))
                pending_rows += take
                position += take
                if pending_rows == self.batch_size:
                    batch = Batch.concat(pending)
                    yield batch.pin_memory() if pin else batch
                    produced += 1
                    pending, pending_rows = [], 0
            if produced == self.num_batches:
                return
        if pending:
            batch = Batch.concat(pending)
            yield batch.pin_memory() if pin else batch


_DONE = object()


def _background(items: Iterator[Batch], size: int) -> Iterator[Batch]:
    """Run ``items`` in a daemon thread, ``size`` ahead; re-raise its errors in the caller."""
    buffer: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as error:  # forwarded to the consumer
            put(error)

    worker = threading.Thread(target=produce, name="recsys-batch-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = buffer.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
