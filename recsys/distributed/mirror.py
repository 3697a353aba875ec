"""One rank of a W-rank job in this process, its peers mirrored: for timing a rank's step on
the host ``recsys plan`` runs on (:func:`~recsys.train.rank_timing.rank_step_seconds`).

:func:`mirrored` starts a process group of the ``mirror`` backend, which no other process
joins: a collective returns at once, as if every peer had done what this rank does. An
all-to-all hands this rank, from every peer, the block it sends itself where the sizes agree
(the peer's batch is taken to be like this rank's: the ids a peer sends this rank's shards are
this rank's own ids for them, so they are valid rows) and zeros where they do not (pooled
vectors of a peer's shards: values that only have to have their shape); an all-gather hands
every peer this rank's block; an all-reduce and a broadcast leave the tensors as they are (a
sum of W equal gradients that DDP divides by W is the rank's own, divided). The rank's work
is the work of a rank of the job, less the network: its lookups, pooling, packing, dense
part, backward and updates, on its shards of the plan; what the collectives take is for the
cost model to add.

Example::

    with mirrored(world_size=8):
        ...  # dist.get_world_size() == 8; collectives return at once
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

__all__ = ["BACKEND", "MirrorGroup", "is_mirrored", "mirrored", "recording"]

BACKEND = "mirror"
_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_calls: list[float] | None = None  # while recording: when each collective was called


@contextmanager
def recording() -> Iterator[list[float]]:
    """The ``time.perf_counter()`` at which each collective of a mirror group is called,
    appended to the list yielded while inside."""
    global _calls
    _calls = []
    try:
        yield _calls
    finally:
        _calls = None


def _called() -> None:
    if _calls is not None:
        _calls.append(time.perf_counter())


def is_mirrored() -> bool:
    """Whether this process runs in a mirrored world (:func:`mirrored`)."""
    return dist.is_initialized() and dist.get_backend() == BACKEND


def _done(result: object = None) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class MirrorGroup(dist.ProcessGroup):
    """A process group of one process standing for ``size`` ranks (see the module docstring).
    CPU tensors; the collectives a training step makes."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @torch.no_grad()
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: object = None,
    ) -> dist.Work:
        _called()
        outs = _splits(output, output_split_sizes, self._size)
        ins = _splits(input, input_split_sizes, self._size)
        start = sum(ins[: self._rank])
        own = input[start : start + ins[self._rank]]
        offset = 0
        for size in outs:
            block = output[offset : offset + size]
            block.copy_(own) if size == own.shape[0] else block.zero_()
            offset += size
        return _done([output])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes)

    def allreduce(self, tensors, opts=None) -> dist.Work:
        _called()
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        _called()
        return _done(tensors)

    def broadcast(self, tensors, opts=None) -> dist.Work:
        _called()
        return _done(tensors)

    def barrier(self, opts=None) -> dist.Work:
        _called()
        return _done()

    @torch.no_grad()
    def allgather(self, output_lists, inputs, opts=None) -> dist.Work:
        _called()
        for outputs, tensor in zip(output_lists, inputs, strict=True):
            for output in outputs:
                output.copy_(tensor)
        return _done(output_lists)

    @torch.no_grad()
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts=None):
        _called()
        blocks = output.view(self._size, *input.shape)
        blocks.copy_(input.unsqueeze(0).expand_as(blocks))
        return _done([output])

    def all_gather_single(self, output, input, opts=None) -> dist.Work:
        return self._allgather_base(output, input)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        for output, tensor in zip(outputs, inputs, strict=True):
            self._allgather_base(output, tensor)
        return _done(outputs)


def _splits(tensor: torch.Tensor, sizes: Sequence[int], world: int) -> list[int]:
    """An all-to-all's split sizes (even splits when none are given)."""
    return list(sizes) if len(sizes) else [tensor.shape[0] // world] * world


def _create(store, rank: int, size: int, timeout) -> MirrorGroup:
    return MirrorGroup(rank, size)


def _register() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


@contextmanager
def mirrored(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` ranks, its peers mirrored (the module
    docstring), under the environment torchrun sets (one node of ``world_size`` ranks); the
    group and the environment are restored after. Not inside another process group."""
    if dist.is_initialized():
        raise RuntimeError("mirrored() starts its own process group: one is already running")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size} ranks")
    _register()
    saved = {key: os.environ.get(key) for key in _ENV}
    values = (world_size, rank, rank, world_size)
    os.environ.update({key: str(value) for key, value in zip(_ENV, values, strict=True)})
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
