"""A rank's step of a config, timed on this host: what ``recsys plan`` charges for the ranks'
work when its topology is a calibration of CPU hosts like this one.

:func:`rank_step_seconds` runs the trainer of the config in this process as one rank of the
planned world, its peers mirrored (:mod:`recsys.distributed.mirror`: each collective returns at
once, as if every peer did what this rank does): the rank plans its tables as a run does, holds
its shards, makes its batches and trains them through its lookups, the exchanges' packing, the
dense part, the backward and the fused updates. It notes when each collective is called and
splits every step into the pieces of work between two collectives (the first from the end of
the previous step's, its bookkeeping and the making of the batch included; the last to the
step's end). A collective is where the ranks of a run wait for each other, so each piece takes
as long as the slowest rank's: the ranks are timed one after another (up to 8 of them), and a
step is the sum over its pieces of the slowest rank's time at the same step (the same step of
every rank does the same kind of work: a chunk of data read at the same step, say), averaged
over the steps. What the collectives themselves take is left to the cost model (from the
topology). Nothing is kept: the run directory is a temporary one.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from recsys.config import Config, load_config
from recsys.config.loading import to_toml
from recsys.data import build_dataset
from recsys.distributed.mirror import mirrored, recording
from recsys.train.trainer import train_steps

__all__ = ["MAX_RANKS", "rank_step_seconds", "slowest_pieces"]

MAX_RANKS = 8  # ranks timed, at most
_WARMUP = 10  # steps before the timed ones


class _Refused(Exception):
    """The run refused this world before its first step (its one-line error)."""


def _refusing(run: Iterator[int]) -> Iterator[int]:
    """``run``'s steps; what it refuses before the first (a config error: too few chunks of
    data for the ranks, say) as :class:`_Refused`."""
    try:
        first = next(run)
    except StopIteration:
        return
    except (ValueError, FileNotFoundError) as error:
        raise _Refused(str(error).splitlines()[0]) from None
    yield first
    yield from run


def _timed_config(config: Config, work: Path, replicas: int, sync_every: int) -> Config:
    source = work / "config.toml"
    source.write_text(to_toml(config))
    return load_config(
        source,
        [
            f"--run.dir={work / 'run'}",
            "--run.device=cpu",
            "--run.overwrite=true",
            "--run.tensorboard=false",
            "--train.progress_bar=false",
            "--train.log_every_steps=1000000",
            "--train.eval_every_steps=0",
            "--train.early_stopping_patience=0",
            "--train.max_steps=0",
            "--checkpoint.every_steps=0",
            "--checkpoint.delta_every_steps=0",
            "--checkpoint.keep_best=",
            "--checkpoint.resume=",
            "--checkpoint.init_from=",
            f"--distributed.sparse_replicas={replicas}",
            f"--distributed.sync_every={sync_every}",
        ],
    )


def _pieces(config: Config, world: int, rank: int, steps: int) -> list[np.ndarray]:
    """Rank ``rank``'s ``steps`` steps after the warm-up (fewer where the train split ends),
    each split into its pieces (see the module docstring): their seconds."""
    out: list[np.ndarray] = []
    with (
        mirrored(world, rank),
        contextlib.redirect_stdout(io.StringIO()),
        recording() as calls,
    ):
        run = train_steps(config)
        try:
            start, begun = 0, time.perf_counter()
            for count, _ in enumerate(_refusing(run), 1):
                now = time.perf_counter()
                if count > _WARMUP:
                    out.append(np.diff([begun, *calls[start:], now]))
                begun, start = now, len(calls)
                if len(out) == steps:
                    break
        finally:
            run.close()
    return out


def rank_step_seconds(
    config: Config,
    world_size: int,
    replicas: int = 1,
    sync_every: int = 1,
    rank_bytes: int = 0,
    ranks: Sequence[int] | None = None,
    steps: int = 0,
) -> tuple[float, str]:
    """The seconds of a step of ``config`` on ``world_size`` ranks (``replicas`` > 1: 2D,
    synced every ``sync_every`` steps) less its collectives' own time: from the start of
    making its batch to the end of its optimizer step, each piece between two collectives as
    long as the slowest of ``ranks`` (default: the first 8) takes it at that step, each rank
    timed on this host's CPU with its peers mirrored (see the module docstring) for ``steps``
    steps after 10 of warm-up (default: whole chunks of a rank's train data, 20 to 200 steps;
    fewer where the split ends), their mean; and how, in words. 0 and why, untimed, when a
    rank's tables and state (``rank_bytes``, as planned) take more than half this host's
    memory, or when a run of the config on this world refuses to start (its one-line error)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if rank_bytes > memory / 2:
        return 0.0, (
            f"not timed (a rank's tables and state, {rank_bytes / 2**30:.1f} GiB, take more "
            f"than half this host's {memory / 2**30:.1f} GiB)"
        )
    ranks = list(ranks if ranks is not None else range(min(world_size, MAX_RANKS)))
    with tempfile.TemporaryDirectory(prefix="recsys-plan-") as work:
        timed = _timed_config(config, Path(work), replicas, sync_every)
        steps = steps or _whole_chunks(timed)
        try:
            runs = [_pieces(timed, world_size, rank, steps) for rank in ranks]
        except _Refused as refused:
            return 0.0, f"not timed ({refused})"
    if not min(len(r) for r in runs):
        return 0.0, f"not timed (the train split holds {_WARMUP} steps or fewer)"
    step, alone, kept, shape = slowest_pieces(runs)
    if len(ranks) == 1:
        return step, (
            f"{1e3 * step:,.2f} ms a step less its {shape - 1} collectives: rank {ranks[0]} of "
            f"{world_size} timed on this host with its peers mirrored ({kept} steps)"
        )
    return step, (
        f"{1e3 * step:,.2f} ms a step less its collectives: ranks {ranks[0]}-{ranks[-1]} of "
        f"{world_size} timed on this host with their peers mirrored ({kept} steps each, "
        f"{1e3 * alone:,.2f} ms a rank's step), the slowest of them between each two of a "
        f"step's {shape - 1} collectives"
    )


def slowest_pieces(runs: Sequence[Sequence[np.ndarray]]) -> tuple[float, float, int, int]:
    """A step from each rank's timed steps (``runs``: per rank, per step, the seconds of its
    pieces): the mean over steps of the sum over pieces of the slowest rank's piece at that
    step (the same step of every rank is the same kind of work: a chunk of data read at the
    same step, say), over the steps where every rank has the commonest number of pieces; the
    mean of a rank's step; the steps kept and the pieces a step."""
    count = min(len(r) for r in runs)
    shape, _ = Counter(len(r[k]) for r in runs for k in range(count)).most_common(1)[0]
    kept = [k for k in range(count) if all(len(r[k]) == shape for r in runs)]
    pieces = np.array([[r[k] for k in kept] for r in runs])  # [ranks, steps, pieces]
    step = float(pieces.max(axis=0).sum(axis=1).mean())
    return step, float(pieces.sum(axis=2).mean()), len(kept), shape


def _whole_chunks(config: Config) -> int:
    """Steps that read whole shuffle buffers of a rank's train data (``data.
    shuffle_buffer_chunks`` chunks at once, or a chunk unshuffled: their reading or generating
    shared out over their batches), at least 20, at most 200."""
    dataset = build_dataset(config.data, config.run.seed)
    chunks = config.data.shuffle_buffer_chunks if config.data.shuffle else 1
    rows = dataset.chunk_rows("train", 0) * max(chunks, 1)
    batches = max(1, rows // config.train.batch_size)
    return min(max(batches * -(-20 // batches), 20), 200)
