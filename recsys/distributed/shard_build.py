"""How a :class:`~recsys.distributed.sharded.ShardedEmbeddingBagCollection` makes this rank's
shards: the plan checked against the collection, each shard's table config, and the local
collection holding the shards (plain, dynamic or tiered, as the collection being sharded),
filled from that collection's rows or, from the ``meta`` device, initialized in place.

From the ``meta`` device nothing is ever held whole:

- a sharded fixed table with TorchRec's default (uniform) init starts each shard from
  :func:`~recsys.embedding.row_init.fill_initial_rows`, a function of (seed, table, row): the
  table starts the same on any number of ranks and under any sharded plan (a custom ``init_fn``
  is applied to each shard as it is; a DATA_PARALLEL table takes its ``init_fn`` on rank 0,
  broadcast);
- a dynamic table starts empty (keys get their rows as they arrive);
- a tiered table's shard is a
  :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection` of this rank's rows or
  keys, in its own store (a disk tier's files under ``<path>/rank<r>``), whose rows start lazily
  from the same (seed, table, row or key) function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

from recsys.distributed.plan import Shard, ShardingType, TableSharding, check_table_sharding
from recsys.distributed.sharded_dynamic import owner_test
from recsys.distributed.sharded_state import shard_of
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.key_routing import KeyRouting
from recsys.embedding.dynamic.table import UNCAPPED, DynamicTableOptions
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.row_init import fill_initial_rows, table_seed, uniform_bound
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.files import TablePart
from recsys.embedding.tiered.options import RowBlock
from recsys.embedding.tiered.row_store import store_directory

__all__ = ["build_shards", "checked_plan", "dynamic_parts", "shard_config", "tiered_of"]

# The sharding types a tiered table may take: split by rows, whole on one rank, or (dynamic)
# by key.
TIERED_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.KEY_WISE)


def tiered_of(module: EmbeddingBagCollection) -> list[str]:
    """The tables ``module`` keeps in host memory or on disk."""
    return module.tiered_tables() if isinstance(module, TieredEmbeddingBagCollection) else []


def dynamic_parts(
    module: EmbeddingBagCollection, plan: Mapping[str, TableSharding], rank: int
) -> dict[str, DynamicTableOptions]:
    """Dynamic table -> its options for ``rank``'s part of it (one of
    ``len(plan[name].shards)``): its share of the cap in whole buckets (the table's buckets
    dealt out, so the parts add up to the cap of the table in one process, on any number of
    ranks), and the whole table's initial-row bound (a key starts from the same row wherever
    it lives)."""
    if isinstance(module, TieredEmbeddingBagCollection):
        configs = {c.name: c for c in module.embedding_bag_configs()}
        return {
            name: replace(
                options,
                init_bound=options.init_bound
                if options.init_bound is not None
                else math.sqrt(1.0 / configs[name].num_embeddings),
            )
            for name, options in module.dynamic_options.items()
        }
    if not isinstance(module, DynamicEmbeddingBagCollection):
        return {}
    out = {}
    for name, table in module.dynamic.items():
        buckets, ranks = table.map.max_buckets, [s.rank for s in plan[name].shards]
        part = ranks.index(rank) if rank in ranks else 0
        share = buckets // len(ranks) + (part < buckets % len(ranks))
        uncapped = table.map.max_capacity >= UNCAPPED
        out[name] = replace(
            table.options,
            # At least one bucket: a part needs one (a cap under one bucket per rank is raised).
            max_capacity=0 if uncapped else max(share, 1) * table.map.bucket_size,
            memory_budget_mb=0.0,  # folded into the cap
            init_bound=table.bound,
        )
    return out


def shard_config(
    config: EmbeddingBagConfig, shard: Shard, kind: ShardingType, parts: int
) -> EmbeddingBagConfig:
    """The local table holding ``shard`` (one of ``parts``): its rows and columns, the table's
    features; row-wise and key-wise shards pool by sum (the mean divides the summed partials
    at the sample's rank). A key-wise shard starts with its share of the table's initial rows
    (it grows by itself)."""
    one_owner = kind in (ShardingType.ROW_WISE, ShardingType.KEY_WISE)
    rows = shard.num_rows
    if kind == ShardingType.KEY_WISE:
        rows = max(1, math.ceil(config.num_embeddings / parts))
    return EmbeddingBagConfig(
        name=config.name,
        num_embeddings=rows,
        embedding_dim=shard.num_cols,
        feature_names=list(config.feature_names),
        pooling=PoolingType.SUM if one_owner else config.pooling,
        data_type=config.data_type,
        init_fn=config.init_fn,
    )


def build_shards(
    module: EmbeddingBagCollection,
    local: list[tuple[EmbeddingBagConfig, Shard]],
    kinds: Mapping[str, ShardingType],
    dynamic: Mapping[str, DynamicTableOptions],
    *,
    device: torch.device,
    seed: int,
    rank: int,
    num_shards: Mapping[str, int],
) -> EmbeddingBagCollection | None:
    """This rank's shards (``local``: each table's config and this rank's shard of it) as one
    local collection of ``module``'s kind (None when it holds none), with ``module``'s rows,
    columns and optimizer state copied in, or (``module`` on ``meta``) initialized in place
    from ``seed``."""
    if not local:
        return None
    configs = [shard_config(c, s, kinds[c.name], num_shards[c.name]) for c, s in local]
    common = {
        "is_weighted": module.is_weighted(),
        "device": device,
        "backend": module.backend,
        "validate": False,  # ids were checked against the full tables before routing
    }
    parts = {c.name: dynamic[c.name] for c in configs if c.name in dynamic}
    if isinstance(module, TieredEmbeddingBagCollection):
        if module.device.type != "meta":
            raise ValueError(
                "a tiered collection is sharded from the meta device (build it with "
                "device='meta'): its rows are in its store, which no rank copies whole"
            )
        return _tiered_shards(module, local, configs, parts, rank, **common)
    common["optimizer"] = module.optimizer
    if parts:  # this rank's parts of the dynamic tables (and its fixed shards)
        shards = DynamicEmbeddingBagCollection(configs, parts, seed=module.seed, **common)
    else:
        shards = EmbeddingBagCollection(configs, **common)
    if module.device.type == "meta":
        _initialize(shards, local, set(parts), seed)
    else:
        _copy_from(module, shards, local, set(parts))
    return shards


def _tiered_shards(
    module: TieredEmbeddingBagCollection,
    local: list[tuple[EmbeddingBagConfig, Shard]],
    configs: list[EmbeddingBagConfig],
    parts: dict[str, DynamicTableOptions],
    rank: int,
    **common: Any,
) -> TieredEmbeddingBagCollection:
    """This rank's part of a tiered collection: its shards, each in a store of its own."""
    storage = {}
    for config in configs:
        options = module.storage[config.name]
        if options.tier == "disk":  # each rank's files in a directory of its own
            base = store_directory(options.path)
            options = replace(options, path=str(base / f"rank{rank}"))
        storage[config.name] = options
    tiered = set(module.tiered_tables())
    blocks = {
        c.name: RowBlock(s.row_offset, c.num_embeddings)
        for c, s in local
        if c.name in tiered and c.name not in parts
    }
    shards = TieredEmbeddingBagCollection(
        configs, storage, module.optimizer, parts, seed=module.seed, blocks=blocks, **common
    )
    _initialize(shards, local, tiered, module.seed)
    return shards


def _initialize(
    shards: EmbeddingBagCollection,
    local: list[tuple[EmbeddingBagConfig, Shard]],
    skip: set[str],
    seed: int,
) -> None:
    """The fixed in-memory shards of a table with a uniform init from the table's initial rows
    (their block of them); the others keep what their collection made."""
    for config, shard in local:
        bound = uniform_bound(config.init_fn)
        if config.name in skip or bound is None:
            continue
        weight = shards.embedding_bags[config.name].weight
        fill_initial_rows(
            weight, table_seed(seed, config.name), bound, shard.row_offset, shard.col_offset
        )


def _copy_from(
    source: EmbeddingBagCollection,
    shards: EmbeddingBagCollection,
    local: list[tuple[EmbeddingBagConfig, Shard]],
    skip: set[str],
) -> None:
    """Copy each fixed shard's rows, columns and optimizer state from ``source`` (the dynamic
    tables in ``skip`` are copied by key once the shards are in place)."""
    with torch.no_grad():
        for c, shard in local:
            if c.name in skip:
                continue
            target = shards.embedding_bags[c.name]
            target.weight.copy_(shard_of(source.embedding_bags[c.name].weight, shard))
            for name, buffer in target.named_buffers():
                buffer.copy_(shard_of(source.embedding_bags[c.name].get_buffer(name), shard))
        if source.optimizer is not None:
            shards.optimizer_step.copy_(source.optimizer_step)
        if skip:
            shards.dynamic_step.copy_(source.dynamic_step)


def checked_plan(
    configs: list[EmbeddingBagConfig],
    plan: Mapping[str, TableSharding],
    world_size: int,
    optimizer: FusedOptimizer | None,
    dynamic: set[str],
    tiered: set[str],
) -> dict[str, TableSharding]:
    """``plan`` once checked against the collection's tables: every table placed, by a sharding
    its kind allows (KEY_WISE for dynamic tables only, over every rank; no COLUMN_WISE with a
    per-row optimizer state; a tiered table TABLE_WISE, ROW_WISE or KEY_WISE)."""
    names = [c.name for c in configs]
    missing = [n for n in names if n not in plan]
    extra = sorted(set(plan) - set(names))
    if missing or extra:
        raise ValueError(
            f"the plan lacks tables {missing} and names unknown tables {extra}; the "
            f"collection's tables are {names}"
        )
    row_state = optimizer is not None and "row" in optimizer.states.values()
    for config in configs:
        sharding = plan[config.name]
        check_table_sharding(config, sharding, world_size)
        kind = ShardingType(sharding.sharding_type)
        key_wise = kind == ShardingType.KEY_WISE
        if key_wise != (config.name in dynamic):
            raise ValueError(
                f"table '{config.name}' is {kind.name} but "
                + (
                    "dynamic (raw ids): shard it KEY_WISE"
                    if config.name in dynamic
                    else "KEY_WISE is for dynamic tables (raw ids) only"
                )
            )
        if key_wise and sorted(sharding.ranks) != list(range(world_size)):
            raise ValueError(
                f"dynamic table '{config.name}' is KEY_WISE on ranks {sharding.ranks}; "
                f"expected every rank 0..{world_size - 1} (in any order)"
            )
        if config.name in tiered and kind not in TIERED_TYPES:
            raise ValueError(
                f"table '{config.name}' is tiered (host or disk) and {kind.name}; a tiered "
                "table is TABLE_WISE or ROW_WISE (KEY_WISE when dynamic)"
            )
        if row_state and kind == ShardingType.COLUMN_WISE:
            raise ValueError(
                f"table '{config.name}' is COLUMN_WISE but {type(optimizer).__name__} keeps one "
                "accumulator per row, which column shards cannot share exactly; use "
                "TABLE_WISE / ROW_WISE for it, or an optimizer with per-element state "
                "(SGD, Adagrad, Adam)"
            )
    return dict(plan)


def table_part(
    sharding: TableSharding, shard: Shard, table_rows: int, routing: KeyRouting | None = None
) -> TablePart:
    """The part of a tiered table's checkpoint files that ``shard`` holds: its rows as rows of
    the whole table of ``table_rows``, or (``routing``: a dynamic table's) the keys its
    routing buckets own."""
    index, count = sharding.shards.index(shard), len(sharding.shards)
    if routing is not None:
        return TablePart(owns=owner_test(routing, count, index), index=index, count=count)
    return TablePart(
        shard.row_offset, shard.num_rows, index=index, count=count, table_rows=table_rows
    )


def merge_tiered_stats(every: list[dict]) -> dict[str, dict[str, float]]:
    """Every rank's tiered counters by table, summed (``prefetch_wait_s``: the longest)."""
    out: dict[str, dict[str, float]] = {}
    for stats in every:
        for table, counters in stats.items():
            total = out.setdefault(table, {})
            for key, value in counters.items():
                merge = max if key == "prefetch_wait_s" else float.__add__
                total[key] = merge(float(total.get(key, 0.0)), float(value))
    return out
