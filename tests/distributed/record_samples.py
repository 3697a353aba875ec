"""``python -m tests.distributed.record_samples train ...``: ``recsys train`` that also appends
every sample each rank trains (one line each: its dense values, then its bags of ids) to
``$RECORD_SAMPLES/rank<r>.txt``, for tests that check which samples a run trained (under
torchrun as well: ``torchrun ... -m tests.distributed.record_samples train ...``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from recsys.cli import main
from recsys.data.batch import Batch
from recsys.train import trainer


def sample_lines(batch: Batch) -> list[str]:
    """Each sample of ``batch`` as one line of text (dense values, then each bag of ids)."""
    dense = batch.dense.tolist()
    bags = [(b.values().tolist(), b.offsets().tolist()) for b in batch.sparse.to_dict().values()]
    return [
        " ".join([*map(repr, dense[i]), *(",".join(map(str, v[o[i] : o[i + 1]])) for v, o in bags)])
        for i in range(batch.batch_size)
    ]


def _recording(train_step):
    def step(self, batch, timer):
        path = Path(os.environ["RECORD_SAMPLES"]) / f"rank{self.info.rank}.txt"
        with path.open("a") as out:
            out.writelines(line + "\n" for line in sample_lines(batch))
        return train_step(self, batch, timer)

    return step


if __name__ == "__main__":
    trainer._Run._train_step = _recording(trainer._Run._train_step)
    sys.exit(main(sys.argv[1:]))
