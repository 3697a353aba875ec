"""RowBatcher: a request alone is scored at once; requests arriving while a batch is scored form
the next batch (at most max_requests each), each gets its own rows' scores back in order; a
failed scoring fails every request of its batch and the next batch still runs."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from recsys.serve.online.batcher import RowBatcher
from recsys.serve.online.requests import Rows


def _rows(first: int, count: int) -> Rows:
    dense = np.arange(first, first + count, dtype=np.float32)[:, None]
    return Rows(dense, np.zeros((count, 1), np.int64), np.zeros(0, np.int64))


class Scorer:
    """Scores a row by its dense value; the first call blocks until released."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.batches: list[int] = []
        self.release = threading.Event()
        self.fail_at = fail_at

    def __call__(self, dense, lengths, values):
        self.batches.append(len(dense))
        if len(self.batches) == 1:
            self.release.wait(5)
        if self.fail_at == len(self.batches):
            raise RuntimeError("scoring failed")
        return dense * 2, len(self.batches)


def test_requests_arriving_while_a_batch_runs_form_the_next_one():
    scorer = Scorer()

    async def main():
        batcher = RowBatcher(scorer, max_requests=3, max_wait_s=0.0)
        first = asyncio.create_task(batcher.score(_rows(0, 2)))  # alone: scored at once
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(batcher.score(_rows(10 * k, k))) for k in range(1, 6)]
        await asyncio.sleep(0.05)
        scorer.release.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(main())
    assert scorer.batches == [2, 1 + 2 + 3, 4 + 5]  # then 3 requests, then the other 2
    assert first[0].ravel().tolist() == [0, 2] and first[1] == 1
    for k, (scores, step, timing) in enumerate(rest, start=1):
        assert scores.ravel().tolist() == [2 * (10 * k + i) for i in range(k)]
        assert step == (2 if k <= 3 else 3) and timing.batch_rows == scorer.batches[step - 1]


def test_a_failed_batch_fails_its_requests_and_the_next_one_runs():
    scorer = Scorer(fail_at=2)

    async def main():
        batcher = RowBatcher(scorer, max_requests=2, max_wait_s=0.0)
        first = asyncio.create_task(batcher.score(_rows(0, 1)))
        await asyncio.sleep(0.05)
        failing = [asyncio.create_task(batcher.score(_rows(k, 1))) for k in (1, 2)]
        last = asyncio.create_task(batcher.score(_rows(3, 1)))
        await asyncio.sleep(0.05)
        scorer.release.set()
        await first
        for task in failing:
            with pytest.raises(RuntimeError, match="scoring failed"):
                await task
        return await last

    scores, step, _ = asyncio.run(main())
    assert scores.ravel().tolist() == [6] and step == 3 and scorer.batches == [1, 2, 1]
