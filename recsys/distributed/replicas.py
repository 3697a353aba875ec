"""2D sparse parallelism: tables sharded inside groups of ranks, the groups replicated.

With W ranks and R replicas (``distributed.sparse_replicas``), ranks ``g * G .. (g + 1) * G - 1``
(G = W / R; consecutive ranks, so a group is a node when G is the ranks per node) form shard
group g: every embedding collection is planned for G ranks and sharded inside each group, so
its all-to-alls never leave the group. Rank ``g * G + l`` of every group holds the same shards
(replica group l). Each group trains its shards on its own ranks' samples (gradients averaged
over the group), and every ``sync_every`` steps :func:`sync_replicas` averages each shard's
weights and fused-optimizer state over its replica group: with plain SGD and a sync every step
that is the flat plan's update (the mean of the groups' mean gradients is the mean over all
ranks), up to float rounding; with a stateful optimizer each group's state follows its own
gradients between syncs, and the sync averages the states too (TorchRec's ``DMPCollection``
does the same). The dense layers stay data-parallel over all W ranks (DDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaGroups", "replica_groups", "replica_tensors", "sync_replicas"]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's groups under 2D sparse parallelism (see the module docstring)."""

    replicas: int
    group_size: int
    shard_group: dist.ProcessGroup  # the G ranks this rank's tables are sharded over
    replica_group: dist.ProcessGroup  # the R ranks that hold this rank's shards


def replica_groups(replicas: int) -> ReplicaGroups:
    """Make the shard and replica groups of ``replicas`` replicas (a collective: every rank
    calls it, in the same order).

    Raises:
        ValueError: ``replicas`` that does not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if replicas < 1 or world % replicas:
        raise ValueError(
            f"distributed.sparse_replicas = {replicas}; expected a divisor of the world size "
            f"{world}"
        )
    size, backend = world // replicas, dist.get_backend()
    shard_group = replica_group = None
    for first in range(0, world, size):  # every rank creates every group
        group = dist.new_group(list(range(first, first + size)), backend=backend)
        if first <= rank < first + size:
            shard_group = group
    for local in range(size):
        group = dist.new_group(list(range(local, world, size)), backend=backend)
        if rank % size == local:
            replica_group = group
    assert shard_group is not None and replica_group is not None
    return ReplicaGroups(replicas, size, shard_group, replica_group)


def replica_tensors(collection: nn.Module) -> list[torch.Tensor]:
    """What replicas average: the floating-point parameters and buffers (weights and
    fused-optimizer state) of a sharded collection's shards and replicated tables."""
    out = []
    for part in (getattr(collection, "shards", None), getattr(collection, "replicated", None)):
        if part is None:
            continue
        for tensor in [*part.parameters(), *part.buffers()]:
            if tensor.is_floating_point():
                out.append(tensor)
    return out


# Tensors below this size are averaged together, packed into buffers of at most this size: one
# all-reduce per buffer instead of one per tensor (a latency each: 0.8 ms with gloo on 4 CPU
# ranks); larger ones are averaged in place, never copied.
BUCKET_BYTES = 16 * 2**20


@torch.no_grad()
def sync_replicas(collections: list[nn.Module], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average every 2D-sharded collection's :func:`replica_tensors` over its replica group
    (collections with one replica are left alone). Tensors smaller than ``bucket_bytes`` are
    packed, by dtype and in order, into buffers of at most that size, each averaged by one
    all-reduce and copied back; a larger tensor is averaged in place, alone (no copy of a
    shard, which may be most of a device's memory). Each value is the same sum over the same
    ranks either way (bitwise the per-tensor average for two replicas). The time goes to the
    collection's ``comm_stats`` (a step's collectives). A collective of every rank; nothing
    waits for the device."""
    for collection in collections:
        groups: ReplicaGroups | None = getattr(collection, "replica_groups", None)
        if groups is None or groups.replicas == 1:
            continue
        tensors = replica_tensors(collection)
        if not tensors:
            continue
        with collection.comm_stats.timed(tensors[0].device):  # a sharded collection's
            for bucket in _buckets(tensors, bucket_bytes):
                _average(bucket, groups)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` in groups to average together: a large tensor alone; the others by dtype and
    device, in order, up to ``bucket_bytes`` a group."""
    out: list[list[torch.Tensor]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            out.append([tensor])
            continue
        key = (tensor.dtype, tensor.device)
        bucket, filled = open_.get(key, ([], 0))
        if bucket and filled + size > bucket_bytes:
            out.append(bucket)
            bucket, filled = [], 0
        bucket.append(tensor)
        open_[key] = (bucket, filled + size)
    out.extend(bucket for bucket, _ in open_.values() if bucket)
    return out


def _average(bucket: list[torch.Tensor], groups: ReplicaGroups) -> None:
    if len(bucket) == 1:
        (tensor,) = bucket
        dist.all_reduce(tensor, group=groups.replica_group)
        tensor.div_(groups.replicas)
        return
    flat = torch.cat([t.reshape(-1) for t in bucket])
    dist.all_reduce(flat, group=groups.replica_group)
    flat.div_(groups.replicas)
    for tensor, piece in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
        tensor.copy_(piece.view_as(tensor))
