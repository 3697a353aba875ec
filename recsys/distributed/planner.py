"""The planner: where each table of each EmbeddingBagCollection goes, from table sizes, dims,
pooling factors, optimizer state, world size and per-rank memory, within user constraints
(:class:`TableConstraint`, :func:`parse_constraints`). :func:`plan_sharding` documents its cost
model. The plan types and hand-plan helpers live in :mod:`recsys.distributed.plan` and are
re-exported here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from torchrec import EmbeddingBagConfig

from recsys._suggest import did_you_mean, quoted_with_hints
from recsys.distributed.plan import (
    Shard,
    ShardingPlan,
    ShardingType,
    TableFootprint,
    TableSharding,
    check_plan,
    check_table_sharding,
    column_wise,
    data_parallel,
    format_bytes,
    key_wise,
    row_block,
    row_wise,
    shard_bytes,
    table_wise,
)
from recsys.distributed.step_cost import StepInputs, table_rank_seconds
from recsys.distributed.topology import Topology
from recsys.embedding.tables import TABLE_DTYPES, element_bytes

__all__ = [
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TableConstraint",
    "TableFootprint",
    "TableSharding",
    "check_plan",
    "check_table_sharding",
    "column_wise",
    "data_parallel",
    "key_wise",
    "parse_constraints",
    "plan_sharding",
    "row_block",
    "row_wise",
    "table_wise",
]


# ---------------------------------------------------------------------------------------------
# Constraints

_CONSTRAINT_FORM = "<table>=<type>[@<rank>[,<rank>...]]"
_CONSTRAINT_RE = re.compile(r"\s*([^=\s]+)\s*=\s*(\w+)\s*(?:@\s*(\d+(?:\s*,\s*\d+)*))?\s*")


def _sharding_type(value: str | ShardingType) -> ShardingType:
    """``value`` as a ShardingType: its lower-case value or its upper-case name."""
    if isinstance(value, ShardingType):
        return value
    by_text = {t.value: t for t in ShardingType} | {t.name: t for t in ShardingType}
    if value not in by_text:
        valid = [t.value for t in ShardingType]
        hint = did_you_mean(value.lower(), valid)
        raise ValueError(f"unknown sharding type {value!r}{hint}; expected one of {valid}")
    return by_text[value]


@dataclass(frozen=True)
class TableConstraint:
    """What the user allows for one table; the planner chooses within it.

    Attributes:
        sharding_types: allowed sharding types (strings are accepted); empty = any.
        ranks: for TABLE_WISE, the ranks it may go to; for COLUMN_WISE, exactly the ranks of
            its column shards, in column order; empty = the planner picks.

    Example:
        >>> str(TableConstraint(("column_wise",), ranks=(0, 1)))
        'column_wise@0,1'
    """

    sharding_types: tuple[ShardingType, ...] = ()
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = self.sharding_types
        types = tuple(_sharding_type(t) for t in ((given,) if isinstance(given, str) else given))
        object.__setattr__(self, "sharding_types", types)
        object.__setattr__(self, "ranks", tuple(self.ranks))
        ranks = self.ranks
        if any(not isinstance(r, int) or r < 0 for r in ranks) or len(set(ranks)) < len(ranks):
            raise ValueError(f"constraint '{self}': ranks {ranks} must be distinct ints >= 0")
        if ranks and not {ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE} & set(types):
            raise ValueError(
                f"constraint '{self}': ranks need sharding type table_wise or column_wise; "
                f"{[t.value for t in types] or 'any type'} may use every rank"
            )

    def __str__(self) -> str:
        text = "|".join(t.value for t in self.sharding_types) or "any"
        return text + (f"@{','.join(map(str, self.ranks))}" if self.ranks else "")


def parse_constraints(items: Sequence[str]) -> dict[str, TableConstraint]:
    """Parse constraints written ``"<table>=<type>[@<rank>[,<rank>...]]"``.

    Args:
        items: one string per table. ``<table>`` is a table name (that table in every
            collection) or ``"<module path>:<table>"``; ``<type>`` a :class:`ShardingType`
            value (``row_wise``) or name (``ROW_WISE``); ranks as in :class:`TableConstraint`.

    Returns:
        table key -> constraint, for :func:`plan_sharding`.

    Example:
        >>> parse_constraints(["t_C2=table_wise@1", "t_C3=column_wise@0,1"])["t_C3"].ranks
        (0, 1)
    """
    constraints: dict[str, TableConstraint] = {}
    for item in items:
        match = _CONSTRAINT_RE.fullmatch(item)
        if match is None:
            raise ValueError(
                f"sharding constraint {item!r} is malformed; expected {_CONSTRAINT_FORM}"
            )
        table, kind, ranks = match.groups()
        if table in constraints:
            raise ValueError(f"sharding constraint {item!r}: table {table!r} is constrained twice")
        try:
            ranks = tuple(int(r) for r in ranks.split(",")) if ranks else ()
            constraints[table] = TableConstraint((_sharding_type(kind),), ranks)
        except ValueError as error:
            raise ValueError(f"sharding constraint {item!r}: {error}") from None
    return constraints


# ---------------------------------------------------------------------------------------------
# Sizes and the cost model

_ID_BYTES = 8
# A communicated byte costs as much as this many bytes read from memory: a GPU reads its own
# memory about 10x faster than it exchanges data with other ranks.
_COMM_WEIGHT = 10.0


@dataclass(frozen=True)
class _Table:
    path: str
    config: EmbeddingBagConfig
    element_bytes: int
    pooling: float  # mean ids per sample, summed over the table's features
    constraint: TableConstraint
    dynamic: bool = False  # keyed by raw ids: KEY_WISE, ``rows`` its cap
    rows: int = 0  # rows to budget: num_embeddings, or a dynamic table's cap
    cache_rows: int = 0  # a tiered table's cache rows per shard (0: not tiered)

    def held(self, shard: Shard) -> Shard:
        """What ``shard`` keeps in the device's memory: a tiered table's cache (and its spare
        row), else the shard."""
        if not self.cache_rows:
            return shard
        # A dynamic table's part caches cache_rows whatever its share of the table.
        rows = self.cache_rows + 1 if self.dynamic else min(shard.num_rows, self.cache_rows + 1)
        return replace(shard, num_rows=rows)

    @property
    def label(self) -> str:
        return f"{self.path}:{self.config.name}" if self.path else self.config.name

    def whole(self) -> Shard:
        return Shard(0, 0, self.rows, 0, self.config.embedding_dim)


def _rank_bytes(sharding: TableSharding, table: _Table, states: dict[str, str], world: int):
    used = [0] * world
    for shard in sharding.shards:
        used[shard.rank] += shard_bytes(table.held(shard), table.element_bytes, states)
    return used


@dataclass(frozen=True)
class _CostModel:
    world_size: int
    batch_size: int
    forward_comm_bytes: int
    backward_comm_bytes: int

    def rank_costs(self, sharding: TableSharding, table: _Table) -> list[float]:
        """Each rank's cost per step of placing ``table`` as ``sharding`` (see plan_sharding)."""
        world, local, pooling = self.world_size, self.batch_size, table.pooling
        batch, rows, dim = local * world, table.rows, table.config.embedding_dim
        comm = _COMM_WEIGHT * (world - 1) / world  # a rank's traffic to itself is free
        costs = [0.0] * world
        if sharding.sharding_type == ShardingType.DATA_PARALLEL:
            for shard in sharding.shards:  # ring all-reduce: sends and receives 2x the gradient
                costs[shard.rank] += local * pooling * dim * table.element_bytes
                costs[shard.rank] += comm * 4 * rows * dim * 4
            return costs
        vector_bytes = self.forward_comm_bytes + self.backward_comm_bytes
        for shard in sharding.shards:
            ids = batch * pooling * shard.num_rows / max(rows, 1)  # the ids this shard serves
            costs[shard.rank] += ids * shard.num_cols * table.element_bytes
            costs[shard.rank] += comm * (ids * _ID_BYTES + batch * shard.num_cols * vector_bytes)
        # Every rank, for its own samples: sends their ids (to every column shard), receives
        # their pooled vectors (a partial sum from every row shard), sends back the gradients.
        kind, num_shards = sharding.sharding_type, len(sharding.shards)
        id_copies = num_shards if kind == ShardingType.COLUMN_WISE else 1
        vector_copies = num_shards if kind in (ShardingType.ROW_WISE, ShardingType.KEY_WISE) else 1
        for rank in range(world):
            costs[rank] += comm * local * pooling * id_copies * _ID_BYTES
            costs[rank] += comm * local * dim * vector_copies * vector_bytes
        return costs

    def whole_cost(self, table: _Table) -> float:
        """Cost of the table TABLE_WISE, summed over ranks."""
        return sum(self.rank_costs(TableSharding(ShardingType.TABLE_WISE, (table.whole(),)), table))


@dataclass(frozen=True)
class _SecondsModel:
    """The cost of a placement in predicted seconds per step on a topology
    (:func:`recsys.distributed.step_cost.table_rank_seconds`)."""

    world_size: int
    inputs: StepInputs
    topology: Topology

    def rank_costs(self, sharding: TableSharding, table: _Table) -> list[float]:
        args = (table.pooling, self.inputs, self.topology, self.world_size)
        return table_rank_seconds(table.config, sharding, *args)

    def whole_cost(self, table: _Table) -> float:
        return math.fsum(
            self.rank_costs(TableSharding(ShardingType.TABLE_WISE, (table.whole(),)), table)
        )


# ---------------------------------------------------------------------------------------------
# The planner


def _column_widths(dim: int, pieces: int) -> list[int]:
    """Widths of ``pieces`` column shards: multiples of 4 (the rest on the last) if possible."""
    unit = 4 if dim >= 4 * pieces else 1
    base, extra = divmod(dim // unit, pieces)
    widths = [unit * (base + (1 if i < extra else 0)) for i in range(pieces)]
    widths[-1] += dim % unit
    return widths


@dataclass
class _Ranks:
    """What is placed so far: bytes and estimated cost per rank; ``budget`` 0 = no limit;
    ``unplaced``: the cost of the tables still to place, each as if TABLE_WISE."""

    used: list[int]
    costs: list[float]
    budget: int
    unplaced: float = 0.0

    def free(self, rank: int) -> float:
        return self.budget - self.used[rank] if self.budget else math.inf


def _column_candidates(table: _Table, ranks: _Ranks, states: dict[str, str]):
    """COLUMN_WISE on exactly the constraint's ranks, or over 2..min(world, dim // 4) ranks with
    the widest pieces on the least-loaded ranks that can hold them."""
    rows, dim, world = table.rows, table.config.embedding_dim, len(ranks.used)
    if table.constraint.ranks:
        pieces = len(table.constraint.ranks)
        yield column_wise(rows, dim, table.constraint.ranks, _column_widths(dim, pieces))
        return
    for pieces in range(2, min(world, dim // 4 if dim >= 8 else dim) + 1):
        widths = _column_widths(dim, pieces)
        widest = shard_bytes(Shard(0, 0, rows, 0, widths[0]), table.element_bytes, states)
        order = sorted(
            range(world), key=lambda r: (ranks.free(r) < widest, ranks.costs[r], ranks.used[r], r)
        )
        yield column_wise(rows, dim, order[:pieces], widths)


# Up to this many ranks every rank is a TABLE_WISE candidate; past it only the cheapest rank
# that fits (see _whole_table_ranks).
_ALL_RANKS_UP_TO = 64


def _whole_table_ranks(table: _Table, ranks: _Ranks, states: dict[str, str]) -> Sequence[int]:
    """The ranks to try the table whole on: the constraint's, else every rank, or past
    ``_ALL_RANKS_UP_TO`` ranks the one of least cost (then lowest index) that can hold it: a
    whole table adds the same cost to its rank wherever it goes (and the same to every other),
    so that rank scores lowest on the busiest rank and the spread alike; one evaluation
    instead of W, for thousands of ranks."""
    world = len(ranks.used)
    if table.constraint.ranks or world <= _ALL_RANKS_UP_TO:
        return table.constraint.ranks or range(world)
    need = shard_bytes(table.held(table.whole()), table.element_bytes, states)
    fits = [r for r in range(world) if ranks.free(r) >= need]
    return [min(fits, key=lambda r: (ranks.costs[r], r))] if fits else []


def _candidates(table: _Table, ranks: _Ranks, states: dict[str, str]) -> list[TableSharding]:
    """Every placement the table's constraint allows, in a fixed order."""
    rows, dim, world = table.rows, table.config.embedding_dim, len(ranks.used)
    allowed = table.constraint.sharding_types
    if table.dynamic:  # any key may come from any rank: hashed over all of them
        return [key_wise(rows, dim, range(world))]
    if world == 1 and not allowed:
        return [table_wise(rows, dim, 0)]
    candidates: list[TableSharding] = []
    for kind in allowed or ShardingType:
        if kind == ShardingType.DATA_PARALLEL:
            candidates.append(data_parallel(rows, dim, world))
        elif kind == ShardingType.TABLE_WISE:
            candidates += [
                table_wise(rows, dim, r) for r in _whole_table_ranks(table, ranks, states)
            ]
        elif kind == ShardingType.ROW_WISE:
            candidates.append(row_wise(rows, dim, world))
        elif kind == ShardingType.KEY_WISE:
            continue  # dynamic tables only
        elif "row" not in states.values():
            # Per-row optimizer state cannot be shared by column shards (the sharded
            # collection refuses it), so COLUMN_WISE is only a candidate without it.
            candidates += _column_candidates(table, ranks, states)
    return candidates


def _state_label(states: dict[str, str]) -> str:
    return ", ".join(f"{name} per {kind}" for name, kind in states.items())


def _not_fit_error(
    table: _Table, candidates: list[TableSharding], ranks: _Ranks, states: dict[str, str]
) -> ValueError:
    """The error for a table that no candidate fits: its size, each rank's free memory, and
    what the placement that comes closest lacks."""
    config, world, constraint = table.config, len(ranks.used), table.constraint
    size = format_bytes(shard_bytes(table.whole(), table.element_bytes, states))
    state = f" + {_state_label(states)}" if states else ""
    what = f"table '{table.label}' ({table.rows} x {config.embedding_dim} "
    what += f"{config.data_type.name.lower()}{state}, {size})"
    where = f" under its constraint '{constraint}'" if constraint.sharding_types else ""
    if not candidates:
        why = ""
        column_wise = ShardingType.COLUMN_WISE in constraint.sharding_types
        if column_wise and world > 1 and "row" in states.values():
            why = (
                f": COLUMN_WISE is impossible with per-row optimizer state ({_state_label(states)}"
                ", e.g. rowwise_adagrad), since one accumulator per row cannot be split across "
                "column shards; allow table_wise or row_wise for it, or use an optimizer with "
                "per-element state (sgd, adagrad, adam)"
            )
        return ValueError(f"{what} has no placement{where} on {world} ranks{why}")
    shortfalls = []  # (bytes missing, rank, candidate index)
    for index, sharding in enumerate(candidates):
        need = _rank_bytes(sharding, table, states, world)
        shortfalls.append(max((need[r] - ranks.free(r), r, index) for r in range(world)))
    missing, rank, index = min(shortfalls)
    best, free = candidates[index], ", ".join(format_bytes(ranks.free(r)) for r in range(world))
    return ValueError(
        f"{what} does not fit{where}: memory_per_rank is {format_bytes(ranks.budget)} and the "
        f"ranks have [{free}] free; the closest placement, {best.sharding_type.name} on ranks "
        f"{best.ranks}, lacks {format_bytes(missing)} ({missing} bytes) on rank {rank}; "
        f"{'relax the constraint, ' if where else ''}raise memory_per_rank or add ranks"
    )


def _place(table: _Table, ranks: _Ranks, model: _CostModel | _SecondsModel, states: dict[str, str]):
    """The allowed placement that fits and scores lowest, added to ``ranks``."""
    candidates, world = _candidates(table, ranks, states), len(ranks.used)
    best = None
    for index, sharding in enumerate(candidates):
        need = _rank_bytes(sharding, table, states, world)
        if any(need[r] > ranks.free(r) for r in range(world)):
            continue
        added = model.rank_costs(sharding, table)
        after = [cost + extra for cost, extra in zip(ranks.costs, added, strict=True)]
        # The busiest rank ends at least at the average of all work, this table's and the rest;
        # below that, the more even spread wins. fsum: the same sum in any order.
        total = math.fsum(added)
        floor = (math.fsum(ranks.costs) + total + ranks.unplaced) / world
        spread = math.fsum(cost * cost for cost in after)
        score = (max(max(after), floor) + total / world, spread, index)
        if best is None or score < best[0]:
            best = (score, sharding, need, added)
    if best is None:
        raise _not_fit_error(table, candidates, ranks, states)
    _, sharding, need, added = best
    for rank in range(world):
        ranks.used[rank] += need[rank]
        ranks.costs[rank] += added[rank]
    return sharding, math.fsum(added)


def _check_known(owner: str, kind: str, names: Iterable[str], known: set[str]) -> None:
    unknown = sorted(set(names) - known)
    if unknown:
        hints = quoted_with_hints(unknown, known)
        raise ValueError(f"{owner} name unknown {kind} {hints}; the {kind} are {sorted(known)}")


def _table(
    path: str,
    config: EmbeddingBagConfig,
    pooling_factors: dict[str, float],
    constraints: dict[str, TableConstraint],
    world: int,
    dynamic_rows: dict[str, int],
    tiered_rows: dict[str, int],
) -> _Table:
    """``config`` with its element size, pooling factor, (checked) constraint and, for a
    dynamic table, its cap; for a tiered one, its cache rows (and TABLE_WISE or ROW_WISE)."""
    if config.data_type not in TABLE_DTYPES:
        valid = [t.name for t in TABLE_DTYPES]
        raise ValueError(f"table '{config.name}': data_type {config.data_type.name} not in {valid}")
    constraint = constraints.get(f"{path}:{config.name}", constraints.get(config.name))
    constraint, dim = constraint or TableConstraint(), config.embedding_dim
    pooling = sum(pooling_factors.get(f, 1.0) for f in config.feature_names)
    label = f"{path}:{config.name}" if path else config.name
    cap = dynamic_rows.get(label, dynamic_rows.get(config.name))
    rows = cap or config.num_embeddings
    cache = tiered_rows.get(label, tiered_rows.get(config.name, 0))
    where = f"table '{label}' constraint '{constraint}'"
    if cache and cap is None:
        allowed = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
        if set(constraint.sharding_types) - set(allowed):
            raise ValueError(f"{where}: a tiered table (host or disk) is table_wise or row_wise")
        constraint = replace(constraint, sharding_types=constraint.sharding_types or allowed)
    table = _Table(
        path, config, element_bytes(config), pooling, constraint, cap is not None, rows, cache
    )
    ranks, kinds = constraint.ranks, constraint.sharding_types
    if table.dynamic and kinds and ShardingType.KEY_WISE not in kinds:
        raise ValueError(f"{where}: a dynamic table (raw ids) is sharded KEY_WISE only")
    if not table.dynamic and ShardingType.KEY_WISE in kinds:
        raise ValueError(f"{where}: KEY_WISE is for dynamic tables (raw ids) only")
    if any(r >= world for r in ranks):
        raise ValueError(f"{where}: ranks {ranks} must be < world_size {world}")
    if len(ranks) > dim and ShardingType.COLUMN_WISE in constraint.sharding_types:
        raise ValueError(f"{where}: {len(ranks)} column shards of a table with {dim} columns")
    return table


def plan_sharding(
    collections: dict[str, Sequence[EmbeddingBagConfig]],
    world_size: int,
    *,
    memory_per_rank: int = 0,
    optimizer_states: dict[str, str] | None = None,
    batch_size: int = 1024,
    pooling_factors: dict[str, float] | None = None,
    constraints: dict[str, TableConstraint] | None = None,
    forward_comm_bytes: int = 4,
    backward_comm_bytes: int = 4,
    dynamic_rows: dict[str, int] | None = None,
    tiered_rows: dict[str, int] | None = None,
    topology: Topology | None = None,
) -> ShardingPlan:
    """Place every table on ``world_size`` ranks within ``memory_per_rank``, balancing an
    estimated per-rank cost.

    Greedy and deterministic. Tables go largest first (by the larger of their shares of all
    bytes and of all estimated cost; ties by path and name), each to the placement that its
    constraint allows, that fits the memory left, and that scores lowest: the busiest rank's
    cost afterwards (never counted below the average rank's final cost, which later tables can
    fill up to) plus the placement's own cost averaged over the ranks. The first term balances
    the ranks; the second charges for total work, so a replicated table must be cheap
    everywhere to win. Ties go to the more even spread (sum of squared rank costs), then to
    the earlier candidate: DATA_PARALLEL, TABLE_WISE on rank 0, 1, ..., ROW_WISE, COLUMN_WISE
    in 2..min(W, D // 4) pieces of multiples of 4 columns. A world of one puts unconstrained
    tables TABLE_WISE on rank 0.

    With a ``topology`` the cost of a placement is each rank's predicted seconds per step on
    that cluster (:func:`recsys.distributed.step_cost.table_rank_seconds`: lookups and updates
    over the memory bandwidth, all-to-all bytes over the intra- and inter-node links, a
    replicated table's gradient all-gather), so the plan minimises the predicted step under
    the memory limit. Without one it is the byte count below.

    Cost model without a topology, per rank per step, in bytes moved; a communicated byte
    counts 10x a byte read from memory, and traffic to the rank itself is free (communication
    scales by (W - 1) / W).
    With W ranks, B = ``batch_size``, G = B * W, P the table's pooling factor, R x D elements
    of e bytes: DATA_PARALLEL costs every rank a lookup of B * P * D * e plus a ring
    all-reduce of the fp32 gradient, 4 * R * D * 4 (2x the table each way). That is an upper
    bound of what a replicated table with a fused optimizer moves, since it exchanges only its
    touched rows and their gradients (:mod:`recsys.distributed.replicated`); a torch optimizer's
    replicated table is all-reduced whole, by DDP. A shard with r
    rows and c columns costs its rank a lookup of G * P * r / R * c * e, receiving those ids
    (8 bytes each), sending G pooled c-vectors and receiving their gradients
    (``forward_comm_bytes`` and ``backward_comm_bytes`` per value). TABLE_WISE is one whole
    shard, ROW_WISE W row blocks that each send a partial sum for every sample, COLUMN_WISE k
    pieces that each receive every id. And every rank, for its own B samples of a sharded
    table, sends their ids (to each column piece), receives the pooled vectors (from each row
    block), and sends back their gradients.

    Args:
        collections: module path -> the collection's table configs (FP32, FP16 or BF16).
        world_size: number of ranks.
        memory_per_rank: bytes each rank may hold in weights and optimizer state; 0 = no limit.
        optimizer_states: the fused optimizer's ``states`` (name -> ``"row"``: one fp32 per
            row, or ``"element"``: one fp32 per weight), e.g. ``RowWiseAdagrad.states``.
        batch_size: samples per rank per step.
        pooling_factors: feature name -> mean ids per bag (default 1.0); a table's pooling
            factor is the sum over its features.
        constraints: table name (that table in every collection) or ``"<module path>:<table>"``
            -> :class:`TableConstraint` (see :func:`parse_constraints`).
        forward_comm_bytes: bytes per value of the pooled embeddings sent in forward.
        backward_comm_bytes: bytes per value of their gradients sent in backward.
        dynamic_rows: the dynamic tables (keyed by raw ids; name or ``"<path>:<table>"``) ->
            the most rows each may hold (0: no cap, its ``num_embeddings`` is budgeted). A
            dynamic table is KEY_WISE over every rank, each budgeted its share of the cap;
            it costs like a ROW_WISE table.
        tiered_rows: the tiered tables (``model.storage``: rows in host memory or on disk;
            name or ``"<path>:<table>"``) -> the rows of each shard's cache, which is all a
            shard keeps in the device's memory. A fixed tiered table is TABLE_WISE or
            ROW_WISE, a dynamic one KEY_WISE.
        topology: the cluster (:mod:`recsys.distributed.topology`): costs in predicted
            seconds; None: in weighted bytes.

    Returns:
        a plan that passes :func:`check_plan`, with sizes and costs for ``describe()``.

    Raises:
        ValueError: a bad argument, an unknown table or feature, or a table that does not fit
            (naming it, its size, each rank's free memory and how much is missing).

    Examples:
        >>> tables = [EmbeddingBagConfig(name="t", num_embeddings=10**6, embedding_dim=64,
        ...                              feature_names=["f"])]
        >>> plan = plan_sharding({"": tables}, world_size=2, memory_per_rank=2**27)
        >>> plan[""]["t"].sharding_type.name
        'COLUMN_WISE'
    """
    states, pooling_factors = dict(optimizer_states or {}), pooling_factors or {}
    comm_bytes = (forward_comm_bytes, backward_comm_bytes)
    if min(world_size, batch_size, *comm_bytes) < 1 or memory_per_rank < 0:
        raise ValueError(
            f"world_size={world_size}, batch_size={batch_size} and forward/backward_comm_bytes="
            f"{comm_bytes} must be >= 1, memory_per_rank={memory_per_rank} >= 0"
        )
    if any(kind not in ("row", "element") for kind in states.values()):
        raise ValueError(f"optimizer_states={states}: each value must be 'row' or 'element'")
    if any(not value >= 0 for value in pooling_factors.values()):
        raise ValueError(f"pooling_factors={pooling_factors}: each value must be >= 0")
    constraints, configs = constraints or {}, [(p, c) for p, g in collections.items() for c in g]
    features = {f for _, config in configs for f in config.feature_names}
    _check_known("pooling_factors", "features", pooling_factors, features)
    names = {c.name for _, c in configs} | {f"{p}:{c.name}" for p, c in configs if p}
    _check_known("sharding constraints", "tables", constraints, names)
    dynamic_rows = dynamic_rows or {}
    _check_known("dynamic_rows", "tables", dynamic_rows, names)
    tiered_rows = tiered_rows or {}
    _check_known("tiered_rows", "tables", tiered_rows, names)
    tables = [
        _table(p, c, pooling_factors, constraints, world_size, dynamic_rows, tiered_rows)
        for p, c in configs
    ]
    model: _CostModel | _SecondsModel = _CostModel(world_size, batch_size, *comm_bytes)
    if topology is not None:
        wire = {4: "fp32", 2: "bf16", 1: "int8"}
        if any(b not in wire for b in comm_bytes):
            raise ValueError(f"forward/backward_comm_bytes={comm_bytes}: expected 4, 2 or 1")
        inputs = StepInputs(batch_size, {}, states, *(wire[b] for b in comm_bytes))
        model = _SecondsModel(world_size, inputs, topology)
    ranks = _Ranks([0] * world_size, [0.0] * world_size, memory_per_rank)

    whole_costs = [model.whole_cost(t) for t in tables]
    whole_bytes = [shard_bytes(t.held(t.whole()), t.element_bytes, states) for t in tables]
    total_cost, total_bytes = math.fsum(whole_costs) or 1.0, sum(whole_bytes) or 1

    def largest_first(i: int) -> tuple:  # by the larger of its shares of all bytes and all cost
        share = max(whole_bytes[i] / total_bytes, whole_costs[i] / total_cost)
        return (-share, tables[i].path, tables[i].config.name)

    placed, ranks.unplaced = {}, math.fsum(whole_costs)
    for i in sorted(range(len(tables)), key=largest_first):
        table, ranks.unplaced = tables[i], ranks.unplaced - whole_costs[i]
        sharding, cost = _place(table, ranks, model, states)
        sizes = tuple(
            shard_bytes(table.held(s), table.element_bytes, states) for s in sharding.shards
        )
        dtype, state = table.config.data_type.name.lower(), _state_label(states)
        footprint = TableFootprint(dtype, state, sizes, table.cache_rows, cost)
        placed[table.path, table.config.name] = sharding, footprint
    plan = ShardingPlan(world_size, memory_per_rank=memory_per_rank, rank_costs=ranks.costs)
    for path, group in collections.items():  # in the caller's order, for describe()
        plan.collections[path] = {c.name: placed[path, c.name][0] for c in group}
        plan.footprints[path] = {c.name: placed[path, c.name][1] for c in group}
    return plan
