"""The step cost model: what one training step of a sharded model holds, moves and costs on
each rank, in bytes and in seconds, from a :class:`~recsys.distributed.plan.ShardingPlan`, the
tables, the batch and a :class:`~recsys.distributed.topology.Topology`. ``recsys plan`` prints
it; it is a model, not a measurement.

**Flat and 2D.** A flat plan places tables over all W ranks: every sharded table's all-to-alls
span them all. A 2D plan (``replicas`` = R > 1, TorchRec's 2D sparse parallelism) places them
over a group of G = W / R consecutive ranks (a node, by default) and replicates the group: the
all-to-alls stay inside a group, and every ``sync_every`` steps each shard's weights and
optimizer state are averaged with the same shard of the other R - 1 groups (an all-reduce
across groups).

**Bytes** per rank per step, as the sharded collection hands them to its collectives (its own
block included; :class:`~recsys.distributed.comm.CommStats`), by kind and by where they go
(``intra``: a rank of the same node, the rank itself included; ``inter``: another node):

- ``input``: the counts exchange (W x (2 + slots + extras) int64, where a destination's slots
  are its (feature, shard) pairs; with a fused update, replicated tables add a row count per
  dim group and, up to 2**22 rows, a bitmap of their rows, 63 to an int64), then to each
  destination, per slot, the B bag lengths and the ids that shard owns (int64; a ROW_WISE or
  KEY_WISE shard of r of R rows gets r / R of a feature's ids, an even spread of ids over
  rows; TABLE_WISE and COLUMN_WISE pieces all of them).
- ``forward``: each shard's pooled vectors for every rank's B samples (its columns for each of
  the table's features, at the forward precision; int8 adds a 4-byte scale per sample and
  destination).
- ``backward``: the gradients of a rank's own samples' pooled vectors, to each shard (at the
  backward precision); a replicated (DATA_PARALLEL) table's touched rows' gradients and keys
  (an all-gather over the group: the expected distinct rows of B * P draws, see below).
- ``dense``: the DDP all-reduce of the dense gradients (a ring: 2 (W - 1) / W of them).
- ``replica_sync`` (2D): per step, 1 / ``sync_every`` of a ring all-reduce of the rank's shards
  (weights and fused-optimizer state) across the R groups.

**Seconds**, the busiest rank of each part (the parts run one after another, so the step is
their sum, less what overlaps):

- ``data``: making the rank's batch (``StepInputs.input_s``, timed on the host ``recsys plan``
  runs on, times the topology's ``host_share``: ranks that share CPU cores make theirs more
  slowly): all of it when the trainer makes its batches inside the step (no loader workers,
  nothing prefetched: a CPU run's default where a rank has fewer than 2 CPUs), else only what
  exceeds the rest of the step.
- ``compute``: where the topology is a calibration of CPU hosts and ``recsys plan`` runs on one
  of them, the ranks' step less its collectives timed there, each rank with its peers mirrored
  and the slowest between each two collectives (``StepInputs.compute_s``,
  :mod:`recsys.train.rank_timing`), times ``host_share``; it then stands for ``lookup``,
  ``dense`` and ``update``, and for ``data`` when the batches are made inside the step.
- ``lookup``: the ids a rank's shards serve (G * B * P of them for a table, times the shard's
  share), each reading a row of its columns, over the device's memory bandwidth.
- ``input_dist`` / ``output_dist`` / ``grad_dist``: an all-to-all costs the topology's latency
  plus, of the bytes a rank sends and receives to other ranks (its own block is a copy),
  the larger of the intra-node part over the intra-node bandwidth and the inter-node part over
  the inter-node bandwidth (the two links run at once, each full duplex). The input dist is
  two all-to-alls, a latency each: the counts, then the ids they size. Each collective a rank
  waits on also costs the topology's ``sync_wait_us`` (ranks that share cores reach it at
  different times; 0 on a preset). With
  ``pipeline`` the input dist of the next batch runs behind this one's forward: only what
  exceeds the dense forward counts.
- ``update``: the fused optimizer reading each id's gradient, then reading and writing each
  distinct row and its state once.
- ``dense``: the ops of the dense part's forward, loss, backward and optimizer step as traced
  on ``meta`` (``StepInputs.dense_trace``, :mod:`recsys.distributed.op_trace`), one after
  another, each the larger of the topology's per-op floor (``op_us``) and its roofline time:
  its flops over the dense throughput in the training precision (IEEE fp32, or a GPU's bf16 /
  fp16 tensor-core rate) plus the bytes it reads and writes over the memory bandwidth. Without
  a trace, 6 flops per dense parameter per sample (forward 2, backward 4) over that throughput.
- ``allreduce``: the dense gradients' ring all-reduce (over the inter-node bandwidth once the
  world spans nodes), plus 2 log2(W) latencies; DDP overlaps it with the dense backward, so
  only what exceeds that counts, and a ``sync_wait_us`` where the ranks meet at its end.
  Replicated tables' all-gather adds its bytes, a latency and a wait, all of them: it runs in
  the embeddings' backward, after the dense part's.
- ``replica_sync``: 2D only, its all-reduce over the inter-node bandwidth (or the intra-node
  one when the groups share a node), amortised over ``sync_every`` steps.

**Distinct rows** a batch touches, in expectation: from the table's
:class:`~recsys.distributed.id_profiles.IdProfile` (``StepInputs.id_profiles``: the synthetic
log's power law, or the id frequencies of a sample of the data), else uniform draws (an upper
bound for skewed ids); a row shard holds its share of them. A replicated table's exchange is
sized by the largest count over ranks, which the expectation slightly undercounts.

What the model leaves out, unless a rank's compute is timed: the per-op and Python costs of the
embedding side (the input dist's bucketing, the exchanges' packing; they dominate small batches
on small tables, see ``benchmarks/results/scale.csv``). Always: the collectives' own host time,
a rank slower than the others by its shards (the busiest rank of each part is charged, but
the parts' busiest ranks may differ), congestion beyond one link per rank,
and skewed ids on row shards (a hot row's shard serves more than its share). A trace's bytes
are its tensors' sizes as traced (fp32 unless the model casts), all charged at the memory's
bandwidth, caches or not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torchrec import EmbeddingBagConfig

from recsys.distributed.comm import check_precision, wire_dtype
from recsys.distributed.id_profiles import IdProfile
from recsys.distributed.plan import (
    ShardingPlan,
    ShardingType,
    TableSharding,
    format_bytes,
    shard_bytes,
)
from recsys.distributed.replicated import counted_rows_width
from recsys.distributed.step_inputs import StepInputs, dense_bytes
from recsys.distributed.topology import Topology
from recsys.embedding.tables import element_bytes

__all__ = ["StepInputs", "StepPrediction", "dense_bytes", "predict_step", "table_rank_seconds"]

_PARTS = ("input", "forward", "backward", "dense", "replica_sync")


@dataclass
class StepPrediction:
    """One step on every rank, as :func:`predict_step` models it (see the module docstring).

    Attributes:
        world_size / replicas / group_size: W, R and G = W / R.
        table_bytes: [G] each rank's tables and fused-optimizer state (a 2D group's rank g and
            every replica of it hold the same).
        dense_bytes: each rank's dense parameters, gradients and optimizer state.
        sent: (part, "intra" | "inter") -> [W] bytes each rank sends per step (own block in
            ``intra``).
        seconds: part -> the busiest rank's seconds per step.
        step_s / samples_per_s: the predicted step and throughput (W * B samples a step).
        topology: the figures used.
        dense_precision: the training precision whose dense rate was charged.
    """

    world_size: int
    replicas: int
    group_size: int
    batch_size: int
    table_bytes: np.ndarray
    dense_bytes: int
    sent: dict[tuple[str, str], np.ndarray]
    seconds: dict[str, float]
    step_s: float
    topology: Topology
    dense_precision: str = "fp32"

    @property
    def samples_per_s(self) -> float:
        return self.world_size * self.batch_size / self.step_s

    def rank_bytes(self, part: str, where: str = "") -> np.ndarray:
        """[W] bytes each rank sends per step in ``part`` (``where`` "": intra + inter)."""
        if where:
            return self.sent[part, where]
        return self.sent[part, "intra"] + self.sent[part, "inter"]

    def describe(self) -> str:
        """The prediction as text: memory, bytes and seconds per rank per step."""
        kind = (
            "flat" if self.replicas == 1 else f"2D: {self.replicas} replicas of {self.group_size}"
        )
        tables = self.table_bytes
        memory = tables.max() + self.dense_bytes
        limit = self.topology.memory_gib * 2**30
        lines = [
            f"{self.world_size} ranks ({kind}), {self.batch_size} samples per rank, "
            f"{-(-self.world_size // self.topology.ranks_per_node)} node(s)",
            f"  memory per rank: tables + state {format_bytes(tables.max())} (mean "
            f"{format_bytes(tables.mean())}), dense + optimizer {format_bytes(self.dense_bytes)}"
            f"; {memory / limit:.1%} of {self.topology.memory_gib:g} GiB",
        ]
        for part in _PARTS:
            intra, inter = (self.sent[part, w] for w in ("intra", "inter"))
            if not (intra.any() or inter.any()):
                continue
            lines.append(
                f"  sent per rank per step, {part}: intra-node {format_bytes(intra.max())}, "
                f"inter-node {format_bytes(inter.max())} (busiest rank)"
            )
        parts = ", ".join(
            f"{name} {1e3 * value:.3f}" for name, value in self.seconds.items() if value
        )
        rate = self.topology.dense_rate(self.dense_precision)
        lines.append(
            f"  predicted ms per step: {parts} (dense in {self.dense_precision} at {rate:g} "
            "TFLOP/s)"
        )
        lines.append(
            f"  predicted step {1e3 * self.step_s:.3f} ms, {self.samples_per_s:,.0f} samples/s"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class _Placed:
    """A table of the plan, with what the cost model needs."""

    config: EmbeddingBagConfig
    kind: ShardingType
    ranks: np.ndarray  # [S] group ranks of the shards
    share: np.ndarray  # [S] each shard's share of the table's ids
    cols: np.ndarray  # [S] each shard's columns
    rows: np.ndarray  # [S]
    bytes: np.ndarray  # [S] weights + state
    pooling: float
    features: int
    profile: IdProfile | None = None  # how often each row is read; None: uniformly

    def distinct(self, served: np.ndarray) -> np.ndarray:
        """[S] distinct rows each shard's ``served`` ids touch, in expectation: uniform draws
        over the shard's rows, or with a profile the table's distinct rows of its
        ``served / share`` draws (the same for every shard) times the shard's share (a skewed
        table's hot rows spread evenly over its row shards)."""
        rows = np.maximum(self.rows, 1)
        if self.profile is None:
            spread = rows * -np.expm1(served * np.log1p(-1.0 / np.maximum(rows, 2)))
            return np.where(rows > 1, spread, (served > 0).astype(float))
        share = np.maximum(self.share, 1e-12)
        return self.profile.distinct(float(served[0] / share[0])) * share


def predict_step(
    plan: ShardingPlan,
    configs: dict[str, Sequence[EmbeddingBagConfig]],
    inputs: StepInputs,
    topology: Topology,
) -> StepPrediction:
    """Predict one step of ``plan`` (for W / ``inputs.replicas`` ranks) on ``topology``.

    Raises:
        ValueError: a replica count that does not divide the world, or a bad argument.
    """
    replicas, group = inputs.replicas, plan.world_size
    world = group * replicas
    if replicas < 1 or inputs.sync_every < 1 or inputs.batch_size < 1:
        raise ValueError(
            f"replicas={replicas}, sync_every={inputs.sync_every} and batch_size="
            f"{inputs.batch_size} must be >= 1"
        )
    check_precision(inputs.forward_precision, "forward_precision")
    check_precision(inputs.backward_precision, "backward_precision")
    placed = _placed_tables(plan, configs, inputs)
    cost = _Costs(world, group, inputs, topology)
    # A fused update's replicated tables send their row counts with the input dist's counts.
    cost.counted_rows = inputs.fused_update and any(
        t.kind != ShardingType.DATA_PARALLEL for t in placed
    )
    for table in placed:
        if table.kind == ShardingType.DATA_PARALLEL:
            cost.replicated(table)
        else:
            cost.sharded(table)
    cost.counts(placed)
    table_bytes = np.zeros(group, dtype=np.int64)
    for table in placed:
        np.add.at(table_bytes, table.ranks, table.bytes)
    cost.dense()
    if replicas > 1:
        cost.replica_sync(table_bytes)
    seconds = cost.seconds()
    seconds = {"data": _input_seconds(inputs, topology, math.fsum(seconds.values())), **seconds}
    sent = {(p, w): np.tile(v, replicas) for p, both in cost.sent.items() for w, v in both.items()}
    return StepPrediction(
        world, replicas, group, inputs.batch_size, table_bytes, inputs.dense_bytes, sent, seconds,
        math.fsum(seconds.values()), topology, inputs.dense_precision,
    )  # fmt: skip


def _input_seconds(inputs: StepInputs, topology: Topology, rest: float) -> float:
    """A rank's batch on the launch's hosts (``host_share`` times its time alone): all of it
    when made inside the step (none when the step was timed: it is in it), else only what
    exceeds the rest of the step."""
    made = inputs.input_s * topology.host_share
    if inputs.input_inline:
        return 0.0 if inputs.compute_s else made
    return max(0.0, made - rest)


def table_rank_seconds(
    config: EmbeddingBagConfig,
    sharding: TableSharding,
    pooling: float,
    inputs: StepInputs,
    topology: Topology,
    world: int,
) -> list[float]:
    """Each rank's seconds per step of ``config`` placed as ``sharding`` on a flat world: its
    lookups and updates over the memory bandwidth, and its share of each all-to-all (bytes to
    and from other ranks, intra- and inter-node links at once) or, replicated, of the
    gradients' all-gather. Latencies are left out (a collective's, shared by all its tables).
    The planner's cost per placement (:func:`~recsys.distributed.planner.plan_sharding` with a
    topology)."""
    profile = inputs.id_profiles.get(config.name)
    table = _placed(config, sharding, pooling, [0] * len(sharding.shards), profile)
    cost = _Costs(world, world, inputs, topology)
    if table.kind == ShardingType.DATA_PARALLEL:
        cost.replicated(table)
    else:
        cost.sharded(table)
    return cost.rank_seconds().tolist()


def _placed_tables(
    plan: ShardingPlan, configs: dict[str, Sequence[EmbeddingBagConfig]], inputs: StepInputs
) -> list[_Placed]:
    states, out = inputs.optimizer_states, []
    for path, group in configs.items():
        for config in group:
            sharding = plan[path][config.name]
            footprint = plan.footprints.get(path, {}).get(config.name)
            size = element_bytes(config)
            sizes = (
                footprint.shard_bytes
                if footprint is not None
                else [shard_bytes(s, size, states) for s in sharding.shards]
            )
            pooling = sum(inputs.pooling_factors.get(f, 1.0) for f in config.feature_names)
            profile = inputs.id_profiles.get(config.name)
            out.append(_placed(config, sharding, pooling, sizes, profile))
    return out


def _placed(
    config: EmbeddingBagConfig,
    sharding: TableSharding,
    pooling: float,
    sizes: Sequence[int],
    profile: IdProfile | None = None,
) -> _Placed:
    kind, shards = ShardingType(sharding.sharding_type), sharding.shards
    total_rows = max(s.row_offset + s.num_rows for s in shards) or 1
    by_rows = kind in (ShardingType.ROW_WISE, ShardingType.KEY_WISE)
    return _Placed(
        config,
        kind,
        np.array([s.rank for s in shards]),
        np.array([s.num_rows / total_rows if by_rows else 1.0 for s in shards]),
        np.array([s.num_cols for s in shards]),
        np.array([s.num_rows for s in shards]),
        np.array(sizes, dtype=np.int64),
        pooling,
        len(config.feature_names),
        profile,
    )


class _Costs:
    """Bytes and seconds accumulated table by table (see the module docstring), per rank of one
    group ([G] arrays; every replica of a group moves the same)."""

    def __init__(self, world: int, group: int, inputs: StepInputs, topology: Topology) -> None:
        self.world, self.group, self.inputs, self.topology = world, group, inputs, topology
        per_node = topology.ranks_per_node
        if world > group and group % per_node and per_node % group:
            raise ValueError(
                f"groups of {group} ranks on nodes of {per_node}: one must divide the other"
            )
        # Each group rank's node, counted inside the group, and each one's group ranks on it.
        self.node = np.arange(group) // per_node
        self.nodes = int(self.node[-1]) + 1
        self.per_node = np.bincount(self.node)[self.node]
        zeros = {w: np.zeros(group) for w in ("intra", "inter")}
        self.sent = {p: {w: v.copy() for w, v in zeros.items()} for p in _PARTS}
        # Bytes to and from the other ranks in each all-to-all, for its time.
        self.a2a = {p: {w: v.copy() for w, v in zeros.items()} for p in _PARTS[:3]}
        self.memory = np.zeros(group)  # bytes lookups read
        self.update = np.zeros(group)  # bytes the optimizer reads and writes
        self.gathered = 0.0  # replicated tables' all-gather bytes per rank (sent)
        self.counted_rows = False  # replicated row counts travel with the input dist's counts
        self.dense_s = self.allreduce_s = self.sync_s = 0.0
        self.wait = topology.sync_wait_us * 1e-6  # at each collective, for the other ranks

    def _split(self, amounts: np.ndarray, owners: np.ndarray):
        """Per group rank: what ``amounts`` [S] at ``owners`` [S] sum to (on that rank, on
        each node), and their total."""
        on_rank = np.bincount(owners, weights=amounts, minlength=self.group)
        on_node = np.bincount(self.node[owners], weights=amounts, minlength=self.nodes)
        return on_rank, on_node[self.node], float(amounts.sum())

    def gather(self, part: str, amounts: np.ndarray, owners: np.ndarray) -> None:
        """Every group rank sends ``amounts[s]`` bytes to the rank ``owners[s]``."""
        own, same_node, total = self._split(amounts, owners)
        m, g = self.per_node, self.group
        self.sent[part]["intra"] += same_node
        self.sent[part]["inter"] += total - same_node
        self.a2a[part]["intra"] += same_node - own + (m - 1) * own
        self.a2a[part]["inter"] += total - same_node + (g - m) * own

    def scatter(self, part: str, amounts: np.ndarray, owners: np.ndarray) -> None:
        """The rank ``owners[s]`` sends ``amounts[s]`` bytes to every group rank."""
        own, same_node, total = self._split(amounts, owners)
        m, g = self.per_node, self.group
        self.sent[part]["intra"] += m * own
        self.sent[part]["inter"] += (g - m) * own
        self.a2a[part]["intra"] += (m - 1) * own + same_node - own
        self.a2a[part]["inter"] += (g - m) * own + total - same_node

    def sharded(self, table: _Placed) -> None:
        b, inputs = self.inputs.batch_size, self.inputs
        ids = b * table.pooling * table.share  # ids a rank sends each shard
        self.gather("input", 8.0 * (table.features * b + ids), table.ranks)
        fwd = wire_dtype(inputs.forward_precision).itemsize
        bwd = wire_dtype(inputs.backward_precision).itemsize
        vectors = b * table.features * table.cols.astype(float)  # a vector per feature
        self.scatter("forward", vectors * fwd, table.ranks)
        self.gather("backward", vectors * bwd, table.ranks)
        # Each shard serves G * B * P * share ids: a lookup reads a row piece per id; the
        # update reads each id's gradient piece, then reads and writes each distinct row
        # piece and its state once.
        served = self.group * b * table.pooling * table.share
        size = element_bytes(table.config)
        kinds = list(inputs.optimizer_states.values())
        state = 4.0 * kinds.count("row") / np.maximum(table.cols, 1) + 4.0 * kinds.count("element")
        distinct = table.distinct(served)
        np.add.at(self.memory, table.ranks, served * table.cols * size)
        touched = served * table.cols * 4.0 + 2 * distinct * table.cols * (size + state)
        np.add.at(self.update, table.ranks, touched)

    def replicated(self, table: _Placed) -> None:
        b, dim = self.inputs.batch_size, table.config.embedding_dim
        draws = b * table.pooling
        distinct = float(table.distinct(np.full(len(table.rows), draws))[0])
        size = element_bytes(table.config)
        self.memory += draws * dim * size
        state = 4.0 * len(self.inputs.optimizer_states)  # at most one per element
        self.update += draws * dim * 4.0 + 2 * distinct * dim * (size + state)
        if self.group > 1:
            # Its rows: gradient + key; and, unless the input dist brought every rank's count
            # (a fused update), the count first.
            packed = (0.0 if self.counted_rows else 8.0) + distinct * (dim + 2) * 4
            self.gathered += packed
            # An all-gather over the group (2D: the replicas sync the table afterwards): one
            # block, for every rank of it.
            near = min(self.topology.ranks_per_node, self.group) / self.group
            self.sent["backward"]["intra"] += packed * near
            self.sent["backward"]["inter"] += packed * (1 - near)

    def counts(self, placed: list[_Placed]) -> None:
        """The counts exchange: to each destination 2 + its slots + extras int64; and int8's
        per-row scale: 4 bytes per sample, to and from each rank that holds a shard."""
        slots = np.zeros(self.group)
        for table in placed:
            if table.kind != ShardingType.DATA_PARALLEL:
                np.add.at(slots, table.ranks, table.features)
        if not slots.any():
            return
        owners = np.arange(self.group)
        extras = self.inputs.extras
        replicated = [t for t in placed if t.kind == ShardingType.DATA_PARALLEL]
        if self.counted_rows and replicated and self.group > 1:
            rows = sum(t.config.num_embeddings for t in replicated)
            dims = {t.config.embedding_dim for t in replicated}
            extras += counted_rows_width(rows, len(dims))
        self.gather("input", 8.0 * (2 + slots + extras), owners)
        holders, scale = np.flatnonzero(slots), np.full(np.count_nonzero(slots), 4.0)
        if self.inputs.forward_precision == "int8":
            self.scatter("forward", scale * self.inputs.batch_size, holders)
        if self.inputs.backward_precision == "int8":
            self.gather("backward", scale * self.inputs.batch_size, holders)

    def dense(self) -> None:
        inputs, topo, world = self.inputs, self.topology, self.world
        rate = topo.dense_rate(inputs.dense_precision) * 1e12
        trace = inputs.dense_trace
        if trace is None:
            self.dense_s = 6.0 * inputs.dense_parameters * inputs.batch_size / rate
        elif trace.batch_size != inputs.batch_size:
            raise ValueError(
                f"the dense part was traced at {trace.batch_size} samples, the step has "
                f"{inputs.batch_size}; trace it at the step's batch"
            )
        else:
            floor = topo.op_us * 1e-6
            self.dense_s = trace.seconds(floor, rate, topo.memory_gbs * 1e9)
        if world == 1:
            return
        ring = 2.0 * (world - 1) / world * inputs.dense_parameters * 4
        where = "inter" if world > topo.ranks_per_node else "intra"
        self.sent["dense"][where] += ring
        gbs, latency = self._link(where)
        seconds = ring / gbs + 2 * math.log2(world) * latency
        # DDP overlaps the all-reduce with the backward (2/3 of the dense flops); the ranks
        # meet at its end. The replicated tables' all-gather runs in the embeddings' backward,
        # after the dense part's: nothing overlaps it.
        self.allreduce_s = max(0.0, seconds - self.dense_s * 2 / 3) + self.wait
        if self.gathered:
            self.allreduce_s += self._gather_seconds() + self._group_link()[1] + self.wait

    def replica_sync(self, table_bytes: np.ndarray) -> None:
        replicas = self.world // self.group
        ring = 2.0 * (replicas - 1) / replicas * table_bytes / self.inputs.sync_every
        where = "inter" if self.group * replicas > self.topology.ranks_per_node else "intra"
        self.sent["replica_sync"][where] += ring
        gbs, latency = self._link(where)
        self.sync_s = float(ring.max()) / gbs
        self.sync_s += (2 * math.log2(replicas) * latency + self.wait) / self.inputs.sync_every

    def _link(self, where: str) -> tuple[float, float]:
        """Bytes per second and seconds of latency of the intra- or inter-node link."""
        topo = self.topology
        if where == "intra":
            return topo.intra_gbs * 1e9, topo.intra_latency_us * 1e-6
        return topo.inter_gbs * 1e9, topo.inter_latency_us * 1e-6

    def _group_link(self) -> tuple[float, float]:
        """The link a collective over the group waits on: inter-node once it spans nodes."""
        return self._link("inter" if self.nodes > 1 else "intra")

    def _a2a_rank_seconds(self, part: str) -> np.ndarray:
        """[G] each rank's seconds in an all-to-all, no latency: its sent and received bytes
        share its links, each full duplex, so half their sum over each link, the busier one."""
        both = self.a2a[part]
        intra, inter = (self._link(where)[0] for where in ("intra", "inter"))
        return np.maximum(both["intra"] / 2 / intra, both["inter"] / 2 / inter)

    def _a2a_seconds(self, part: str) -> float:
        both = self.a2a[part]
        if self.group == 1 or not (both["intra"].any() or both["inter"].any()):
            return 0.0
        latency = self._group_link()[1]
        collectives = 2 if part == "input" else 1  # the input dist: the counts, then the ids
        return float(self._a2a_rank_seconds(part).max()) + collectives * (latency + self.wait)

    def _gather_seconds(self) -> float:
        """The replicated tables' all-gather: every other group rank's block, received."""
        return self.gathered * (self.group - 1) / self._group_link()[0]

    def rank_seconds(self) -> np.ndarray:
        """[G] each rank's memory and communication seconds, no latencies (for the planner)."""
        out = (self.memory + self.update) / (self.topology.memory_gbs * 1e9)
        for part in self.a2a:
            out = out + self._a2a_rank_seconds(part)
        return out + self._gather_seconds()

    def seconds(self) -> dict[str, float]:
        memory = self.topology.memory_gbs * 1e9
        input_dist = self._a2a_seconds("input")
        if self.inputs.pipeline:
            input_dist = max(0.0, input_dist - self.dense_s / 3)
        timed = self.inputs.compute_s * self.topology.host_share
        return {
            "compute": timed,  # timed: the lookups, dense part and updates below are in it
            "lookup": 0.0 if timed else float(self.memory.max()) / memory,
            "input_dist": input_dist,
            "output_dist": self._a2a_seconds("forward"),
            "dense": 0.0 if timed else self.dense_s,
            "grad_dist": self._a2a_seconds("backward"),
            "update": 0.0 if timed else float(self.update.max()) / memory,
            "allreduce": self.allreduce_s,
            "replica_sync": self.sync_s,
        }
