"""A sharded collection's state in the logical layout (see
:mod:`recsys.embedding.interface`): what its ``state_dict()`` returns and ``load_state_dict()``
takes, whatever the plan.

- a sharded table (and each optimizer state of it) is one ShardedTensor of the full
  ``[num_embeddings, embedding_dim]`` (``[num_embeddings]`` per row), whose local shard is this
  rank's live tensor, so torch.distributed.checkpoint writes each shard from its rank and loads
  in place under any other plan;
- a replicated table is a plain tensor (every rank holds the same);
- ``optimizer_step`` is the fused optimizer's step counter.

The functions here and in :mod:`recsys.distributed.sharded_dynamic` take the collection as a
:class:`ShardedCollection`: what they read of it, declared here, so neither imports
:mod:`recsys.distributed.sharded` back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torchrec import EmbeddingBagConfig

from recsys.distributed.plan import Shard, TableSharding
from recsys.distributed.replicated import ReplicatedTables
from recsys.embedding.collection import EmbeddingBagCollection, EmbeddingTable
from recsys.embedding.dynamic.key_routing import KeyRouting
from recsys.embedding.interface import OPTIMIZER_STEP, WEIGHT
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import table_dtype


class ShardedCollection(Protocol):
    """What the logical-state functions read of a sharded collection
    (:class:`~recsys.distributed.sharded.ShardedEmbeddingBagCollection` is the one)."""

    plan: Mapping[str, TableSharding]
    tables_key: str
    """What the tables' state keys start with (``embedding_bags``, or ``embeddings`` unpooled)."""
    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None
    optimizer: FusedOptimizer | None
    shards: EmbeddingBagCollection | None
    """This rank's shards as one local collection (dynamic for KEY_WISE tables; None: none)."""
    replicated: ReplicatedTables | None
    """The DATA_PARALLEL tables (None: none)."""

    @property
    def device(self) -> torch.device: ...

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]: ...

    def key_wise_tables(self) -> list[str]: ...

    def tiered_tables(self) -> list[str]: ...

    def is_replicated(self, table: str) -> bool: ...

    def local_table(self, table: str) -> EmbeddingTable | None: ...

    def local_shard(self, table: str) -> Shard: ...

    def optimizer_step(self) -> torch.Tensor: ...

    def table_parameter_names(self) -> dict[str, str]: ...

    def routing_of(self, table: str) -> KeyRouting: ...


def shard_of(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The rows (and columns, for a 2-D tensor) of ``full`` that ``shard`` holds."""
    rows = slice(shard.row_offset, shard.row_offset + shard.num_rows)
    cols = slice(shard.col_offset, shard.col_offset + shard.num_cols)
    return full[rows] if full.dim() == 1 else full[rows, cols]


def logical_state(sharded: ShardedCollection, prefix: str, keep_vars: bool) -> dict[str, Any]:
    """The collection's state dict entries (see the module docstring), keys under ``prefix``."""
    out: dict[str, Any] = {}
    states = sharded.optimizer.states if sharded.optimizer is not None else {}
    for c in sharded.embedding_bag_configs():
        base = f"{prefix}{sharded.tables_key}.{c.name}."
        if c.name in sharded.key_wise_tables() or c.name in sharded.tiered_tables():
            continue  # saved by key (recsys.distributed.sharded_dynamic), or in tiered files
        if sharded.is_replicated(c.name):
            weight = sharded.replicated.weight(c.name)
            out[base + WEIGHT] = weight if keep_vars else weight.detach()
            out.update({base + n: b for n, b in sharded.replicated.optimizer_state(c.name).items()})
            continue
        local = sharded.local_table(c.name)
        weight = local.weight.detach() if local is not None else None
        out[base + WEIGHT] = sharded_tensor(sharded, c, weight, per_row=False)
        for name, kind in states.items():
            state = local.get_buffer(name) if local is not None else None
            out[base + name] = sharded_tensor(sharded, c, state, per_row=kind == "row")
    if sharded.optimizer is not None:
        out[prefix + OPTIMIZER_STEP] = sharded.optimizer_step()
    return out


def load_logical(sharded: ShardedCollection, key: str, value: Any) -> None:
    """Copy one logical entry (``key`` relative to the collection) into this rank's tensors:
    a plain full tensor, or a ShardedTensor whose local shard is this rank's."""
    if key == OPTIMIZER_STEP:
        value = torch.as_tensor(value)
        if sharded.shards is not None:
            sharded.shards.optimizer_step.copy_(value)
        if sharded.replicated is not None:
            sharded.replicated.step.copy_(value)
        return
    _, table, name = key.split(".")
    if sharded.is_replicated(table):
        if isinstance(value, ShardedTensor):
            raise ValueError(
                f"replicated table '{table}' was given as a ShardedTensor; expected a tensor"
            )
        replicated = sharded.replicated
        target = (
            replicated.weight(table) if name == WEIGHT else replicated.optimizer_state(table)[name]
        )
        target.copy_(torch.as_tensor(value))
        return
    local = sharded.local_table(table)
    if local is None:
        return
    target = local.weight if name == WEIGHT else local.get_buffer(name)
    if isinstance(value, ShardedTensor):
        (shard,) = value.local_shards()
        target.copy_(shard.tensor)
        return
    target.copy_(shard_of(value, sharded.local_shard(table)))


def logical_optimizer_state(
    sharded: ShardedCollection, prefix: str, state: dict[str, Any]
) -> dict[str, Any]:
    """A torch optimizer's per-parameter ``state`` with the collection's internal parameters
    (local shards, replicated tables) re-keyed to their logical tables. A state the shape of a
    shard becomes a ShardedTensor of the table's full shape over its live tensor, so a
    checkpoint of it does not depend on the plan and loading it in place updates the
    optimizer's own tensors; scalars (``step``) are shared by every shard. Tables this rank
    holds no shard of are left out."""
    internal = sharded.table_parameter_names()
    internal_keys = {prefix + name for name in internal.values()}
    out = {k: v for k, v in state.items() if k not in internal_keys}
    for c in sharded.embedding_bag_configs():
        name = internal.get(c.name)
        local = state.get(prefix + name) if name is not None else None
        if local is None:
            continue
        logical = f"{prefix}{sharded.tables_key}.{c.name}.{WEIGHT}"
        if sharded.is_replicated(c.name):
            out[logical] = local
            continue
        shape = sharded.local_table(c.name).weight.shape
        out[logical] = {
            key: (
                sharded_tensor(sharded, c, value, per_row=False)
                if torch.is_tensor(value) and value.shape == shape
                else value
            )
            for key, value in local.items()
        }
    return out


def sharded_tensor(
    sharded: ShardedCollection,
    config: EmbeddingBagConfig,
    local: torch.Tensor | None,
    per_row: bool,
) -> ShardedTensor:
    """The table (or a state of it) as one ShardedTensor over the group's ranks, ``local``
    being this rank's shard (None: this rank holds none)."""
    device = sharded.device
    size = [config.num_embeddings] if per_row else [config.num_embeddings, config.embedding_dim]
    metadata, mine, group = [], None, sharded.process_group
    for shard in sharded.plan[config.name].shards:
        offsets = [shard.row_offset] if per_row else [shard.row_offset, shard.col_offset]
        sizes = [shard.num_rows] if per_row else [shard.num_rows, shard.num_cols]
        # Placements name global ranks (a 2D plan's ranks are its group's).
        where = shard.rank if group is None else dist.get_global_rank(group, shard.rank)
        placement = f"rank:{where}/{device.type}"
        if device.type == "cuda":
            placement = f"rank:{where}/cuda:{torch.cuda.current_device()}"
        meta = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=placement)
        metadata.append(meta)
        if shard.rank == sharded.rank:
            mine = meta
    # Without a local shard nothing of it is read or written here and the dtype only describes
    # it: fp32 for per-row states, else the table's (per-element states are fp32 where held).
    dtype = local.dtype if local is not None else torch.float32 if per_row else table_dtype(config)
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metadata, size=torch.Size(size), tensor_properties=properties
    )
    shards = [LocalShard(local, mine)] if local is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, global_metadata, process_group=sharded.process_group
    )


def hide_internal_keys(module: nn.Module, incompatible) -> None:
    """load_state_dict visits the submodules too; the keys they expect are not the logical
    layout's, and ``_load_from_state_dict`` filled them already."""
    prefix = module.load_prefix
    internal = tuple(f"{prefix}{name}." for name, _ in module.named_children())
    incompatible.missing_keys[:] = [
        k for k in incompatible.missing_keys if not k.startswith(internal)
    ]
