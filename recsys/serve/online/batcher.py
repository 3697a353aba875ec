"""The request batcher of ``recsys serve``: checked :class:`~recsys.serve.online.requests.Rows`
of concurrent requests merged into one scored batch, with no per-value Python on the way (the
arrays are concatenated, the scores split by row counts).

A batch closes when it holds ``max_requests`` requests or ``max_wait_s`` after its first one
arrived, whichever comes first; it is scored in a worker thread (the event loop keeps taking
requests, which form the next batch meanwhile) by one call of ``score``, so by one version of
the served model. Timers per request (queue: arrival to its batch's start; score: the batch's
scoring) are returned with the scores for the metrics.

Example::

    batcher = RowBatcher(served.score_rows, max_requests=64, max_wait_s=0.002)
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
        max_wait_s: longest the first request of a batch waits for others (>= 0).
    """

    def __init__(
        self,
        score: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, int]],
        max_requests: int,
        max_wait_s: float,
    ) -> None:
        self._score = score
        self.max_requests, self.max_wait_s = max_requests, max_wait_s
        self._pending: list[tuple[Rows, float, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def score(self, rows: Rows) -> tuple[np.ndarray, int, BatchTiming]:
        """Scores of ``rows`` ([len(rows), T] float32), the step that scored them, and the
        request's timing."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((rows, time.perf_counter(), future))
        if len(self._pending) >= self.max_requests:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = (
            self._pending[: self.max_requests],
            self._pending[self.max_requests :],
        )
        if self._pending:  # more than one batch's worth arrived: the rest is the next batch
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush)
        if batch:
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[Rows, float, asyncio.Future]]) -> None:
        started = time.perf_counter()
        parts = [rows for rows, _, _ in batch]
        try:
            dense = np.concatenate([r.dense for r in parts]) if len(parts) > 1 else parts[0].dense
            lengths = (
                np.concatenate([r.lengths for r in parts]) if len(parts) > 1 else parts[0].lengths
            )
            values = (
                np.concatenate([r.values for r in parts]) if len(parts) > 1 else parts[0].values
            )
            scores, step = await asyncio.to_thread(self._score, dense, lengths, values)
        except Exception as error:  # every request of the batch gets the error
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        scored = time.perf_counter()
        ends = np.cumsum([len(r) for r in parts])
        for (_, arrived, future), part in zip(batch, np.split(scores, ends[:-1]), strict=True):
            if not future.done():
                timing = BatchTiming(started - arrived, scored - started, len(scores))
                future.set_result((part, step, timing))
