"""Each rank of a CPU job on its own cores: ``distributed.cpu_binding``.

On a host whose cores the ranks of a torchrun job share, the OS moves a rank's threads between
cores as they wake: after each collective a rank's main thread may find its core taken by a
peer's transport thread (gloo's), and the whole job waits for it at the next collective.
Binding each local rank, its transport threads with it, to its own block of the cores this
process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s set, split in
contiguous blocks of ``cores // LOCAL_WORLD_SIZE``) keeps every rank on its own cores
(``benchmarks/cpu_binding.py`` measures what it changes). With more local ranks than cores
the ranks must share cores whatever is done, and are left to the OS. CUDA ranks are left
alone (their host threads feed a device).
"""

from __future__ import annotations

import os

import torch

__all__ = ["MODES", "bind_local_rank", "local_cores"]

MODES = ("auto", "off")


def local_cores(local_rank: int, local_world: int, cores: list[int]) -> list[int]:
    """Local rank ``local_rank``'s block of ``cores`` (sorted) among ``local_world`` ranks:
    ``len(cores) // local_world`` of them, in order; [] when there are fewer cores than
    ranks."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} of {local_world}")
    per = len(cores) // local_world
    return sorted(cores)[local_rank * per : (local_rank + 1) * per] if per else []


def bind_local_rank(mode: str, device: torch.device) -> list[int]:
    """Bind this process (every thread it has now, and so the ones it starts later) to its
    local rank's cores (:func:`local_cores`, from ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``) when
    ``mode`` is ``auto``, ``device`` a CPU and there are at least as many cores as local
    ranks; the cores bound ([] when nothing was done)."""
    if mode not in MODES:
        raise ValueError(f"distributed.cpu_binding = {mode!r}; expected one of {MODES}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if mode == "off" or device.type != "cpu" or local_world < 2:
        return []
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        return []
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cores = local_cores(local_rank, local_world, sorted(os.sched_getaffinity(0)))
    if not cores:
        return []
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended since the listing
            continue
    return cores
