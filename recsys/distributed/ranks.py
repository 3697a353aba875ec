"""This process's place among the ranks of a torchrun job, and the small collectives the
checkpoint and delta writers share: all of them also work in a plain one-process run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recsys.distributed.mirror import is_mirrored


def is_distributed() -> bool:
    """Whether a process group is up (torchrun)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 in one process)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 in one process)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Wait for every rank (nothing in one process)."""
    if is_distributed():
        dist.barrier()


def all_gather(value: Any) -> list[Any]:
    """Every rank's (picklable) ``value``, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def from_first_rank(value: Any) -> Any:
    """Rank 0's ``value``, on every rank (in a mirrored world, where no rank 0 runs beside
    this one, this rank's own: :mod:`recsys.distributed.mirror`)."""
    if not is_distributed() or is_mirrored():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_first_rank(check: Callable[[], Any]) -> None:
    """Run ``check`` on the first rank; a ValueError it raises is raised on every rank (so no
    rank waits in a collective for one that stopped)."""
    error = None
    if rank() == 0:
        try:
            check()
        except ValueError as raised:
            error = str(raised)
    error = from_first_rank(error)
    if error is not None:
        raise ValueError(error)
