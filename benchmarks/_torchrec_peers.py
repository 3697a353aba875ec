"""TorchRec peers shared by the benchmark scripts: TorchRec's DLRM sharded by
``DistributedModelParallel`` in a process group of one rank, every table TABLE_WISE on the FUSED
kernel (FBGEMM's table-batched embedding with the optimizer fused into backward)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys import EmbeddingBagConfig  # recsys quiets torchrec's import

# The planner and DMP warn about their own defaults (topology factory, storage reservation,
# DDP's broadcast_buffers) on every build; nothing a benchmark can act on.
logging.getLogger("torchrec.distributed").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.distributed")


@contextlib.contextmanager
def single_rank_process_group(device: torch.device) -> Iterator[None]:
    """A process group of one rank on a free local port, destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def dmp_fused_dlrm(
    tables: list[EmbeddingBagConfig],
    device: torch.device,
    dense_in_features: int,
    dense_arch_layer_sizes: list[int],
    over_arch_layer_sizes: list[int],
    fused_params: dict[str, Any],
    dcn: tuple[int, int] | None = None,
) -> Iterator[tuple[nn.Module, list[nn.Parameter]]]:
    """``torchrec.models.dlrm.DLRM`` (with ``dcn`` = (layers, low rank):
    ``torchrec.models.dlrm.DLRM_DCN``) under DMP (world of one) with ``fused_params`` (e.g.
    ``{"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}``) on every table; yields the
    model and its dense parameters (the tables are trained by the fused optimizer)."""
    import torchrec
    import torchrec.models.dlrm
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingType

    with single_rank_process_group(device):
        ebc = torchrec.EmbeddingBagCollection(tables, device=torch.device("meta"))
        if dcn is None:
            model = torchrec.models.dlrm.DLRM(
                ebc, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes
            )
        else:
            model = torchrec.models.dlrm.DLRM_DCN(
                ebc, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, *dcn
            )
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
        constraints = {
            table.name: ParameterConstraints(
                sharding_types=[ShardingType.TABLE_WISE.value],
                compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            )
            for table in tables
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device=device.type), constraints=constraints
        )
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(model, device=device, sharders=[sharder], plan=plan)
        yield dmp, [p for name, p in dmp.named_parameters() if "embedding_bags" not in name]
