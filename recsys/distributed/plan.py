"""Sharding plans: where each table of each EmbeddingBagCollection lives.

A plan maps a collection's module path (``""`` for a bare collection, else e.g.
``"sparse_arch.embedding_bag_collection"``) to ``{table name: TableSharding}``. A
:class:`TableSharding` is a :class:`ShardingType` and its shards; each shard is a block of the
table's rows x columns on one rank:

- ``DATA_PARALLEL``: the whole table on every rank; each rank looks up its own batch and the
  gradients are averaged over ranks. For small tables: no communication in forward.
- ``TABLE_WISE``: the whole table on one rank.
- ``ROW_WISE``: rows split in blocks of ``ceil(num_embeddings / world_size)``, block r on rank r
  (so id ``i`` lives on rank ``i // block``); ranks past the last row hold nothing. Each rank
  pools the ids it owns; the partial sums are added up at the sample's rank.
- ``COLUMN_WISE``: columns split into pieces, each piece (all rows) on a different rank.
- ``KEY_WISE``: a dynamic table (raw 64-bit keys) split over ranks by a hash of the key: of its
  fixed number of global routing buckets (:mod:`recsys.embedding.dynamic.key_routing`), shard j of n
  owns the contiguous range ``[j * buckets // n, (j + 1) * buckets // n)``; each shard's rank
  runs its own id -> slot map for those keys. A shard's rows are the most keys it may hold (its
  share of the table's cap), which the planner budgets; like ROW_WISE, each rank pools the
  keys it owns and the partial sums are added at the sample's rank.

Build plans by hand with :func:`data_parallel`, :func:`table_wise`, :func:`row_wise` and
:func:`column_wise`, or let :func:`plan_sharding` choose (it documents its cost model), within
user constraints (:class:`TableConstraint`, :func:`parse_constraints`); ``plan.describe()`` prints
a plan.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchrec import EmbeddingBagConfig


@dataclass(frozen=True)
class TableFootprint:
    """A table as :func:`plan_sharding` sized it, for :meth:`ShardingPlan.describe`.

    Attributes:
        data_type: the weights' dtype, e.g. ``"fp32"``.
        optimizer_state: the fused optimizer's state, e.g. ``"sum per row"`` ("" for none).
        shard_bytes: bytes of weights and optimizer state of each shard, in shard order.
        cache_rows: a tiered table's (rows in host memory or on disk) cache rows per shard,
            which is all ``shard_bytes`` counts; 0: not tiered.
        cost: the planner's estimated cost per step of this placement, summed over the ranks,
            in the units of ``ShardingPlan.rank_costs`` (lookups, communication and, for a
            replicated table, its gradient exchange; see ``plan_sharding``).
    """

    data_type: str
    optimizer_state: str
    shard_bytes: tuple[int, ...]
    cache_rows: int = 0
    cost: float = 0.0


class ShardingType(str, enum.Enum):
    """How one table is split over the ranks (TorchRec's names)."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    KEY_WISE = "key_wise"


@dataclass(frozen=True)
class Shard:
    """Rows ``[row_offset, row_offset + num_rows)`` x columns ``[col_offset, col_offset +
    num_cols)`` of a table, held by ``rank``."""

    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


@dataclass(frozen=True)
class TableSharding:
    """One table's sharding type and shards (see the module docstring for each type's shape)."""

    sharding_type: ShardingType
    shards: tuple[Shard, ...]

    @property
    def ranks(self) -> list[int]:
        """Ranks that hold a piece of the table, in shard order."""
        return [s.rank for s in self.shards]


@dataclass
class ShardingPlan:
    """Every collection's table shardings, for ``world_size`` ranks.

    Attributes:
        world_size: number of ranks the plan is for.
        collections: module path -> table name -> :class:`TableSharding`.
        memory_per_rank: bytes each rank may use for tables and optimizer state, when the
            planner was given a budget (0: unknown); ``describe()`` shows usage against it.
        footprints: module path -> table name -> :class:`TableFootprint`, recorded by
            :func:`plan_sharding` (empty for a hand-built plan).
        rank_costs: the planner's estimated cost of each rank per step, in its relative units
            (empty for a hand-built plan).
    """

    world_size: int
    collections: dict[str, dict[str, TableSharding]] = field(default_factory=dict)
    memory_per_rank: int = 0
    footprints: dict[str, dict[str, TableFootprint]] = field(default_factory=dict)
    rank_costs: list[float] = field(default_factory=list)

    def __getitem__(self, path: str) -> dict[str, TableSharding]:
        if path not in self.collections:
            raise KeyError(
                f"the sharding plan has no collection at {path!r}; it has "
                f"{sorted(self.collections)}"
            )
        return self.collections[path]

    def describe(self, max_ranks: int = 0) -> str:
        """A fixed-width text table: one line per table, then one line per rank (``max_ranks``
        > 0: the first ``max_ranks`` ranks, then one line of the rest's range).

        Returns:
            the table, ready to print or log. A hand-built plan records no dtypes, so its
            memory column assumes fp32 tables without optimizer state, and says so.

        Example:
            >>> print(plan_sharding({"": tables}, world_size=2).describe())  # doctest: +SKIP
        """
        return _describe(self, max_ranks)


# ---------------------------------------------------------------------------------------------
# Building blocks for hand-written plans


def data_parallel(num_embeddings: int, embedding_dim: int, world_size: int) -> TableSharding:
    """The whole table replicated on every rank."""
    return TableSharding(
        ShardingType.DATA_PARALLEL,
        tuple(Shard(r, 0, num_embeddings, 0, embedding_dim) for r in range(world_size)),
    )


def table_wise(num_embeddings: int, embedding_dim: int, rank: int) -> TableSharding:
    """The whole table on ``rank``."""
    return TableSharding(
        ShardingType.TABLE_WISE, (Shard(rank, 0, num_embeddings, 0, embedding_dim),)
    )


def row_block(num_embeddings: int, world_size: int) -> int:
    """Rows per row-wise shard: id ``i`` lives on rank ``i // row_block(...)``."""
    return max(1, math.ceil(num_embeddings / world_size))


def row_wise(num_embeddings: int, embedding_dim: int, world_size: int) -> TableSharding:
    """Rows in blocks of ``ceil(num_embeddings / world_size)``, block r on rank r."""
    block = row_block(num_embeddings, world_size)
    shards = []
    for rank in range(world_size):
        start = rank * block
        rows = min(num_embeddings, start + block) - start
        if rows > 0:
            shards.append(Shard(rank, start, rows, 0, embedding_dim))
    return TableSharding(ShardingType.ROW_WISE, tuple(shards))


def column_wise(
    num_embeddings: int, embedding_dim: int, ranks: Sequence[int], widths: Sequence[int] = ()
) -> TableSharding:
    """Columns split over distinct ``ranks``: pieces of ``widths`` (default: as even as
    possible, wider pieces first) in column order."""
    if not widths:
        base, extra = divmod(embedding_dim, len(ranks))
        widths = [base + (1 if i < extra else 0) for i in range(len(ranks))]
    if len(widths) != len(ranks):
        raise ValueError(f"column_wise: {len(widths)} widths {list(widths)} for ranks {ranks}")
    shards, offset = [], 0
    for rank, width in zip(ranks, widths, strict=True):
        shards.append(Shard(rank, 0, num_embeddings, offset, width))
        offset += width
    return TableSharding(ShardingType.COLUMN_WISE, tuple(shards))


def key_wise(max_rows: int, embedding_dim: int, ranks: Sequence[int]) -> TableSharding:
    """A dynamic table over distinct ``ranks`` (shard order = routing-bucket order), each shard
    budgeted ``ceil(max_rows / len(ranks))`` rows (at least 1)."""
    block = max(1, math.ceil(max_rows / len(ranks)))
    shards = tuple(Shard(rank, j * block, block, 0, embedding_dim) for j, rank in enumerate(ranks))
    return TableSharding(ShardingType.KEY_WISE, shards)


def check_table_sharding(config: EmbeddingBagConfig, sharding: TableSharding, world_size: int):
    """Raise ``ValueError`` unless ``sharding`` is a valid placement of ``config``'s table on
    ``world_size`` ranks (the shapes each sharding type must have are in the module docstring)."""
    name, rows, dim = config.name, config.num_embeddings, config.embedding_dim
    kind = ShardingType(sharding.sharding_type)
    where = f"table '{name}' ({rows} x {dim}, {kind.name})"
    if not sharding.shards:
        raise ValueError(f"{where}: the sharding has no shards")
    for shard in sharding.shards:
        if not 0 <= shard.rank < world_size:
            raise ValueError(f"{where}: shard on rank {shard.rank}; expected 0..{world_size - 1}")
    full = tuple(Shard(s.rank, 0, rows, 0, dim) for s in sharding.shards)
    if kind == ShardingType.DATA_PARALLEL:
        expected = data_parallel(rows, dim, world_size).shards
    elif kind == ShardingType.TABLE_WISE:
        expected = full[:1]
    elif kind == ShardingType.ROW_WISE:
        expected = row_wise(rows, dim, world_size).shards
    elif kind == ShardingType.KEY_WISE:
        ranks = sharding.ranks
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: key-wise shards must be on distinct ranks, got {ranks}")
        expected = key_wise(sharding.shards[0].num_rows * len(ranks), dim, ranks).shards
    else:
        ranks = sharding.ranks
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: column shards must be on distinct ranks, got {ranks}")
        widths = [s.num_cols for s in sharding.shards]
        if any(w <= 0 for w in widths):
            raise ValueError(f"{where}: column shard widths {widths} must be positive")
        expected = column_wise(rows, dim, ranks, widths).shards
    if tuple(sharding.shards) != tuple(expected):
        raise ValueError(
            f"{where}: shards {list(sharding.shards)} are not a {kind.name} placement; "
            f"expected {list(expected)}"
        )


def check_plan(
    plan: ShardingPlan, collections: dict[str, Sequence[EmbeddingBagConfig]], world_size: int
) -> None:
    """Raise ``ValueError`` unless ``plan`` places every table of every collection in
    ``collections`` (module path -> table configs) validly on ``world_size`` ranks, and names
    no collection or table that does not exist."""
    if plan.world_size != world_size:
        raise ValueError(
            f"the sharding plan is for {plan.world_size} ranks but this job has {world_size}"
        )
    unknown = sorted(set(plan.collections) - set(collections))
    if unknown:
        raise ValueError(
            f"the sharding plan names collections {unknown} that the model does not have; "
            f"its collections are {sorted(collections)}"
        )
    for path, configs in collections.items():
        shardings = plan.collections.get(path, {})
        names = [c.name for c in configs]
        extra = sorted(set(shardings) - set(names))
        missing = [n for n in names if n not in shardings]
        if extra or missing:
            raise ValueError(
                f"collection {path!r}: the plan lacks tables {missing} and names unknown tables "
                f"{extra}; the collection's tables are {names}"
            )
        for config in configs:
            check_table_sharding(config, shardings[config.name], world_size)


def shard_bytes(shard: Shard, element_bytes: int, states: dict[str, str]) -> int:
    """Weights plus fp32 optimizer state of one shard."""
    elements = shard.num_rows * shard.num_cols
    state = sum(shard.num_rows if kind == "row" else elements for kind in states.values())
    return elements * element_bytes + 4 * state


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


# ---------------------------------------------------------------------------------------------
# describe()


def _text_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(map(str.ljust, row, widths)).rstrip() for row in rows]


def _rank_list(ranks: list[int]) -> str:
    """``0-7`` for 3+ consecutive ranks in order, else ``3,1``."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _table_line(
    path: str, name: str, sharding: TableSharding, footprint: TableFootprint, peak: float
):
    rows = max(s.row_offset + s.num_rows for s in sharding.shards)
    cols = max(s.col_offset + s.num_cols for s in sharding.shards)
    low, high = (format_bytes(f(footprint.shard_bytes)) for f in (min, max))
    memory, kind = (high if low == high else f"{low}..{high}"), ShardingType(sharding.sharding_type)
    where, size = _rank_list(sharding.ranks), f"{rows} x {cols}"
    if kind == ShardingType.KEY_WISE:  # a dynamic table: at most its cap, hashed over ranks
        size = f"<={rows} x {cols}"
    label = f"{kind.name} tiered" if footprint.cache_rows else kind.name
    cost = f"{footprint.cost / peak:.3f}" if footprint.cost else "-"
    return [path or "(root)", name, size, footprint.data_type, label, where, memory, cost]


def _describe(plan: ShardingPlan, max_ranks: int = 0) -> str:
    world, budget = plan.world_size, plan.memory_per_rank
    used, num_shards, states = [0] * world, [0] * world, set()
    table_lines = [["collection", "table", "rows x dim", "dtype", "sharding", "ranks"]]
    table_lines[0] += ["memory/shard", "est. cost"]
    peak = max(plan.rank_costs, default=0.0) or 1.0
    for path, shardings in plan.collections.items():
        for name, sharding in shardings.items():
            footprint = plan.footprints.get(path, {}).get(name)
            if footprint is None:  # hand-built
                sizes = tuple(shard_bytes(s, 4, {}) for s in sharding.shards)
                footprint = TableFootprint("fp32?", "", sizes)
            states.add(footprint.optimizer_state)
            for shard, size in zip(sharding.shards, footprint.shard_bytes, strict=True):
                used[shard.rank] += size
                num_shards[shard.rank] += 1
            table_lines.append(_table_line(path, name, sharding, footprint, peak))
    rank_lines = [["rank", "shards", "memory", "of memory_per_rank", "est. cost (busiest = 1)"]]
    for rank in range(world):
        share = f"{used[rank] / budget:.1%}" if budget else "-"
        cost = f"{plan.rank_costs[rank] / peak:.2f}" if plan.rank_costs else "-"
        memory = format_bytes(used[rank])
        rank_lines.append([str(rank), str(num_shards[rank]), memory, share, cost])
    if 0 < max_ranks < world:
        rest = range(max_ranks, world)
        low, high = (format_bytes(f(used[r] for r in rest)) for f in (min, max))
        shards = f"{min(num_shards[r] for r in rest)}..{max(num_shards[r] for r in rest)}"
        rank_lines = rank_lines[: max_ranks + 1]
        rank_lines.append([f"{max_ranks}-{world - 1}", shards, f"{low}..{high}", "", ""])
    limit = format_bytes(budget) if budget else "not set"
    header = [f"ShardingPlan for {world} rank{'s' * (world > 1)}, memory_per_rank {limit}"]
    if plan.rank_costs:
        header.append(
            "est. cost: per step, of a table (over its ranks) or a rank; busiest rank = 1"
        )
    if not plan.footprints:
        header.append("hand-built plan: memory assumes fp32 weights (fp32?) and no optimizer state")
    elif states - {""}:
        header.append(f"memory includes optimizer state: {', '.join(sorted(states - {''}))}")
    if any(
        ShardingType(t.sharding_type) == ShardingType.KEY_WISE
        for shardings in plan.collections.values()
        for t in shardings.values()
    ):
        header.append(
            "KEY_WISE: dynamic tables, keys hashed into routing buckets, each rank an even range; "
            "rows = the table's cap (uncapped: its initial rows)"
        )
    if any(f.cache_rows for footprints in plan.footprints.values() for f in footprints.values()):
        header.append(
            "tiered: rows in host memory or on disk (model.storage); memory = each shard's cache"
        )
    return "\n".join([*header, "", *_text_table(table_lines), "", *_text_table(rank_lines)])
