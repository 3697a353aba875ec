"""Where a run starts: the checkpoint it resumes (``checkpoint.resume``), the lineage of this
session, and the position in the data after a resume on the same or another number of ranks
and batch size; the trainer restores the checkpoint's state itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from recsys.checkpoint.io import (
    LATEST,
    checkpoint_step,
    find_resumable,
    resolve_checkpoint,
    verify_checkpoint,
)
from recsys.checkpoint.lineage import Lineage, new_run, read_lineage, resumed_run
from recsys.config import CheckpointConfig, Config
from recsys.data.layout import DataPosition, EpochLayout, Reshard, reshard_line
from recsys.train.run_dir import fresh_start_note

__all__ = ["data_position", "find_resume", "resumed_end", "session_lineage"]


def find_resume(config: Config, run_dir: Path, say: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume (None: a fresh start). ``latest`` goes back to the newest
    checkpoint under ``run_dir`` that verifies and says which ones it skipped, or that there is
    none; an explicit path must verify. Collective: every rank reads a share of the files."""
    if config.checkpoint.resume != LATEST:
        path = resolve_checkpoint(config.checkpoint.resume)
        verify_checkpoint(path)
        return path
    path, skipped = find_resumable(run_dir)
    for line in skipped:
        say(f"resume=latest: {line}")
    if path is None:
        say(fresh_start_note(run_dir))
    return path


def session_lineage(config: CheckpointConfig, resume: Path | None, step: int) -> Lineage:
    """This session's lineage (:mod:`recsys.checkpoint.lineage`): the resumed checkpoint's with
    this session appended at ``step`` (a new run id when it has none), else a new run's,
    naming the checkpoint a fine-tuned run starts from."""
    if resume is not None:
        return resumed_run(read_lineage(resume), step)
    if not config.init_from:
        return new_run()
    parent = resolve_checkpoint(config.init_from)
    return new_run(read_lineage(parent), checkpoint_step(parent))


def data_position(
    saved: dict[str, Any],
    world_size: int,
    batch_size: int,
    layout_of: Callable[[int, tuple[Reshard, ...]], EpochLayout],
    say: Callable[[str], None],
) -> DataPosition:
    """Where a run of ``world_size`` ranks x ``batch_size`` continues in the data of a
    checkpoint's state ``saved``: the saved position with the shape it was saved with; else a
    reshard of the epoch (the rows not yet trained, cut anew for this shape:
    :mod:`recsys.data.layout`), said in one line. ``layout_of(epoch, reshards)``: the epoch's
    layout for this run's shape."""
    epoch, done = saved["data_epoch"], saved["data_batch"]
    reshards = tuple(Reshard(*r) for r in saved.get("data_reshards", []))
    old = (saved["world_size"], saved["batch_size"])
    new = (world_size, batch_size)
    position = DataPosition(epoch, done, reshards).continued(*new, *old)
    if old != new:
        layout = layout_of(epoch, position.reshards)
        recorded = "data_reshards" in saved  # else saved before reshards were recorded
        say(reshard_line(layout, epoch, position.reshards[-1], recorded))
    return position


def resumed_end(
    config: Config,
    world_size: int,
    step: int,
    position: DataPosition,
    this_epoch: int,
    steps_per_epoch: int,
) -> tuple[int, str]:
    """The step a resumed run ends at, and the line that says why when it is not epochs x
    steps per epoch: steps before the resume were counted in the saving run's batches, and
    with other batch sizes or ranks the data left sets the end. ``this_epoch``: batches of the
    resumed epoch in this run's shape."""
    epochs, max_steps = config.train.epochs, config.train.max_steps
    left = this_epoch - position.batch + steps_per_epoch * (epochs - position.epoch - 1)
    total = step + left if max_steps == 0 else min(step + left, max_steps)
    note = (
        f"with batches of {config.train.batch_size} x {world_size} rank(s), the data left for "
        f"train.epochs = {epochs} is {total - step} batch(es): this run ends at step {total}"
    )
    return total, note
