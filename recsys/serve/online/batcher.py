"""The request batcher of ``recsys serve``: checked :class:`~recsys.serve.online.requests.Rows`
of concurrent requests merged into one scored batch, with no per-value Python on the way (the
arrays are concatenated, the scores split by row counts).

One batch is scored at a time, in a worker thread (the event loop keeps taking requests), by
one call of ``score``, so by one version of the served model. The requests that arrive while
it runs form the next batch, which starts as soon as it finishes (continuous batching: under
load a batch holds the requests of about one scoring time, up to ``max_requests``; alone, a
request is scored at once). With ``max_wait_s`` > 0 an idle scorer waits that long for others
before starting (fewer, larger batches at low load, at that cost in latency). A batch's
fixed cost (the program call, most of a small batch's time: ``benchmarks/serving.py``'s
phase split) is what merging saves.
Timers per request (queue: arrival to its batch's start; score: the batch's scoring) are
returned with the scores for the metrics.

Example::

    batcher = RowBatcher(served.score, max_requests=64, max_wait_s=0.0)
    scores, step, timing = await batcher.score(rows)   # [len(rows), T]
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from recsys.serve.online.requests import Rows

__all__ = ["BatchTiming", "RowBatcher"]


@dataclass(frozen=True)
class BatchTiming:
    """Where a request's time went inside the batcher, in seconds."""

    queue_s: float
    """From the request's arrival to its batch's scoring start."""
    score_s: float
    """Its batch's scoring."""
    batch_rows: int
    """Rows of the batch it was scored in."""


class RowBatcher:
    """Merge concurrent requests' rows into batches (see the module docstring).

    Args:
        score: ``score(dense, lengths, values) -> (scores [B, T], step)`` for merged rows
            (:meth:`~recsys.serve.online.served.ServedModel.score`); run in a worker thread.
        max_requests: most requests in one batch (>= 1).
        max_wait_s: how long an idle scorer waits for more requests (>= 0; 0: none).
        on_batch: called with each scored batch's number of rows (metrics).
    """

    def __init__(
        self,
        score: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, int]],
        max_requests: int,
        max_wait_s: float,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._score, self._on_batch = score, on_batch
        self.max_requests, self.max_wait_s = max_requests, max_wait_s
        self._pending: list[tuple[Rows, float, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False

    async def score(self, rows: Rows) -> tuple[np.ndarray, int, BatchTiming]:
        """Scores of ``rows`` ([len(rows), T] float32), the step that scored them, and the
        request's timing."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((rows, time.perf_counter(), future))
        if not self._busy:
            if self.max_wait_s <= 0 or len(self._pending) >= self.max_requests:
                self._start()
            elif self._timer is None:
                self._timer = loop.call_later(self.max_wait_s, self._start)
        return await future

    def _start(self) -> None:
        """Score the pending requests (up to ``max_requests``) unless a batch is running: its
        end starts them."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy or not self._pending:
            return
        batch = self._pending[: self.max_requests]
        self._pending = self._pending[self.max_requests :]
        self._busy = True
        asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[Rows, float, asyncio.Future]]) -> None:
        try:
            await self._scored(batch)
        finally:
            self._busy = False
            self._start()  # the requests that arrived meanwhile, at once

    async def _scored(self, batch: list[tuple[Rows, float, asyncio.Future]]) -> None:
        started = time.perf_counter()
        parts = [rows for rows, _, _ in batch]
        try:
            dense, lengths, values = (
                np.concatenate([getattr(r, field) for r in parts]) if len(parts) > 1
                else getattr(parts[0], field)
                for field in ("dense", "lengths", "values")
            )  # fmt: skip
            scores, step = await asyncio.to_thread(self._score, dense, lengths, values)
        except Exception as error:  # every request of the batch gets the error
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        if self._on_batch is not None:
            self._on_batch(len(scores))
        scored = time.perf_counter()
        ends = np.cumsum([len(r) for r in parts])
        for (_, arrived, future), part in zip(batch, np.split(scores, ends[:-1]), strict=True):
            if not future.done():
                timing = BatchTiming(started - arrived, scored - started, len(scores))
                future.set_result((part, step, timing))
