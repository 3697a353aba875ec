"""Where a sharded collection's ids go and where their pooled vectors come back: the index
tables of :class:`~recsys.distributed.sharded.ShardedEmbeddingBagCollection`, built once from
the plan.

Vocabulary (every rank builds the same tables):

- a **slot** is one (feature, rank holding a shard that feature reads) pair; rank d's local
  lookup serves ``slots_per_rank[d]`` slots, in its tables' order;
- a **stream** is a slot numbered globally, rank-major: the all-to-all sends stream s's bags to
  the rank that owns it;
- a **copy** is one destination of an id: a column-wise table sends each id to every column
  shard (several copies), a row-wise, key-wise or table-wise one to one owner, a replicated one
  nowhere.

A key-wise (dynamic) table's id is a raw key: its owner is the shard whose range holds the key's
routing bucket (:mod:`recsys.embedding.dynamic.key_routing`), and it travels unchanged.

Shapes: F features of the collection, B samples on this rank, L ids in the batch, W ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

from recsys.distributed.assembly import PooledAssembly
from recsys.distributed.plan import Shard, ShardingType, TableSharding, row_block
from recsys.embedding.dynamic.key_routing import KeyRouting, routing_bucket

# Sharding types whose every id has one owner among several shards (partial sums come back).
_ONE_OWNER = (ShardingType.ROW_WISE, ShardingType.KEY_WISE)


@dataclass(frozen=True)
class RoutedIds:
    """This rank's ids ordered for the all-to-all: stream-major, then sample."""

    send_lengths: torch.Tensor  # [num_streams * B] bag length per (stream, sample)
    ids: torch.Tensor  # [L'] ids, renumbered within row-wise shards
    weights: torch.Tensor | None  # [L'] per-id weights, in the same order
    per_rank: torch.Tensor  # [W] ids sent to each rank
    per_stream: torch.Tensor  # [num_streams] ids sent in each stream (rank-major)


class ShardRouting:
    """The routing and assembly tables of one sharded collection on one rank.

    Args:
        configs: the collection's tables, in output order.
        plan: table name -> its sharding.
        world_size / rank: the process group's size and this rank.
        device: where the index tables live (the collection's device).
        routing_buckets: each KEY_WISE table's number of routing buckets.
    """

    def __init__(
        self,
        configs: list[EmbeddingBagConfig],
        plan: dict[str, TableSharding],
        world_size: int,
        rank: int,
        device: torch.device,
        routing_buckets: dict[str, int] | None = None,
    ) -> None:
        self.world_size, self.rank = world_size, rank
        self.kind = {c.name: ShardingType(plan[c.name].sharding_type) for c in configs}
        self.features = [f for c in configs for f in c.feature_names]
        self.feature_table = [t for t, c in enumerate(configs) for _ in c.feature_names]
        # Every rank's (table, shard) pairs, in table order: rank d's local lookup.
        self.placements: list[list[tuple[EmbeddingBagConfig, Shard]]] = [
            [] for _ in range(world_size)
        ]
        for c in configs:
            if self.kind[c.name] != ShardingType.DATA_PARALLEL:
                for shard in plan[c.name].shards:
                    self.placements[shard.rank].append((c, shard))
        self.slots_per_rank = [sum(len(c.feature_names) for c, _ in p) for p in self.placements]
        # Columns of pooled vectors each rank's lookup produces.
        self.widths = [
            sum(s.num_cols * len(c.feature_names) for c, s in p) for p in self.placements
        ]
        self.local_features = [f for c, _ in self.placements[rank] for f in c.feature_names]
        self._build_streams(configs, plan, device)
        self._build_key_owners(configs, plan, routing_buckets or {}, device)
        self._build_assembly(configs, plan, device)

    @property
    def local(self) -> list[tuple[EmbeddingBagConfig, Shard]]:
        """This rank's (table, shard) pairs."""
        return self.placements[self.rank]

    def _build_streams(
        self, configs: list[EmbeddingBagConfig], plan: dict[str, TableSharding], device
    ) -> None:
        """Per feature: how many copies of each id, the row-wise block, the stream of each copy
        (or owner)."""
        stream = {}  # (feature, rank) -> stream id; streams are rank-major, slots in order
        for rank, placement in enumerate(self.placements):
            for c, _ in placement:
                for f in c.feature_names:
                    stream[(f, rank)] = len(stream)
        num_features = len(self.features)
        copies = torch.zeros(num_features, dtype=torch.int64)
        block = torch.zeros(num_features, dtype=torch.int64)
        table = torch.full((num_features, self.world_size), -1, dtype=torch.int64)
        for f, name in enumerate(self.features):
            config = configs[self.feature_table[f]]
            kind, shards = self.kind[config.name], plan[config.name].shards
            if kind == ShardingType.DATA_PARALLEL:
                continue
            copies[f] = 1 if kind in _ONE_OWNER else len(shards)
            if kind in _ONE_OWNER:
                if kind == ShardingType.ROW_WISE:
                    block[f] = row_block(config.num_embeddings, self.world_size)
                for shard in shards:
                    table[f, shard.rank] = stream[(name, shard.rank)]
            else:
                for j, shard in enumerate(shards):
                    table[f, j] = stream[(name, shard.rank)]
        self.num_streams = len(stream)
        self.expand = bool((copies != 1).any())  # column-wise copies (>1), replicated (0)
        self.feature_copies = copies.tolist()
        self.copies, self.block, self.stream_table = (
            copies.to(device),
            block.to(device),
            table.to(device),
        )
        stream_rank = [r for r, n in enumerate(self.slots_per_rank) for _ in range(n)]
        self.stream_rank = torch.tensor(stream_rank, dtype=torch.int64, device=device)
        position = {name: f for f, name in enumerate(self.features)}
        stream_feature = [position[name] for name, _ in stream]  # in stream order
        self.stream_feature = torch.tensor(stream_feature, dtype=torch.int64, device=device)
        # No id has an owner of its own: every stream takes a whole feature's ids.
        self.by_feature = not any(self.kind[c.name] in _ONE_OWNER for c in configs)

    def _build_key_owners(
        self,
        configs: list[EmbeddingBagConfig],
        plan: dict[str, TableSharding],
        routing_buckets: dict[str, int],
        device,
    ) -> None:
        """Per feature of a KEY_WISE table: its routing buckets, and the rank owning each
        bucket (one concatenated table, ``bucket_base[f]`` where feature f's starts)."""
        num_features = len(self.features)
        buckets = torch.zeros(num_features, dtype=torch.int64)
        base = torch.zeros(num_features, dtype=torch.int64)
        owners = [torch.zeros(0, dtype=torch.int64)]
        size = 0
        for f in range(num_features):
            config = configs[self.feature_table[f]]
            if self.kind[config.name] != ShardingType.KEY_WISE:
                continue
            if config.name not in routing_buckets:
                raise ValueError(f"KEY_WISE table '{config.name}' has no routing_buckets")
            ranks = torch.tensor(plan[config.name].ranks, dtype=torch.int64)
            routing = KeyRouting(routing_buckets[config.name])
            owners.append(ranks[routing.owners(len(ranks))])
            buckets[f], base[f] = routing.num_buckets, size
            size += routing.num_buckets
        self.any_key_wise = bool((buckets > 0).any())
        self.key_buckets, self.bucket_base = buckets.to(device), base.to(device)
        self.bucket_owner = torch.cat(owners).to(device)

    def _build_assembly(
        self, configs: list[EmbeddingBagConfig], plan: dict[str, TableSharding], device
    ) -> None:
        """How the received columns (and the replicated tables' pooled vectors) make the
        output [B, sum of feature dims] in the unsharded collection's order."""
        piece: dict[tuple[int, str], int] = {}  # (rank, feature) -> its first column there
        for rank, placement in enumerate(self.placements):
            col = 0
            for c, shard in placement:
                for f in c.feature_names:
                    piece[(rank, f)] = col
                    col += shard.num_cols
        features: list[tuple] = []
        for f, name in enumerate(self.features):
            config = configs[self.feature_table[f]]
            kind, shards = self.kind[config.name], plan[config.name].shards
            if kind == ShardingType.DATA_PARALLEL:
                features.append(("replicated", config.embedding_dim))
            elif kind in _ONE_OWNER:  # row-wise and key-wise: partial sums from every shard
                parts = [(s.rank, piece[(s.rank, name)]) for s in shards]
                mean = config.pooling == PoolingType.MEAN
                features.append(("sum", config.embedding_dim, parts, mean))
            else:
                pieces = [(s.rank, piece[(s.rank, name)], s.num_cols) for s in shards]
                features.append(("direct", pieces))
        self.assembly = PooledAssembly(self.widths, features, device)

    def route(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
        ids_per_feature: list[int] | None = None,
    ) -> RoutedIds:
        """This rank's ids (``lengths`` [F, B], ``values`` [L]) copied to every shard they
        read, renumbered within row-wise blocks and sorted by (stream, sample).
        ``ids_per_feature``: the ids of each feature, where the host knows them (the
        KeyedJaggedTensor's length per key): then no table's copies need a host read."""
        if self.by_feature:
            return self._route_features(lengths, values, weights, ids_per_feature)
        device, num_ids = values.device, values.numel()
        flat_lengths = lengths.reshape(-1).long()
        # output_size: the host knows L, so no sync to size the results.
        feature = torch.repeat_interleave(
            torch.arange(lengths.shape[0], device=device),
            lengths.sum(dim=1).long(),
            output_size=num_ids,
        )  # [L]
        sample = torch.repeat_interleave(
            torch.arange(flat_lengths.numel(), device=device) % max(batch_size, 1),
            flat_lengths,
            output_size=num_ids,
        )  # [L]
        source = None
        if self.expand:  # copies: sized from the ids per feature where the host knows them
            copies = self.copies[feature]
            source = torch.repeat_interleave(
                torch.arange(num_ids, device=device),
                copies,
                output_size=self._num_copies(ids_per_feature),
            )
            first = torch.repeat_interleave(
                copies.cumsum(0) - copies, copies, output_size=source.numel()
            )
            copy = torch.arange(source.numel(), device=device) - first
            feature, sample, values = feature[source], sample[source], values[source]
        else:
            copy = torch.zeros_like(feature)
        block = self.block[feature]
        rw = block > 0
        owner = torch.where(rw, values.long() // block.clamp(min=1), copy)
        if self.any_key_wise:  # elementwise over every id: no sync to select the keys
            buckets = self.key_buckets[feature]
            bucket = routing_bucket(values, buckets.clamp(min=1))
            key_owner = self.bucket_owner[self.bucket_base[feature] + bucket]  # fixed ids: 0
            owner = torch.where(buckets > 0, key_owner, owner)
        ids = torch.where(rw, values - owner.to(values.dtype) * block.to(values.dtype), values)
        key = self.stream_table[feature, owner] * batch_size + sample
        order = torch.sort(key, stable=True).indices
        send_lengths = torch.zeros(self.num_streams * batch_size, dtype=torch.int64, device=device)
        send_lengths.index_add_(0, key, torch.ones_like(key))  # bincount: its size would sync
        per_stream = send_lengths.view(self.num_streams, batch_size).sum(dim=1)
        per_rank = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        per_rank.index_add_(0, self.stream_rank, per_stream)
        if weights is not None:
            weights = (weights if source is None else weights[source])[order]
        return RoutedIds(send_lengths, ids[order], weights, per_rank, per_stream)

    def _route_features(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        ids_per_feature: list[int] | None,
    ) -> RoutedIds:
        """:meth:`route` where no table is row-wise or key-wise: stream s is feature
        ``stream_feature[s]``'s ids as they lie, so whole feature segments move (the order
        the sort by (stream, sample) gives, without sorting)."""
        device = values.device
        lengths = lengths.long()
        send_lengths = lengths.index_select(0, self.stream_feature)  # [S, B]
        per_stream = send_lengths.sum(dim=1)
        per_feature = lengths.sum(dim=1)
        starts = (per_feature.cumsum(0) - per_feature).index_select(0, self.stream_feature)
        new_starts = per_stream.cumsum(0) - per_stream
        size = self._num_copies(ids_per_feature) if self.expand else values.numel()
        shift = torch.repeat_interleave(starts - new_starts, per_stream, output_size=size)
        index = shift + torch.arange(shift.numel(), device=device)  # [L'] source of each id
        per_rank = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        per_rank.index_add_(0, self.stream_rank, per_stream)
        weights = None if weights is None else weights[index]
        return RoutedIds(send_lengths.reshape(-1), values[index], weights, per_rank, per_stream)

    def _num_copies(self, ids_per_feature: list[int] | None) -> int | None:
        """How many copies of the ids travel (None: unknown on the host)."""
        if ids_per_feature is None:
            return None
        return sum(c * n for c, n in zip(self.feature_copies, ids_per_feature, strict=True))

    def assemble(
        self,
        received: torch.Tensor | None,
        pooled_dp: torch.Tensor | None,
        lengths: torch.Tensor,
        batch_size: int,
    ) -> torch.Tensor:
        """[B, sum of feature dims] in the unsharded order from the received columns as one
        matrix ([B, sum_d widths[d]], rank d's after rank d-1's; row-wise partials summed, part
        by part, means divided) and the replicated tables' pooled vectors. Not differentiable:
        the output dist (:func:`~recsys.distributed.comm.pooled_all_to_all`) assembles its
        own blocks, with a backward."""
        index = self.assembly.index(batch_size, layout="matrix")
        pool = self.assembly.new_pool(index, lengths.device)
        if received is not None:
            pool.view(-1)[: received.numel()].copy_(received.reshape(-1))
        scale = self.assembly.mean_scale(lengths, batch_size)
        dp = None if pooled_dp is None else pooled_dp.float()
        return self.assembly.forward(pool, dp, scale, index)
