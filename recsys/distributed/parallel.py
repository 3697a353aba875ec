"""Process groups and ``parallelize``: how a model runs on several ranks under torchrun.

Today every table is DATA_PARALLEL: the whole model is replicated and wrapped in
DistributedDataParallel, which all-reduces the gradients of dense layers and tables alike.
Model-parallel sharding (TABLE_WISE, ROW_WISE, COLUMN_WISE over all-to-all) plugs in here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistributedInfo:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, LOCAL_RANK);
    NCCL on CUDA, gloo on CPU. A plain ``python`` launch is a world of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistributedInfo()
    info = DistributedInfo(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's GPU when CUDA is available, else CPU; otherwise ``name``."""
    if name == "auto":
        name = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"run.device = {name!r} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def parallelize(model: nn.Module, device: torch.device) -> nn.Module:
    """Make ``model`` train across the ranks of the initialized process group.

    Returns the model unchanged in a world of one, else the DDP-wrapped model (every table
    replicated, DATA_PARALLEL).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    # Model buffers are constants (index tables), so there is nothing to broadcast per forward.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
