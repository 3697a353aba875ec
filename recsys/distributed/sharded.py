"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables are spread over ranks.

``forward`` reads input_dist -> compute -> output_dist:

- **input_dist**: each rank routes its batch's ids to the ranks owning the shards they read
  (table-wise: the table's rank; column-wise: every column shard's rank; row-wise: rank
  ``id // block``, ids renumbered within the block) and exchanges them in a two-phase
  all-to-all (counts, then lengths / ids / weights; :mod:`recsys.distributed.comm`).
- **compute**: the rank's shards are one local :class:`EmbeddingBagCollection` (the same fused
  kernel and fused optimizer as the unsharded collection), run over the ids every rank sent it,
  as one batch of sum_s B_s samples.
- **output_dist**: the pooled vectors go back to the ranks that own the samples, in one
  all-to-all (optionally fp16 / bf16 / int8); row-wise partial sums arrive from every shard
  and are added in rank order at the sample's rank (a reduce-scatter folded into the same
  all-to-all), then divided by the bag length for mean pooling.

DATA_PARALLEL tables are replicated: each rank looks up its own batch with no communication.

Backward mirrors it: the gradients of the pooled vectors travel back to the shards' owners,
whose fused optimizer updates the touched rows. Gradients are averaged over ranks, as DDP does
for the dense layers, so W ranks with batch B train exactly like one process with batch W*B
(the same learning rates). A replicated table's gradient is all-reduced (averaged) and, with a
fused optimizer, the rows any rank touched are updated identically on every rank.

The state_dict has the unsharded collection's keys and logical shapes:
``embedding_bags.<table>.weight`` [num_embeddings, embedding_dim] (a ShardedTensor for sharded
tables, so torch.distributed.checkpoint writes each shard from its rank), the optimizer states
likewise, and ``optimizer_step``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from recsys._suggest import quoted_with_hints
from recsys.distributed.comm import (
    CommStats,
    PooledLayout,
    all_to_all_ids,
    check_precision,
    pooled_all_to_all,
    source_to_slot_major,
)
from recsys.distributed.plan import (
    Shard,
    ShardingType,
    TableSharding,
    check_table_sharding,
    row_block,
)
from recsys.embedding.collection import _DTYPE, EmbeddingBagCollection
from recsys.ops.embedding_bag import stochastic_round, validate_inputs
from recsys.ops.embedding_bag_layout import rounding_seed


class ShardedEmbeddingBagCollection(nn.Module):
    """The sharded twin of :class:`EmbeddingBagCollection`, built from one and a plan.

    Args:
        module: the collection to shard. Its tables' current values, its fused optimizer (if
            any) and that optimizer's state are copied into the shards. On the ``meta`` device,
            each shard is initialized with its table's ``init_fn`` instead (pass ``device``).
        plan: table name -> :class:`TableSharding` (from
            :mod:`recsys.distributed.planner`).
        process_group: the ranks to shard over (default: the whole job). Every rank of it must
            build the module with the same arguments and call forward the same number of times.
        forward_precision: ``"fp32"`` / ``"fp16"`` / ``"bf16"`` / ``"int8"``: how pooled
            vectors travel (see :mod:`recsys.distributed.comm` for the error of each).
        backward_precision: the same for their gradients.
        device: where the shards live (default: the module's device).

    Example (under ``torchrun --nproc-per-node=2``, after ``dist.init_process_group``)::

        ebc = EmbeddingBagCollection(tables, device="meta", optimizer=RowWiseAdagrad(lr=0.05))
        plan = plan_sharding({"": tables}, world_size=2)
        sharded = ShardedEmbeddingBagCollection(ebc, plan[""], device=torch.device("cpu"))
        pooled = sharded(kjt)  # this rank's samples, all features, like ebc(kjt)
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: Mapping[str, TableSharding],
        *,
        process_group: dist.ProcessGroup | None = None,
        forward_precision: str = "fp32",
        backward_precision: str = "fp32",
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.forward_precision = check_precision(forward_precision, "forward_precision")
        self.backward_precision = check_precision(backward_precision, "backward_precision")
        self.comm_stats = CommStats()
        device = torch.device(device) if device is not None else module.device
        if device.type == "meta":
            raise ValueError("the collection is on the meta device; pass device= for the shards")
        configs = module.embedding_bag_configs()
        self._configs = configs
        self.plan = _checked_plan(configs, plan, self.world_size, module.optimizer)
        self._is_weighted = module.is_weighted()
        self.validate = module.validate
        self.optimizer = module.optimizer
        self._features = [f for c in configs for f in c.feature_names]
        self._feature_table = [t for t, c in enumerate(configs) for _ in c.feature_names]
        self._embedding_names = [
            n for names in get_embedding_names_by_table(configs) for n in names
        ]
        self._lengths_per_embedding = [c.embedding_dim for c in configs for _ in c.feature_names]
        self._key_index_cache: dict[tuple[str, ...], list[int] | None] = {}
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self._load_prefix = ""
        self.register_load_state_dict_post_hook(self._hide_internal_keys)
        copy_from = None if module.device.type == "meta" else module

        kind = {c.name: ShardingType(self.plan[c.name].sharding_type) for c in configs}
        self._dp_configs = [c for c in configs if kind[c.name] == ShardingType.DATA_PARALLEL]
        self._dp_names = {c.name for c in self._dp_configs}
        self._table_rows = [c.num_embeddings for c in configs]
        self._table_pooling = [c.pooling.value.lower() for c in configs]
        # Every rank's (table, shard) pairs, in table order: rank d's local lookup.
        self._placements: list[list[tuple[EmbeddingBagConfig, Shard]]] = [
            [] for _ in range(self.world_size)
        ]
        for c in configs:
            if kind[c.name] != ShardingType.DATA_PARALLEL:
                for shard in self.plan[c.name].shards:
                    self._placements[shard.rank].append((c, shard))
        self._build_routing(kind, device)
        self._build_assembly(kind, device)

        self.shards: EmbeddingBagCollection | None = None
        local = self._placements[self.rank]
        if local:
            self.shards = EmbeddingBagCollection(
                [_shard_config(c, s, kind[c.name]) for c, s in local],
                is_weighted=self._is_weighted,
                device=device,
                backend=module.backend,
                validate=False,  # ids were checked against the full tables before routing
                optimizer=module.optimizer,
            )
            if copy_from is not None:
                self._copy_shards(copy_from, local)
        self.replicated: EmbeddingBagCollection | None = None
        if self._dp_configs:
            self._build_replicated(module, copy_from, device)
        if module.optimizer is None and not any(p.requires_grad for p in module.parameters()):
            for parameter in self.parameters():  # frozen tables stay frozen once sharded
                parameter.requires_grad_(False)

    # -----------------------------------------------------------------------------------------
    # Construction

    def _build_routing(self, kind: dict[str, ShardingType], device: torch.device) -> None:
        """Tables that send each id to its shards: id stream per (feature, copy or owner)."""
        world = self.world_size
        self._slots_per_rank = [sum(len(c.feature_names) for c, _ in p) for p in self._placements]
        self._widths = [
            sum(s.num_cols * len(c.feature_names) for c, s in p) for p in self._placements
        ]
        stream = {}  # (feature, rank) -> stream id; streams are rank-major, slots in order
        for rank, placement in enumerate(self._placements):
            for c, _ in placement:
                for f in c.feature_names:
                    stream[(f, rank)] = len(stream)
        self._local_features = [f for c, _ in self._placements[self.rank] for f in c.feature_names]
        num_features = len(self._features)
        copies = torch.zeros(num_features, dtype=torch.int64)
        block = torch.zeros(num_features, dtype=torch.int64)
        table = torch.full((num_features, world), -1, dtype=torch.int64)
        for f, name in enumerate(self._features):
            config = self._configs[self._feature_table[f]]
            sharding = self.plan[config.name]
            if kind[config.name] == ShardingType.DATA_PARALLEL:
                continue
            copies[f] = 1 if kind[config.name] == ShardingType.ROW_WISE else len(sharding.shards)
            if kind[config.name] == ShardingType.ROW_WISE:
                block[f] = row_block(config.num_embeddings, world)
                for shard in sharding.shards:
                    table[f, shard.rank] = stream[(name, shard.rank)]
            else:
                for j, shard in enumerate(sharding.shards):
                    table[f, j] = stream[(name, shard.rank)]
        self._num_streams = len(stream)
        self._has_remote = self._num_streams > 0
        self._expand = bool((copies != 1).any())
        self._copies, self._block, self._stream_table = (
            copies.to(device),
            block.to(device),
            table.to(device),
        )
        stream_rank = [r for r, n in enumerate(self._slots_per_rank) for _ in range(n)]
        self._stream_rank = torch.tensor(stream_rank, dtype=torch.int64, device=device)

    def _build_assembly(self, kind: dict[str, ShardingType], device: torch.device) -> None:
        """Column maps from [received columns | one zero column | replicated pooled] to the
        output [B, sum of feature dims] in the unsharded collection's order."""
        offsets = [sum(self._widths[:d]) for d in range(self.world_size)]
        # Column of each (rank, feature) piece in the received block.
        piece: dict[tuple[int, str], int] = {}
        for rank, placement in enumerate(self._placements):
            col = offsets[rank]
            for c, shard in placement:
                for f in c.feature_names:
                    piece[(rank, f)] = col
                    col += shard.num_cols
        zero = sum(self._widths)
        dp_col = zero + 1
        direct, rw_cols, rw_parts = [], [], []
        rw_features, rw_is_mean, rw_dims = [], [], []
        out_col = 0
        for f, name in enumerate(self._features):
            config = self._configs[self._feature_table[f]]
            sharding, dim = self.plan[config.name], config.embedding_dim
            k = kind[config.name]
            if k == ShardingType.DATA_PARALLEL:
                direct += range(dp_col, dp_col + dim)
                dp_col += dim
            elif k == ShardingType.ROW_WISE:
                direct += [zero] * dim
                rw_cols += range(out_col, out_col + dim)
                parts = [piece[(s.rank, name)] for s in sharding.shards]
                rw_parts.append([range(p, p + dim) for p in parts])
                rw_features.append(f)
                rw_is_mean.append(config.pooling == PoolingType.MEAN)
                rw_dims.append(dim)
            else:
                for shard in sharding.shards:
                    start = piece[(shard.rank, name)]
                    direct += range(start, start + shard.num_cols)
            out_col += dim
        self._direct_index = torch.tensor(direct, dtype=torch.int64, device=device)
        self._num_parts = max((len(p) for p in rw_parts), default=0)
        # Part-major: part p of every row-wise column, missing parts read the zero column.
        rw_index = [
            col
            for p in range(self._num_parts)
            for parts, dim in zip(rw_parts, rw_dims, strict=True)
            for col in (parts[p] if p < len(parts) else [zero] * dim)
        ]
        self._rw_index = torch.tensor(rw_index, dtype=torch.int64, device=device)
        self._rw_cols = torch.tensor(rw_cols, dtype=torch.int64, device=device)
        # Row-wise features (in output order) and which of them pool by mean.
        self._rw_features = torch.tensor(rw_features, dtype=torch.int64, device=device)
        self._rw_is_mean = torch.tensor(rw_is_mean, dtype=torch.bool, device=device)
        self._any_rw_mean = any(rw_is_mean)
        self._rw_dims = torch.tensor(rw_dims, dtype=torch.int64, device=device)

    def _copy_shards(
        self, module: EmbeddingBagCollection, local: list[tuple[EmbeddingBagConfig, Shard]]
    ) -> None:
        with torch.no_grad():
            for c, shard in local:
                rows = slice(shard.row_offset, shard.row_offset + shard.num_rows)
                cols = slice(shard.col_offset, shard.col_offset + shard.num_cols)
                source, target = module.embedding_bags[c.name], self.shards.embedding_bags[c.name]
                target.weight.copy_(source.weight[rows, cols])
                for name, buffer in target._buffers.items():
                    state = source._buffers[name]
                    buffer.copy_(state[rows] if state.dim() == 1 else state[rows, cols])
            if self.optimizer is not None:
                self.shards.optimizer_step.copy_(module.optimizer_step)

    def _build_replicated(
        self,
        module: EmbeddingBagCollection,
        copy_from: EmbeddingBagCollection | None,
        device: torch.device,
    ) -> None:
        """Replicated tables: a local collection with dense gradients; with a fused optimizer,
        a hook per table averages its gradient over ranks and applies the update."""
        self.replicated = EmbeddingBagCollection(
            self._dp_configs,
            is_weighted=self._is_weighted,
            device=device,
            backend=module.backend,
            validate=False,
        )
        if copy_from is not None:
            with torch.no_grad():
                for c in self._dp_configs:
                    self.replicated.embedding_bags[c.name].weight.copy_(
                        copy_from.embedding_bags[c.name].weight
                    )
        # Replicas start equal whatever each rank's RNG did (tables initialized from meta).
        first = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        for table in self.replicated.embedding_bags.values():
            dist.broadcast(table.weight.data, src=first, group=self._group)
        self._dp_touched: dict[str, torch.Tensor] = {}
        self._dp_grads: dict[str, torch.Tensor] = {}
        self.replicated_states = nn.ModuleDict()
        if self.optimizer is None:
            return
        for c in self._dp_configs:
            holder = nn.Module()
            for name, kind in self.optimizer.states.items():
                shape = (
                    (c.num_embeddings,) if kind == "row" else (c.num_embeddings, c.embedding_dim)
                )
                state = torch.full(shape, self.optimizer.initial_state(name), device=device)
                if copy_from is not None:
                    state.copy_(copy_from.embedding_bags[c.name]._buffers[name])
                holder.register_buffer(name, state)
            self.replicated_states[c.name] = holder
            weight = self.replicated.embedding_bags[c.name].weight
            weight.register_post_accumulate_grad_hook(self._replicated_update(c.name))
        step = copy_from.optimizer_step.clone() if copy_from is not None else torch.zeros(())
        self.register_buffer("replicated_step", step.to(device=device, dtype=torch.int64))
        self._pending_step = 0

    # -----------------------------------------------------------------------------------------
    # Forward

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool this rank's samples: KJT with (at least) the collection's features ->
        KeyedTensor [B, sum of the features' dims], keys in table order (as the unsharded
        collection). A collective: every rank of the group must call it."""
        if features.variable_stride_per_key():
            raise ValueError(
                "KeyedJaggedTensor with a variable batch size per key is not supported"
            )
        features = self._select(features)
        batch_size = features.stride()
        num_features = len(self._features)
        lengths = features.lengths().view(num_features, batch_size)
        values = features.values()
        weights = None
        if self._is_weighted:
            weights = features.weights_or_none()
            if weights is None:
                raise ValueError(
                    "this collection is weighted (is_weighted=True) but the input "
                    "KeyedJaggedTensor has no weights"
                )
        if self.validate:
            validate_inputs(
                self._table_rows,
                values,
                features.offsets(),
                list(range(num_features)),
                self._feature_table,
                self._table_pooling,
                batch_size,
                weights,
                self._features,
            )
        received = self._remote(lengths, values, weights, batch_size)
        pooled_dp = None
        if self.replicated is not None:
            pooled_dp = self.replicated(features).values()  # [B, D_dp]
            if self.optimizer is not None and torch.is_grad_enabled():
                self._record_touched(features)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=self._assemble(received, pooled_dp, lengths, batch_size),
        )

    def _select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The input's features in the collection's order (a permute when they differ)."""
        keys = tuple(features.keys())
        if keys not in self._key_index_cache:
            position = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self._features if f not in position]
            if missing:
                raise ValueError(
                    f"KeyedJaggedTensor is missing features {quoted_with_hints(missing, keys)} "
                    f"of this collection; its keys are {list(keys)}, the collection expects "
                    f"{self._features}"
                )
            order = [position[f] for f in self._features]
            self._key_index_cache[keys] = None if order == list(range(len(keys))) else order
        order = self._key_index_cache[keys]
        return features if order is None else features.permute(order)

    def _remote(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
    ) -> torch.Tensor | None:
        """input_dist -> compute -> output_dist of the sharded tables: [B, sum_d widths[d]]."""
        if not self._has_remote:
            return None
        device = values.device
        num_features = lengths.shape[0]
        flat_lengths = lengths.reshape(-1).long()
        feature = torch.repeat_interleave(
            torch.arange(num_features, device=device), lengths.sum(dim=1).long()
        )  # [L]
        sample = torch.repeat_interleave(
            torch.arange(num_features * batch_size, device=device) % max(batch_size, 1),
            flat_lengths,
        )  # [L]
        source = None
        if self._expand:  # column-wise copies (>1) and replicated features (0)
            copies = self._copies[feature]
            source = torch.repeat_interleave(torch.arange(values.numel(), device=device), copies)
            first = torch.repeat_interleave(copies.cumsum(0) - copies, copies)
            copy = torch.arange(source.numel(), device=device) - first
            feature, sample, values = feature[source], sample[source], values[source]
        else:
            copy = torch.zeros_like(feature)
        block = self._block[feature]
        rw = block > 0
        owner = torch.where(rw, values.long() // block.clamp(min=1), copy)
        ids = torch.where(rw, values - owner.to(values.dtype) * block.to(values.dtype), values)
        stream = self._stream_table[feature, owner]
        key = stream * batch_size + sample
        order = torch.sort(key, stable=True).indices
        send_lengths = torch.bincount(key, minlength=self._num_streams * batch_size)
        per_stream = send_lengths.view(self._num_streams, batch_size).sum(dim=1)
        per_rank = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        per_rank.index_add_(0, self._stream_rank, per_stream)
        send_weights = None
        if weights is not None:
            weights = weights if source is None else weights[source]
            send_weights = weights[order]
        received = all_to_all_ids(
            send_lengths,
            ids[order],
            send_weights,
            batch_size,
            self._slots_per_rank,
            per_rank,
            self._group,
            self.comm_stats,
        )
        local_lengths, local_values, local_weights = source_to_slot_major(
            received, self._slots_per_rank[self.rank]
        )
        total = sum(received.batch_sizes)
        if self.shards is not None:
            kjt = KeyedJaggedTensor(
                keys=self._local_features,
                values=local_values,
                lengths=local_lengths,
                weights=local_weights,
                stride=total,
            )
            pooled = self.shards(kjt).values()  # [sum_s B_s, widths[rank]]
        else:
            pooled = torch.zeros(total, 0, device=device)
        layout = PooledLayout(
            batch_sizes=received.batch_sizes,
            local_width=self._widths[self.rank],
            widths=self._widths,
            forward=self.forward_precision,
            backward=self.backward_precision,
            grad_scale=1.0 / self.world_size,
        )
        return pooled_all_to_all(pooled, layout, self._anchor, self._group, self.comm_stats)

    def _assemble(
        self,
        received: torch.Tensor | None,
        pooled_dp: torch.Tensor | None,
        lengths: torch.Tensor,
        batch_size: int,
    ) -> torch.Tensor:
        """[B, sum of feature dims] in the unsharded order from the received columns (row-wise
        partials summed, part by part) and the replicated tables' pooled vectors."""
        device = lengths.device
        parts = [
            received if received is not None else torch.zeros(batch_size, 0, device=device),
            torch.zeros(batch_size, 1, device=device),
        ]
        if pooled_dp is not None:
            parts.append(pooled_dp.float())
        combined = torch.cat(parts, dim=1)
        out = combined.index_select(1, self._direct_index)
        if self._num_parts:
            rw = combined.index_select(1, self._rw_index)
            rw = rw.view(batch_size, self._num_parts, self._rw_cols.numel()).sum(dim=1)
            if self._any_rw_mean:
                bag_sizes = lengths.index_select(0, self._rw_features).clamp(min=1).float()
                scale = torch.where(self._rw_is_mean.unsqueeze(1), 1.0 / bag_sizes, 1.0)
                rw = rw * torch.repeat_interleave(scale.t(), self._rw_dims, dim=1)  # [B, D_rw]
            out = out.index_add(1, self._rw_cols, rw)
        return out

    # -----------------------------------------------------------------------------------------
    # Replicated tables with a fused optimizer

    def _record_touched(self, features: KeyedJaggedTensor) -> None:
        values = features.values().split(features.length_per_key())  # in collection order
        per_feature = dict(zip(self._features, values, strict=True))
        self._pending_step = int(self.replicated_step) + 1
        for c in self._dp_configs:
            ids = torch.cat([per_feature[f] for f in c.feature_names]).long()
            touched = torch.zeros(c.num_embeddings, dtype=torch.bool, device=ids.device)
            self._dp_touched[c.name] = touched.index_fill_(0, ids, True)

    def _replicated_update(self, table: str):
        """The hook of one replicated table: keep its gradient; once every replicated table has
        one (they come from one backward node, so back to back), average all of them over
        ranks in ONE all-reduce, with the rows any rank touched, and update those rows."""

        def hook(weight: torch.Tensor) -> None:
            self._dp_grads[table] = weight.grad
            weight.grad = None
            if len(self._dp_grads) == len(self._dp_configs):
                self._apply_replicated_updates()

        return hook

    def _apply_replicated_updates(self) -> None:
        names = [c.name for c in self._dp_configs]
        grads = [self._dp_grads.pop(name) for name in names]
        touched = [self._dp_touched.pop(name) for name in names]
        packed = torch.cat([g.reshape(-1).float() for g in grads] + [t.float() for t in touched])
        self.comm_stats.add("backward", packed)
        dist.all_reduce(packed, group=self._group)  # sums over ranks
        sizes = [g.numel() for g in grads] + [t.numel() for t in touched]
        pieces = packed.split(sizes)
        step = self._pending_step
        self.replicated_step.fill_(step)
        generator = None
        if self.optimizer.stochastic_rounding:
            generator = torch.Generator(device=packed.device)
            generator.manual_seed(rounding_seed(step))
        with torch.no_grad():
            for t, name in enumerate(names):
                weight = self.replicated.embedding_bags[name].weight
                grad = pieces[t].view_as(weight) / self.world_size
                rows = (pieces[len(names) + t] > 0).nonzero().squeeze(1)
                holder = self.replicated_states[name]
                state = {key: buffer[rows] for key, buffer in holder._buffers.items()}
                new = self.optimizer.update(weight[rows].float(), grad[rows], state, step)
                if generator is not None:
                    new = stochastic_round(new, weight.dtype, generator)
                weight.index_copy_(0, rows, new.to(weight.dtype))
                for key, buffer in holder._buffers.items():
                    buffer.index_copy_(0, rows, state[key])

    def parameters_for_optimizer(self) -> list[nn.Parameter]:
        """Table parameters a torch optimizer must train: none with a fused optimizer, else
        this rank's shards and the replicated tables (whose gradients DDP averages)."""
        if self.optimizer is not None:
            return []
        return [p for p in self.parameters() if p.requires_grad]

    def ddp_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients DDP must average: the replicated tables when a torch
        optimizer trains them. Shards are never DDP's: each rank holds different ones."""
        if self.optimizer is not None or self.replicated is None:
            return []
        return list(self.replicated.parameters())

    # -----------------------------------------------------------------------------------------
    # State dict in the unsharded layout

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The unsharded collection's keys and shapes: sharded tables as ShardedTensors of
        their full [num_embeddings, embedding_dim] (optimizer states likewise), replicated
        tables as plain tensors."""
        if args:
            raise TypeError("state_dict takes keyword arguments only")
        out = {} if destination is None else destination
        for c in self._configs:
            base = f"{prefix}embedding_bags.{c.name}."
            if c.name in self._dp_names:
                table = self.replicated.embedding_bags[c.name]
                out[base + "weight"] = table.weight if keep_vars else table.weight.detach()
                if c.name in self.replicated_states:
                    out.update(
                        {base + n: b for n, b in self.replicated_states[c.name]._buffers.items()}
                    )
                continue
            local = self.shards.embedding_bags[c.name] if self._holds(c.name) else None
            out[base + "weight"] = self._sharded(
                c, local.weight.detach() if local is not None else None, per_row=False
            )
            for name, kind in (self.optimizer.states if self.optimizer else {}).items():
                state = local._buffers[name] if local is not None else None
                out[base + name] = self._sharded(c, state, per_row=kind == "row")
        if self.optimizer is not None:
            out[prefix + "optimizer_step"] = self._step()
        return out

    def logical_optimizer_state(
        self, prefix: str, state: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """A torch optimizer's per-parameter state for this collection's tables (no fused
        optimizer), re-keyed from the internal parameters (``<prefix>shards.embedding_bags.<t>
        .weight``, ``<prefix>replicated...``) to the logical table (``<prefix>embedding_bags.<t>
        .weight``). A state the shape of a shard becomes a ShardedTensor of the table's full
        shape over its live tensor, so a checkpoint of it does not depend on the plan and
        loading it in place updates the optimizer's own tensors. Scalars (``step``) are
        shared by every shard. Tables this rank holds no shard of are left out."""
        out = {}
        for c in self._configs:
            logical = f"{prefix}embedding_bags.{c.name}.weight"
            if c.name in self._dp_names:
                key = f"{prefix}replicated.embedding_bags.{c.name}.weight"
                if key in state:
                    out[logical] = state[key]
                continue
            local = state.get(f"{prefix}shards.embedding_bags.{c.name}.weight")
            if local is None:
                continue
            shape = self.shards.embedding_bags[c.name].weight.shape
            out[logical] = {
                name: (
                    self._sharded(c, value, per_row=False)
                    if torch.is_tensor(value) and value.shape == shape
                    else value
                )
                for name, value in local.items()
            }
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """Load the unsharded layout (plain full tensors, or ShardedTensors whose local shard
        is this rank's): each rank copies its own shards' rows and columns. The internal
        submodules' own keys are never expected (see ``_hide_internal_keys``)."""
        self._load_prefix = prefix
        expected = {prefix + key for key in self.state_dict()}
        given = {key for key in state_dict if key.startswith(prefix)}
        missing_keys.extend(sorted(expected - given))
        unexpected_keys.extend(sorted(given - expected))
        with torch.no_grad():
            for key in sorted(expected & given):
                self._load_one(key[len(prefix) :], state_dict[key])

    @staticmethod
    def _hide_internal_keys(module: ShardedEmbeddingBagCollection, incompatible) -> None:
        prefix = module._load_prefix
        internal = (
            *(f"{prefix}{name}." for name in ("shards", "replicated", "replicated_states")),
            f"{prefix}replicated_step",
        )
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if not k.startswith(internal)
        ]

    def _load_one(self, key: str, value) -> None:
        if key == "optimizer_step":
            value = torch.as_tensor(value)
            if self.shards is not None:
                self.shards.optimizer_step.copy_(value)
            if hasattr(self, "replicated_step"):
                self.replicated_step.copy_(value)
            return
        _, table, name = key.split(".")
        if table in self._dp_names:
            target = (
                self.replicated.embedding_bags[table].weight
                if name == "weight"
                else self.replicated_states[table]._buffers[name]
            )
            target.copy_(_full(value))
            return
        if not self._holds(table):
            return
        local = self.shards.embedding_bags[table]
        target = local.weight if name == "weight" else local._buffers[name]
        if isinstance(value, ShardedTensor):
            (shard,) = value.local_shards()
            target.copy_(shard.tensor)
            return
        shard = next(s for s in self.plan[table].shards if s.rank == self.rank)
        rows = slice(shard.row_offset, shard.row_offset + shard.num_rows)
        cols = slice(shard.col_offset, shard.col_offset + shard.num_cols)
        target.copy_(value[rows] if value.dim() == 1 else value[rows, cols])

    def _holds(self, table: str) -> bool:
        return self.shards is not None and table in self.shards.embedding_bags

    def _step(self) -> torch.Tensor:
        if self.shards is not None:
            return self.shards.optimizer_step
        if hasattr(self, "replicated_step"):
            return self.replicated_step
        return torch.zeros((), dtype=torch.int64)

    def _sharded(
        self, config: EmbeddingBagConfig, local: torch.Tensor | None, per_row: bool
    ) -> ShardedTensor:
        """The table (or a state of it) as one ShardedTensor over the group's ranks."""
        device = self._anchor.device
        size = [config.num_embeddings] if per_row else [config.num_embeddings, config.embedding_dim]
        dtype = torch.float32 if local is None and per_row else None
        metadata, mine = [], None
        for shard in self.plan[config.name].shards:
            offsets = [shard.row_offset] if per_row else [shard.row_offset, shard.col_offset]
            sizes = [shard.num_rows] if per_row else [shard.num_rows, shard.num_cols]
            placement = f"rank:{shard.rank}/{device.type}"
            if device.type == "cuda":
                placement = f"rank:{shard.rank}/cuda:{torch.cuda.current_device()}"
            meta = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=placement)
            metadata.append(meta)
            if shard.rank == self.rank:
                mine = meta
        if dtype is None:
            dtype = local.dtype if local is not None else _config_dtype(config)
        properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
        global_metadata = ShardedTensorMetadata(
            shards_metadata=metadata, size=torch.Size(size), tensor_properties=properties
        )
        shards = [LocalShard(local, mine)] if local is not None else []
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, global_metadata, process_group=self._group
        )


def _full(value) -> torch.Tensor:
    if isinstance(value, ShardedTensor):
        raise ValueError("a replicated table was given as a ShardedTensor; expected a tensor")
    return torch.as_tensor(value)


def _config_dtype(config: EmbeddingBagConfig) -> torch.dtype:
    return _DTYPE[config.data_type]


def _shard_config(
    config: EmbeddingBagConfig, shard: Shard, kind: ShardingType
) -> EmbeddingBagConfig:
    """The local table holding ``shard``: its rows and columns, the table's features; row-wise
    shards pool by sum (the mean divides the summed partials at the sample's rank)."""
    return EmbeddingBagConfig(
        name=config.name,
        num_embeddings=shard.num_rows,
        embedding_dim=shard.num_cols,
        feature_names=list(config.feature_names),
        pooling=PoolingType.SUM if kind == ShardingType.ROW_WISE else config.pooling,
        data_type=config.data_type,
        init_fn=config.init_fn,
    )


def _checked_plan(
    configs: list[EmbeddingBagConfig],
    plan: Mapping[str, TableSharding],
    world_size: int,
    optimizer,
) -> dict[str, TableSharding]:
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
        if row_state and ShardingType(sharding.sharding_type) == ShardingType.COLUMN_WISE:
            raise ValueError(
                f"table '{config.name}' is COLUMN_WISE but {type(optimizer).__name__} keeps one "
                "accumulator per row, which column shards cannot share exactly; use "
                "TABLE_WISE / ROW_WISE for it, or an optimizer with per-element state "
                "(SGD, Adagrad, Adam)"
            )
    return dict(plan)
