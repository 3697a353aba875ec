"""BatchLoader: training batches cut from a dataset's chunks, built ahead in worker processes.

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

The work is planned as tasks, one per shuffle buffer (the run of this rank's segments cut from
it): build the buffer, cut its rows at the batch boundaries, and compute each batch's KJT
offsets, ids per key and key offsets on the host (:meth:`Batch.with_offsets
<recsys.data.batch.Batch.with_offsets>`), so that the step never asks the device for them.
With ``workers`` the tasks run in that many processes (:mod:`recsys.data.workers`), ahead of
the training loop; a batch that spans two buffers is joined as it arrives. Without, they run in
the caller (or a background thread with ``prefetch``). The batches are the same either way:
the plan is a function of (seed, epoch, position) alone.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from recsys.data.batch import Allocate, Batch, DatasetSpec, gather_batches
from recsys.data.layout import Reshard, Segment, epoch_layout
from recsys.data.workers import WorkerPool, shared_empty, usable_cpus

MAX_AUTO_WORKERS = 8
"""The most worker processes ``workers=-1`` starts per rank."""


def default_workers(world_size: int = 1) -> int:
    """The worker processes ``workers=-1`` (``data.loader_workers = -1``) starts: half the CPUs
    each rank of this machine has (``LOCAL_WORLD_SIZE`` ranks, else ``world_size``), at most
    :data:`MAX_AUTO_WORKERS`; 0 (batches built in the training process) when a rank has fewer
    than 2 CPUs, where a worker could only take them from training."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cpus = usable_cpus() // max(ranks_here, 1)
    return 0 if cpus < 2 else min(MAX_AUTO_WORKERS, cpus // 2)


def default_prefetch(prefetch_batches: int, cuda: bool) -> int:
    """``data.prefetch_batches`` with -1 (auto) resolved: 4 batches ahead on CUDA, none on
    CPU (where a prefetching thread would only take the training process's cores)."""
    return prefetch_batches if prefetch_batches >= 0 else (4 if cuda else 0)


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
        prefetch: batches made ready ahead by a background thread (0: in the caller; with
            ``workers``, at least 1: that thread receives the workers' batches).
        device: where batches are delivered; on CUDA they are pinned in the background thread
            and copied with ``non_blocking=True``.
        workers: processes that build the batches (a task of one shuffle buffer each, each
            worker one ahead of the batches being trained); 0: build them in this process;
            -1: :func:`default_workers`.
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
        workers: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if workers < -1:
            raise ValueError(f"workers must be -1 (auto) or >= 0, got {workers}")
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
        if workers < 0:
            workers = default_workers(world_size)
        self.workers = workers
        rows = sum(segment.num_rows for segment in self.segments) - start_batch * batch_size
        self._num_rows = max(0, min(rows, (self.num_batches - start_batch) * batch_size))
        self.tasks = self._plan(start_batch)
        """The work of this epoch from ``start_batch`` on: one task per shuffle buffer read."""

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        pin = self.device.type == "cuda"
        pool = None
        if self.workers > 0 and self.tasks:
            build = functools.partial(self.build_task, allocate=shared_empty)
            pool = WorkerPool(build, len(self.tasks), self.workers, self.workers, pin)
            batches = background(self._join(pool.results()), max(self.prefetch, 1))
        else:
            built = (self.build_task(task) for task in range(len(self.tasks)))
            batches = (b.pin_memory() if pin else b for b in self._join(built))
            if self.prefetch > 0:
                batches = background(batches, self.prefetch)
        try:
            for batch in batches:
                yield (
                    batch.to(self.device, non_blocking=pin) if self.device.type != "cpu" else batch
                )
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # stops the background thread
                close()
            if pool is not None:
                pool.close()

    def _plan(self, start_batch: int) -> list[_Task]:
        """This rank's rows of the epoch from batch ``start_batch`` on, as tasks: the runs of
        consecutive segments of one buffer (segments before that batch are not read, nor are
        buffers past the last batch)."""
        skip = start_batch * self.batch_size
        tasks: list[_Task] = []
        row = 0
        for segment in self.segments:
            if row >= self._num_rows:
                break
            if skip >= segment.num_rows:
                skip -= segment.num_rows
                continue
            span = (segment.start + skip, segment.end)
            skip = 0
            last = tasks[-1] if tasks else None
            if last is not None and (last.segment.buffer, last.segment.chunks) == (
                segment.buffer,
                segment.chunks,
            ):  # a reshard cut this buffer in two: read it once
                tasks[-1] = _Task(last.segment, (*last.spans, span), last.first_row)
            else:
                tasks.append(_Task(segment, (span,), row))
            row += span[1] - span[0]
        return tasks

    def build_task(self, index: int, allocate: Allocate | None = None) -> list[tuple[int, Batch]]:
        """Task ``index`` (of :attr:`tasks`; what a worker runs): its buffer's rows cut at batch
        boundaries, per batch it touches the batch (or, when the batch spans another task too,
        its piece of it) with the batch's index in the epoch, offsets computed; all gathered
        in one pass per tensor (into ``allocate``'s memory) by :func:`gather_batches`."""
        task = self.tasks[index]
        buffer = Batch.concat([self.dataset.chunk(self.split, c) for c in task.segment.chunks])
        if self.shuffle:
            seed = np.random.SeedSequence([self.seed, self.epoch, task.segment.buffer, 1])
            order = torch.from_numpy(np.random.default_rng(seed).permutation(len(buffer)))
        else:
            order = torch.arange(len(buffer))
        rows, end_row = [], task.first_row
        for start, end in task.spans:
            end = min(end, start + self._num_rows - end_row)  # nothing past the last batch
            if end <= start:
                break
            rows.append(order[start:end])
            end_row += end - start
        sizes, batches, row = [], [], task.first_row
        while row < end_row:
            batch = row // self.batch_size
            sizes.append(min((batch + 1) * self.batch_size, end_row) - row)
            batches.append(self.start_batch + batch)
            row += sizes[-1]
        pieces = gather_batches(buffer, torch.cat(rows), sizes, allocate)
        return list(zip(batches, pieces, strict=True))

    def _join(self, built: Iterator[list[tuple[int, Batch]]]) -> Iterator[Batch]:
        """The batches of the tasks' results in order, a batch split over tasks joined."""
        pending: list[Batch] = []
        rows = 0
        for pieces in built:
            for index, piece in pieces:
                pending.append(piece)
                rows += len(piece)
                full = min(
                    self.batch_size, self._num_rows - (index - self.start_batch) * self.batch_size
                )
                if rows == full:
                    yield pending[0] if len(pending) == 1 else Batch.concat(pending).with_offsets()
                    pending, rows = [], 0
        assert not pending, "a batch was left incomplete"


class _Task(NamedTuple):
    """Rows of one buffer, read in one go: ``spans`` ([start, end) of its permuted rows, in
    order), the first of them row ``first_row`` of this rank's rows from ``start_batch`` on;
    ``segment`` names the buffer."""

    segment: Segment
    spans: tuple[tuple[int, int], ...]
    first_row: int


_DONE = object()
# How long closing a loader waits for its background thread to finish the batch in hand.
_JOIN_TIMEOUT_S = 60.0


def background(items: Iterator[Batch], size: int) -> Iterator[Batch]:
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
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # a generator's cleanup runs here, in its own thread
                close()

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
        # The thread stops at its next put (after the batch it is building): wait for it, so
        # no thread is inside torch when the interpreter shuts down (that aborts the process:
        # "terminate called without an active exception").
        worker.join(timeout=_JOIN_TIMEOUT_S)
