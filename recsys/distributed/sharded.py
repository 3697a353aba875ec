"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection whose tables are spread over ranks.

``forward`` reads input_dist -> compute -> output_dist:

- **input_dist**: each rank routes its batch's ids to the ranks owning the shards they read
  (table-wise: the table's rank; column-wise: every column shard's rank; row-wise: rank
  ``id // block``, ids renumbered within the block) and exchanges them in a two-phase
  all-to-all (counts, with the verdict of the input check; then lengths, ids and weights in
  one buffer; :mod:`recsys.distributed.counts`, :mod:`recsys.distributed.comm`,
  :mod:`recsys.distributed.sharded_input`).
- **compute**: the rank's shards are one local :class:`EmbeddingBagCollection` (the same fused
  kernel and fused optimizer as the unsharded collection), run over the ids every rank sent it,
  as one batch of sum_s B_s samples.
- **output_dist**: the pooled vectors go back to the ranks that own the samples, in one
  all-to-all (optionally fp16 / bf16 / int8); row-wise partial sums arrive from every shard
  and are added in rank order at the sample's rank (a reduce-scatter folded into the same
  all-to-all), then divided by the bag length for mean pooling.

KEY_WISE tables are dynamic (raw 64-bit keys, no vocabulary): input_dist sends each key to the
rank owning its routing bucket (:mod:`recsys.embedding.dynamic.key_routing`), where a
:class:`~recsys.embedding.dynamic.collection.DynamicEmbeddingBagCollection` maps it to a row
(inserting, growing, evicting) and the fused optimizer updates it; pooled partial sums come back as
for ROW_WISE. Their state is saved by key (:mod:`recsys.distributed.sharded_dynamic`), and loads on
any number of ranks.

``prefetch_input`` runs input_dist ahead, for a forward that then starts at compute (the
pipelined train step, :mod:`recsys.train.pipeline`): it posts the batch's counts, the next
forward reads them after its own output_dist and sends the ids, which travel during that
step's backward.

DATA_PARALLEL tables are replicated (:mod:`recsys.distributed.replicated`): each rank looks up
its own batch with no communication. The routing tables live in
:mod:`recsys.distributed.routing`, the checkpoint state in :mod:`recsys.distributed.sharded_state`.

Backward mirrors it: the gradients of the pooled vectors travel back to the shards' owners,
whose fused optimizer updates the touched rows. Gradients are averaged over ranks, as DDP does
for the dense layers, so W ranks with batch B train exactly like one process with batch W*B
(the same learning rates). With a fused optimizer, the rows of replicated tables that any rank
touched are all-gathered with their gradients, averaged, and updated identically on every rank;
with a torch optimizer, DDP averages their gradients.

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
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from recsys.distributed.comm import (
    CommStats,
    PendingIds,
    PooledLayout,
    check_precision,
    pooled_all_to_all,
    send_ids,
    source_to_slot_major,
)
from recsys.distributed.counts import start_counts
from recsys.distributed.plan import Shard, ShardingType, TableSharding
from recsys.distributed.replicated import ReplicatedTables
from recsys.distributed.routing import ShardRouting
from recsys.distributed.shard_build import (
    build_shards,
    checked_plan,
    dynamic_parts,
    merge_tiered_stats,
    table_part,
    tiered_of,
)
from recsys.distributed.sharded_dynamic import (
    gathered_keys,
    key_wise_state,
    key_wise_stats,
    key_wise_targets,
    load_key_wise,
    table_state_keys,
)
from recsys.distributed.sharded_input import (
    InputSpec,
    LocalBatch,
    Prefetched,
    PrefetchQueue,
    StartedInput,
    check_now,
    check_on_device,
    raise_on_bad_input,
)
from recsys.distributed.sharded_state import (
    hide_internal_keys,
    load_logical,
    logical_optimizer_state,
    logical_state,
)
from recsys.embedding.collection import EmbeddingBagCollection, EmbeddingTable
from recsys.embedding.dynamic.key_routing import KeyRouting
from recsys.embedding.dynamic.mixin import DYNAMIC, DYNAMIC_STEP
from recsys.embedding.inputs import FeatureOrder, input_weights
from recsys.embedding.interface import EmbeddingCollectionInterface, SavedState, TableDelta
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import output_keys, pooling_mode
from recsys.embedding.tiered.files import TieredFiles
from recsys.ops.input_checks import check_mode


class ShardedEmbeddingBagCollection(EmbeddingCollectionInterface):
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
        seed: from the ``meta`` device, the seed of the fixed tables' initial rows (default:
            the module's own, for dynamic and tiered collections, else 0); see
            :mod:`recsys.distributed.shard_build`.

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
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
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
        self._tiered = tiered_of(module)
        dynamic = dynamic_parts(module, plan, self.rank)
        self.plan = checked_plan(
            configs, plan, self.world_size, module.optimizer, set(dynamic), set(self._tiered)
        )
        self._dynamic = dynamic
        self._is_weighted = module.is_weighted()
        self.validate = module.validate
        self.optimizer: FusedOptimizer | None = module.optimizer
        self._features = FeatureOrder([f for c in configs for f in c.feature_names])
        self._embedding_names, self._lengths_per_embedding = output_keys(configs)
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        buckets = {name: options.routing_buckets for name, options in self._dynamic.items()}
        self.routing = ShardRouting(
            configs, self.plan, self.world_size, self.rank, device, routing_buckets=buckets
        )
        self._input_spec = InputSpec(
            names=self._features.features,
            table_of=self.routing.feature_table,
            table_rows=[c.num_embeddings for c in configs],
            poolings=[pooling_mode(c) for c in configs],
            key_buckets=self.routing.key_buckets if self.routing.any_key_wise else None,
        )
        source = None if module.device.type == "meta" else module
        self.shards = build_shards(
            module,
            self.routing.local,
            self.routing.kind,
            self._dynamic,
            device=device,
            seed=getattr(module, "seed", 0) if seed is None else seed,
            rank=self.rank,
            num_shards={name: len(sharding.shards) for name, sharding in self.plan.items()},
        )
        if source is not None:
            for name in self.key_wise_tables():  # each rank keeps the keys its routing buckets hold
                load_key_wise(self, name, source.table_state(name))
        replicated = [c for c in configs if self.is_replicated(c.name)]
        self.replicated = None
        if replicated:
            self.replicated = ReplicatedTables(
                replicated,
                source,
                module.optimizer,
                is_weighted=self._is_weighted,
                backend=module.backend,
                process_group=process_group,
                comm_stats=self.comm_stats,
                device=device,
                features=self._features.features,
            )
        if module.is_frozen():
            for parameter in self.parameters():  # frozen tables stay frozen once sharded
                parameter.requires_grad_(False)
        self.load_prefix = ""
        self.replica_groups = None  # 2D: set by parallelize (recsys.distributed.replicas)
        self.register_load_state_dict_post_hook(hide_internal_keys)
        self._prefetched = PrefetchQueue()

    # -----------------------------------------------------------------------------------------
    # Forward: input_dist -> compute -> output_dist

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool this rank's samples: KJT with (at least) the collection's features ->
        KeyedTensor [B, sum of the features' dims], keys in table order (as the unsharded
        collection). A collective: every rank of the group must call it. Given the very object
        :meth:`prefetch_input` had, it starts at compute with the ids that input_dist sent."""
        ready = self._prefetched.take(features)
        if ready is None:
            features = self._checked(features)
            batch = self.input_dist(features) if self.routing.num_streams else None
        else:
            if ready.error is not None:
                raise ready.error
            features = ready.features
            batch = ready.local
            if ready.started is not None:
                ready.pending = self.send_input(ready.started)
            if batch is None and ready.pending is not None:
                batch = self.finish_input_dist(ready.pending)
        pooled_dp = None
        if self.replicated is not None:
            pooled_dp = self.replicated(features, None if batch is None else batch.touched)
        if batch is None:  # every table replicated: already in the collection's order
            values = pooled_dp.float()
        else:
            lengths = features.lengths().view(len(self.routing.features), features.stride())
            values = self.output_dist(self.compute(batch), batch, pooled_dp, lengths)
        self._prefetched.send(self.send_input)
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
        )

    def prefetch_input(self, features: KeyedJaggedTensor) -> None:
        """Check ``features`` and start their input_dist now, for a forward of the same object
        later (the newest :data:`MAX_PREFETCHED` are kept): their counts are exchanged while
        the next forward computes, which then sends their ids (:meth:`PrefetchQueue.send`), and
        the forward of ``features`` waits for them. Changes no table's values: a KEY_WISE key
        is inserted by compute, on its owner; this rank's tiered shards bring the batch's rows
        into their caches (rows move exactly, see ``TieredEmbeddingBagCollection``: their ids
        are exchanged now). A collective, like forward. A batch that fails the input check
        raises in its own forward, on every rank, after the forwards before it.

        Raises:
            ValueError: a malformed input (its shape or feature names), as forward would.
        """
        checked = self._checked(features)
        started = self.start_input_dist(checked) if self.routing.num_streams else None
        entry = Prefetched(features, checked, started)
        if self.caches and started is not None:  # the ids now, for the rows' prefetch
            entry.started = None
            entry.local = self.finish_input_dist(self.send_input(started))
            self.shards.prefetch(entry.local.features)
        self._prefetched.add(entry)

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """For tiered tables: :meth:`prefetch_input`, whose ids then go to this rank's tiered
        shards (:meth:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection.prefetch`),
        so their rows come into the cache while the batch before trains. A collective."""
        self.prefetch_input(features)

    def drop_prefetched(self) -> None:
        """Forget the batches :meth:`prefetch_input` ran ahead (their forward will not come)."""
        self._prefetched.clear()
        if self.caches:
            self.shards.drop_prefetched()

    # -----------------------------------------------------------------------------------------
    # Tiered tables: this rank's shards of them (see recsys.distributed.shard_build)

    def tiered_tables(self) -> list[str]:
        """The tables kept in host memory or on disk (their rows are not in ``state_dict``)."""
        return list(self._tiered)

    @property
    def caches(self) -> dict:
        """This rank's tiered shards' caches, by table (empty: no tiered table here)."""
        return getattr(self.shards, "caches", {}) if self._tiered else {}

    def tiered_stats(self) -> dict[str, dict[str, float]]:
        """The tiered tables' counters (see ``TieredEmbeddingBagCollection.tiered_stats``)
        summed over the ranks holding their shards (``prefetch_wait_s``: the longest rank's).
        A collective: every rank calls it (the trainer does, at every train log event)."""
        mine = self.shards.tiered_stats() if self.caches else {}
        every: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(every, mine, group=self.process_group)
        return merge_tiered_stats(every)

    def flush(self) -> None:
        """Write this rank's changed cached rows back to their stores."""
        if self.caches:
            self.shards.flush()

    def tiered_files(self) -> TieredFiles:
        """This rank's part of the tiered tables' checkpoint files: its rows as rows of the
        whole tables, its keys of the dynamic ones (a checkpoint loads on any number of ranks,
        each keeping the rows it holds)."""
        if not self.caches:
            return TieredFiles({}, {})
        parts = {}
        for name in self.caches:
            routing = self.routing_of(name) if name in self._dynamic else None
            rows = next(c.num_embeddings for c in self._configs if c.name == name)
            parts[name] = table_part(self.plan[name], self.local_shard(name), rows, routing)
        return self.shards.tiered_files(parts)

    def _checked(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` in the collection's order, their shape and weights checked; their ids,
        offsets and weights are checked by input_dist (:mod:`recsys.distributed.sharded_input`),
        or here, on the host, when no table exchanges ids."""
        input_weights(features, self._is_weighted)  # raises on a malformed input
        features = self._select(features)
        if check_mode(self.validate) != "off" and not self.routing.num_streams:
            check_now(self._input_spec, features, self._weights(features))
        return features

    def _weights(self, features: KeyedJaggedTensor) -> torch.Tensor | None:
        return features.weights_or_none() if self._is_weighted else None

    def _select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The input's features in the collection's order (a permute when they differ)."""
        order = self._features.positions(features.keys())
        return features if order == list(range(len(features.keys()))) else features.permute(order)

    def input_dist(self, features: KeyedJaggedTensor) -> LocalBatch:
        """Send every id to the ranks holding the shards it reads (a two-phase all-to-all) and
        receive the ids the other ranks send to this rank's shards."""
        return self.finish_input_dist(self.send_input(self.start_input_dist(features)))

    def start_input_dist(self, features: KeyedJaggedTensor) -> StartedInput:
        """Check and route the ids and post the counts exchange, not waited for (a prefetched
        batch's counts travel while the forward before it computes); :meth:`send_input` reads
        them and sends the ids."""
        batch_size, weights = features.stride(), self._weights(features)
        lengths = features.lengths().view(len(self.routing.features), batch_size)
        values, checked = features.values(), None
        if check_mode(self.validate) != "off":  # "async" too: the update runs on other ranks
            checked = check_on_device(self._input_spec, features, weights)
            lengths, values = checked.lengths, checked.values
        per_key = features.length_per_key_or_none()  # known on the host: no read to size
        routed = self.routing.route(lengths, values, weights, batch_size, per_key)
        group, stats = self.process_group, self.comm_stats
        along = [] if checked is None else [checked.ok]  # with the counts: read with them
        if self._counts_rows:
            along.append(self.replicated.count_rows(values, lengths))
        extras = torch.cat(along) if along else None
        skip = len(along) - self._counts_rows  # the rows' counts come after the verdict
        derive = (lambda x: self.replicated.union_rows(x[:, skip:])) if self._counts_rows else None
        slots = self.routing.slots_per_rank
        counts = start_counts(
            batch_size, routed.per_rank, group, stats, extras, derive, routed.per_stream, slots
        )
        return StartedInput(features, weights, routed, checked is not None, counts)

    def send_input(self, started: StartedInput) -> PendingIds:
        """Read the counts :meth:`start_input_dist` posted and send the ids in the background.

        Raises:
            ValueError: on every rank, when some rank's batch failed the input check (no id
                is sent).
        """
        counts = started.counts.wait()
        features, weights, routed = started.features, started.weights, started.routed
        if started.checked:  # every rank raises here for a bad batch of any rank
            verdicts = [extras[0] for extras in counts.extras]
            raise_on_bad_input(verdicts, self.rank, self._input_spec, features, weights)
        return send_ids(
            routed.send_lengths,
            routed.ids,
            routed.weights,
            features.stride(),
            self.routing.slots_per_rank,
            counts,
            self.process_group,
            self.comm_stats,
        )

    def finish_input_dist(self, pending: PendingIds) -> LocalBatch:
        """Wait for the ids :meth:`start_input_dist` sent; this rank's local batch."""
        with self.comm_stats.timed(self._anchor.device):
            received = pending.wait()
        local_lengths, local_values, local_weights = source_to_slot_major(received)
        local = KeyedJaggedTensor(
            keys=self.routing.local_features,
            values=local_values,
            lengths=local_lengths,
            weights=local_weights,
            stride=sum(received.batch_sizes),
            length_per_key=[sum(ids) for ids in zip(*received.slot_values, strict=True)],
        )
        touched = None
        if self._counts_rows:  # after the check's verdict, if any
            skip = int(check_mode(self.validate) != "off")
            touched = self.replicated.touched_rows(received, skip, self.rank)
        return LocalBatch(local, list(received.batch_sizes), touched)

    @property
    def _counts_rows(self) -> bool:
        return self.replicated is not None and self.replicated.counts_rows

    def compute(self, batch: LocalBatch) -> torch.Tensor:
        """Pool the received ids on this rank's shards: [sum_s B_s, widths[rank]]."""
        if self.shards is None:
            return torch.zeros(batch.features.stride(), 0, device=self._anchor.device)
        return self.shards(batch.features).values()

    def output_dist(
        self,
        pooled: torch.Tensor,
        batch: LocalBatch,
        pooled_dp: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the pooled vectors to the ranks that own the samples, in the collection's
        order: [B, sum of feature dims] (row-wise partial sums added, ``pooled_dp`` the
        replicated tables' columns, ``lengths`` [F, B] this rank's bag lengths, for mean
        pooling); backward sends their gradients the other way."""
        layout = PooledLayout(
            batch_sizes=batch.batch_sizes,
            local_width=self.routing.widths[self.rank],
            widths=self.routing.widths,
            forward=self.forward_precision,
            backward=self.backward_precision,
            grad_scale=1.0 / self.world_size,
            assembly=self.routing.assembly,
        )
        lengths = lengths if self.routing.assembly.any_mean else None
        group, stats = self.process_group, self.comm_stats
        return pooled_all_to_all(pooled, layout, self._anchor, group, stats, pooled_dp, lengths)

    # -----------------------------------------------------------------------------------------
    # The collection interface

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    def communication_seconds(self) -> float:
        return self.comm_stats.seconds

    def ddp_parameters(self) -> list[nn.Parameter]:
        """The replicated tables when a torch optimizer trains them (DDP averages their
        gradients). Shards are never DDP's: each rank holds different ones."""
        if self.optimizer is not None or self.replicated is None:
            return []
        return list(self.replicated.parameters())

    def logical_optimizer_state(self, prefix: str, state: dict[str, Any]) -> dict[str, Any]:
        return logical_optimizer_state(self, prefix, state)

    def key_wise_tables(self) -> list[str]:
        """The dynamic (KEY_WISE) tables held in memory, in table order (a tiered one keeps
        its keys in its store, saved by :meth:`tiered_files`)."""
        return [
            c.name for c in self._configs if c.name in self._dynamic and c.name not in self._tiered
        ]

    def routing_of(self, table: str) -> KeyRouting:
        """How dynamic ``table``'s keys are routed to its shards."""
        return KeyRouting(self._dynamic[table].routing_buckets)

    def dynamic_stats(self) -> dict[str, dict[str, float]]:
        """Per dynamic table, its counters summed over ranks (``load_factor``: of the summed
        size and capacity), and the key balance: ``size_max_over_mean`` (the fullest rank's
        keys over the mean) and ``size_rank<r>`` per rank. A collective: every rank calls it
        (the trainer does, at every train log event)."""
        return key_wise_stats(self)

    def live_keys(self, name: str) -> torch.Tensor | None:
        """The keys dynamic ``name`` holds on every rank, ascending (None for a fixed table):
        gathered from the ranks, a collective (see
        :func:`~recsys.distributed.sharded_dynamic.gathered_keys`)."""
        return gathered_keys(self, name) if name in self._dynamic else None

    def take_delta(self) -> dict[str, TableDelta]:
        """This rank's part of every dynamic table's delta (the keys it owns)."""
        if self.shards is None:
            return {}
        return self.shards.take_delta()

    def variable_state_keys(self) -> list[str]:
        """The dynamic tables' state keys (their sizes change as they train)."""
        return [k for name in self.key_wise_tables() for k in table_state_keys(self, name)]

    def load_targets(self, state: dict[str, Any], saved: SavedState, prefix: str) -> None:
        """As the interface's, with each rank's part of a dynamic table read by routing bucket
        (see :mod:`recsys.distributed.sharded_dynamic`)."""
        key_wise_targets(self, state, saved, prefix)

    def is_replicated(self, table: str) -> bool:
        """Whether ``table`` is DATA_PARALLEL (every rank holds it whole)."""
        return ShardingType(self.plan[table].sharding_type) == ShardingType.DATA_PARALLEL

    def local_table(self, table: str) -> EmbeddingTable | None:
        """This rank's shard of a sharded ``table`` (None: it holds none)."""
        if self.shards is None or table not in self.shards.embedding_bags:
            return None
        return self.shards.embedding_bags[table]

    def local_shard(self, table: str) -> Shard:
        """Where this rank's shard of ``table`` sits in the table."""
        return next(s for s in self.plan[table].shards if s.rank == self.rank)

    def optimizer_step(self) -> torch.Tensor:
        """The fused optimizer's step counter (shards and replicated tables agree)."""
        if self.shards is not None:
            return self.shards.optimizer_step
        if self.replicated is not None:
            return self.replicated.step
        return torch.zeros((), dtype=torch.int64)

    def table_parameter_names(self) -> dict[str, str]:
        """Table name -> the name of the parameter holding it (or this rank's shard of it)."""
        holders = {}
        for c in self._configs:
            if self.is_replicated(c.name):
                holders[id(self.replicated.weight(c.name))] = c.name
            elif (local := self.local_table(c.name)) is not None:
                holders[id(local.weight)] = c.name
        return {holders[id(p)]: n for n, p in self.named_parameters() if id(p) in holders}

    # -----------------------------------------------------------------------------------------
    # State dict in the logical layout (recsys.distributed.sharded_state)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The unsharded collection's keys and shapes: sharded tables as ShardedTensors of
        their full [num_embeddings, embedding_dim] (optimizer states likewise), replicated
        tables as plain tensors."""
        if args:
            raise TypeError("state_dict takes keyword arguments only")
        out = {} if destination is None else destination
        out.update(logical_state(self, prefix, keep_vars))
        out.update(key_wise_state(self, prefix))
        if self.key_wise_tables():
            out[prefix + DYNAMIC_STEP] = self.shards.dynamic_step
        return out

    def _state_keys(self) -> list[str]:
        """The keys of :meth:`state_dict`, without building it (no collective, no sort of a
        dynamic table's keys)."""
        keys = list(logical_state(self, "", keep_vars=False)) + self.variable_state_keys()
        return keys + ([DYNAMIC_STEP] if self.key_wise_tables() else [])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """Load the logical layout (plain full tensors, or ShardedTensors whose local shard is
        this rank's): each rank copies its own shards' rows and columns. The internal
        submodules' own keys are never expected (see ``hide_internal_keys``)."""
        self.load_prefix = prefix
        expected = {prefix + key for key in self._state_keys()}
        given = {key for key in state_dict if key.startswith(prefix)}
        missing_keys.extend(sorted(expected - given))
        unexpected_keys.extend(sorted(given - expected))
        dynamic: dict[str, dict[str, Any]] = {name: {} for name in self.key_wise_tables()}
        with torch.no_grad():
            for key in sorted(expected & given):
                relative = key[len(prefix) :]
                parts = relative.split(".")
                if relative == DYNAMIC_STEP:
                    self.shards.dynamic_step.copy_(torch.as_tensor(state_dict[key]))
                elif len(parts) == 3 and parts[1] in dynamic:
                    dynamic[parts[1]][relative] = state_dict[key]
                else:
                    load_logical(self, relative, state_dict[key])
            for name, entries in dynamic.items():
                if f"{DYNAMIC}.{name}.keys" in entries:
                    load_key_wise(self, name, entries)
