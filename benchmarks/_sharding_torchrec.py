"""The TorchRec peer of ``benchmarks/sharding.py``: ``torchrec.EmbeddingBagCollection`` under
``DistributedModelParallel`` on this rank's process group, holding the same tables as the
unsharded recsys collection, placed as recsys places them (or as TorchRec's planner chooses),
with Adagrad fused into backward and quantized comms by ``QCommsConfig``.

TorchRec is imported inside the functions, after ``recsys`` (which quiets its import), and only
when the peer is built (``--no-torchrec`` runs without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from benchmarks._sharding_setup import EPS, LR, Setup, count_kinds
from recsys import EmbeddingBagConfig
from recsys.embedding.collection import EmbeddingBagCollection

if TYPE_CHECKING:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingPlan


def torchrec_dmp(
    setup: Setup,
    sharding: str,
    precision: str,
    unsharded: EmbeddingBagCollection,
    device: torch.device,
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None, str]:
    """TorchRec's EmbeddingBagCollection under DMP holding the unsharded tables' values: the
    model (KJT -> KeyedTensor), the torch optimizer of its DENSE tables (or None), a note."""
    import torchrec
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.optim import apply_optimizer_in_backward

    tables = unsharded.embedding_bag_configs()
    ebc = torchrec.EmbeddingBagCollection(tables, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": LR, "eps": EPS})
    comm = CommType(precision)
    registry = get_qcomm_codecs_registry(QCommsConfig(comm, comm), device=device)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    plan, notes = torchrec_plan(setup, sharding, tables, ebc, sharder, device)
    dmp = DistributedModelParallel(ebc, device=device, sharders=[sharder], plan=plan)
    load_tables(dmp, unsharded)
    # The in-backward optimizer reaches the FUSED tables only; the DENSE (data-parallel) ones
    # get DDP's averaged gradient, for a torch optimizer.
    dense = [
        p
        for p in dmp.parameters()
        if p.requires_grad and not getattr(p, "_in_backward_optimizers", None)
    ]
    optimizer = None
    if dense:
        optimizer = torch.optim.Adagrad(dense, lr=LR, eps=EPS)
        notes.append("torch.optim.Adagrad on the DENSE tables")
    return dmp, optimizer, "; ".join(notes)


def torchrec_plan(
    setup: Setup,
    sharding: str,
    tables: list[EmbeddingBagConfig],
    ebc: torch.nn.Module,
    sharder: EmbeddingBagCollectionSharder,
    device: torch.device,
) -> tuple[ShardingPlan, list[str]]:
    """TorchRec's ShardingPlan of ``ebc`` (on the meta device) for ``sharding``: the placements
    of recsys's hand plan on the FUSED kernel, or (``planner``) EmbeddingShardingPlanner's
    choice; and notes on it (the sharding type / kernel of each table, counted)."""
    from torchrec.distributed import sharding_plan as tp
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingPlan

    world = setup.world_size
    notes = []
    if sharding == "planner":
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=device.type),
            batch_size=setup.batch_size,
        )
        plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
        notes.append("EmbeddingShardingPlanner")
    else:
        fused = EmbeddingComputeKernel.FUSED.value
        make = {
            "data_parallel": lambda i: tp.data_parallel(),
            "table_wise": lambda i: tp.table_wise(rank=i % world, compute_kernel=fused),
            "row_wise": lambda i: tp.row_wise(compute_kernel=fused),
            "column_wise": lambda i: tp.column_wise(ranks=list(range(world)), compute_kernel=fused),
        }[sharding]
        module_plan = tp.construct_module_sharding_plan(
            ebc,
            {t.name: make(i) for i, t in enumerate(tables)},
            sharder=sharder,
            local_size=world,
            world_size=world,
            device_type=device.type,
        )
        plan = ShardingPlan({"": module_plan})
        if sharding == "row_wise" and device.type == "cpu":
            notes.append("ROW_WISE forced by the plan (TorchRec's sharder offers it on CUDA only)")
    kinds = [
        f"{p.sharding_type.upper()}/{p.compute_kernel.upper()}" for p in plan.plan[""].values()
    ]
    notes.append(count_kinds(kinds))
    return plan, notes


def load_tables(dmp: torch.nn.Module, unsharded: EmbeddingBagCollection) -> None:
    """Copy the unsharded tables into DMP's (the local shards of its state_dict are views)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    source = unsharded.state_dict()
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not key.endswith(".weight"):
                continue
            full = source[key[key.index("embedding_bags.") :]]
            if not isinstance(value, ShardedTensor):
                value.copy_(full)
                continue
            for shard in value.local_shards():
                offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
                shard.tensor.copy_(full[where])


def output_columns(pooled, tables: list[EmbeddingBagConfig]) -> torch.Tensor:
    """Column j of the KeyedTensor ``pooled`` is column ``index[j]`` of the unsharded output
    (sharded TorchRec orders its output keys by sharding type and rank, not by table)."""
    start, width = {}, {}
    for t in tables:
        for f in t.feature_names:
            start[f] = sum(width.values())
            width[f] = t.embedding_dim
    index = []
    for key, length in zip(pooled.keys(), pooled.length_per_key(), strict=True):
        assert width[key] == length, (key, length, width[key])
        index += range(start[key], start[key] + length)
    return torch.tensor(index, dtype=torch.int64)
