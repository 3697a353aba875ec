"""ShardedEmbeddingCollection: the unpooled :class:`recsys.EmbeddingCollection` sharded over the
ranks of a process group, on the pooled collection's machinery.

An unpooled lookup is a pooled lookup whose bags hold one id each (the single-process
collection runs that way too). The sharded one builds a pooled twin of the collection: one
sum-pooled bag table per table, read by one feature (``"<table> (<its features>)"``), whose
"samples" on this rank are the ids of every feature of that table in the batch, concatenated
in the table's feature order::

    KJT (history: [3 7 | 7 1 9], candidates: [4 | 2])          this rank's batch
      -> table "item": bags of one id [3] [7] [7] [1] [9] [4] [2]    T = 7 ids
      -> ShardedEmbeddingBagCollection: input_dist, lookup on the owner, output_dist
      -> [T, D] rows, in input order -> history [5, D], candidates [2, D] (JaggedTensors)

So every placement of the pooled collection works unchanged (TABLE_WISE, ROW_WISE, COLUMN_WISE,
DATA_PARALLEL; mixed plans), with its fused optimizer (duplicates reduced on the owner, no
dense gradient), quantized communication, pipelined input_dist and the logical state dict,
keyed ``embeddings.<table>.weight`` as the unsharded collection's, so checkpoints move between
any numbers of ranks. Each rank gets its own ids' rows back, in input order. The ranks' id
counts differ freely (the pooled collection takes a batch size per rank). With several tables,
a rank's "batch" is its largest table's id count and the other tables' bags past their own
count are empty (zero rows, not returned): a cost in exchanged bytes only when the tables'
counts differ much, and none with one table (SASRec, HSTU).

Dynamic and tiered tables shard the same way, their twin being of their kind
(:func:`pooled_twin`): a dynamic table of a
:class:`~recsys.embedding.unpooled_tables.DynamicEmbeddingCollection` is KEY_WISE (each key
routed to the rank owning its routing bucket, inserted and updated there; keys without a row read
zeros), saved by key in the logical layout of the one-process collection
(:mod:`recsys.distributed.sharded_dynamic`: ``embeddings.<t>.weight`` and ``dynamic.<t>.keys``
...), so a checkpoint loads on any number of ranks. :meth:`live_keys` gathers every rank's keys
(a collective): a sequence model's ranking corpus and uniform negatives see every rank's items.
A :class:`~recsys.embedding.unpooled_tables.TieredEmbeddingCollection` (built on ``meta``) is
sharded TABLE_WISE or ROW_WISE (KEY_WISE when dynamic), each rank's shard in a store of its
own.

The host must know each feature's id count (the KJT's ``length_per_key``, which recsys'
batches carry); without it, it is read from the device, as in the unsharded collection.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsys.distributed.plan import TableSharding
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.distributed.sharded_dynamic import pooled_key
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.inputs import FeatureOrder, input_weights
from recsys.embedding.interface import UNPOOLED_TABLES
from recsys.embedding.tables import output_keys
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection, TieredEmbeddingCollection


def bag_feature(config: EmbeddingConfig) -> str:
    """The pooled twin's one feature of a table: ``"<table> (<feature>, ...)"``, so an input
    error names the table and its features."""
    return f"{config.name} ({', '.join(config.feature_names)})"


def pooled_twin(module: EmbeddingCollection) -> EmbeddingBagCollection:
    """The pooled collection an EmbeddingCollection is sharded as: per table, a sum-pooled bag
    table of the same rows (values, optimizer and its state) read by one feature
    (:func:`bag_feature`); of the collection's kind: a
    :class:`~recsys.embedding.unpooled_tables.DynamicEmbeddingCollection` becomes a
    :class:`~recsys.embedding.dynamic.collection.DynamicEmbeddingBagCollection` with the same
    options, seed and keys, a :class:`~recsys.embedding.unpooled_tables.TieredEmbeddingCollection`
    (on ``meta``) a :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection` with
    the same storage, dynamic options and seed.

    Raises:
        ValueError: not an unpooled recsys collection, or a tiered one off the meta device."""
    kinds = (EmbeddingCollection, DynamicEmbeddingCollection, TieredEmbeddingCollection)
    if type(module) not in kinds:
        raise ValueError(
            f"ShardedEmbeddingCollection shards a recsys.EmbeddingCollection (plain, dynamic or "
            f"tiered), got a {type(module).__name__}"
        )
    configs = [
        EmbeddingBagConfig(
            name=c.name,
            embedding_dim=c.embedding_dim,
            num_embeddings=c.num_embeddings,
            feature_names=[bag_feature(c)],
            pooling=PoolingType.SUM,
            data_type=c.data_type,
            init_fn=c.init_fn,
        )
        for c in module.embedding_configs()
    ]
    common = {"device": module.device, "backend": module.backend, "validate": module.validate}
    if isinstance(module, TieredEmbeddingCollection):
        if module.device.type != "meta":
            raise ValueError(
                "a tiered EmbeddingCollection is sharded from the meta device (build it with "
                "device='meta'): its rows are in its store, which no rank copies whole"
            )
        twin: EmbeddingBagCollection = TieredEmbeddingBagCollection(
            configs,
            dict(module.storage),
            module.optimizer,
            dict(module.dynamic_options),
            seed=module.seed,
            **common,
        )
    elif isinstance(module, DynamicEmbeddingCollection):
        options = {name: table.options for name, table in module.dynamic.items()}
        twin = DynamicEmbeddingBagCollection(
            configs, options, seed=module.seed, optimizer=module.optimizer, **common
        )
    else:
        twin = EmbeddingBagCollection(configs, optimizer=module.optimizer, **common)
    if module.device.type != "meta":
        twin.load_state_dict({pooled_key(key): value for key, value in module.state_dict().items()})
    if module.is_frozen():
        for parameter in twin.parameters():
            parameter.requires_grad_(False)
    return twin


class ShardedEmbeddingCollection(ShardedEmbeddingBagCollection):
    """The sharded twin of :class:`recsys.EmbeddingCollection` (see the module docstring).

    Args:
        module: the collection to shard (its tables' values, fused optimizer and state are
            copied; on ``meta``, shards start from their tables' initial rows).
        plan: table name -> :class:`TableSharding`, as for the pooled collection
            (:func:`recsys.distributed.planner.plan_sharding` plans these tables too).
        **options: as :class:`ShardedEmbeddingBagCollection`'s (``process_group``,
            ``forward_precision``, ``backward_precision``, ``device``, ``seed``).

    Example (under ``torchrun --nproc-per-node=2``)::

        ec = EmbeddingCollection([EmbeddingConfig(name="item", embedding_dim=64,
                                                  num_embeddings=10**6,
                                                  feature_names=["history", "candidates"])],
                                 optimizer=Adam(lr=1e-3))
        sharded = ShardedEmbeddingCollection(ec, {"item": row_wise(10**6, 64, 2)})
        rows = sharded(kjt)["history"]  # JaggedTensor of this rank's ids, in input order
    """

    tables_key = UNPOOLED_TABLES

    def __init__(
        self,
        module: EmbeddingCollection,
        plan: Mapping[str, TableSharding],
        **options,
    ) -> None:
        super().__init__(pooled_twin(module), plan, **options)
        self._sequence_configs: list[EmbeddingConfig] = module.embedding_configs()
        self._need_indices = module.need_indices()
        self._sequence_features = FeatureOrder(
            [f for c in self._sequence_configs for f in c.feature_names]
        )
        self._sequence_names, _ = output_keys(self._sequence_configs)
        self._bag_features = [bag_feature(c) for c in self._sequence_configs]
        self._virtual: tuple[KeyedJaggedTensor, KeyedJaggedTensor, list[int]] | None = None

    # -----------------------------------------------------------------------------------------
    # Forward

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:  # type: ignore[override]
        """Look up every id of this collection's features in this rank's batch: KJT with (at
        least) them -> each feature's JaggedTensor (the unsharded collection's names, values
        [ids of the feature, its table's dim] in input order). A collective: every rank of the
        group must call it."""
        bags, ids_per_key = self._bags_of(features)
        pooled = super().forward(bags).values()  # [S, sum of the tables' dims]
        positions = self._sequence_features.positions(features.keys())
        B, values = features.stride(), features.values()
        starts = features.offset_per_key()
        lengths, offsets = features.lengths(), features.offsets()
        out, column, name, index = {}, 0, iter(self._sequence_names), 0
        for config in self._sequence_configs:
            width, row = config.embedding_dim, 0
            for _ in config.feature_names:  # features in table order, as positions are
                k = positions[index]
                index += 1
                rows = pooled[row : row + ids_per_key[k], column : column + width]
                out[next(name)] = JaggedTensor(
                    values=rows,
                    lengths=lengths[k * B : (k + 1) * B],
                    offsets=offsets[k * B : (k + 1) * B + 1] - starts[k],
                    weights=values[starts[k] : starts[k + 1]] if self._need_indices else None,
                )
                row += ids_per_key[k]
            column += width
        return out

    def prefetch_input(self, features: KeyedJaggedTensor) -> None:
        """Run the input_dist of ``features`` now, for a forward of the same object later (see
        the pooled collection's)."""
        bags, _ = self._bags_of(features)
        super().prefetch_input(bags)

    def drop_prefetched(self) -> None:
        self._virtual = None
        super().drop_prefetched()

    def _bags_of(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, list[int]]:
        """The pooled twin's input for ``features`` (one bag per id, see the module docstring)
        and the ids per KJT key; the same object again for the same ``features`` (so a
        prefetched input_dist is found)."""
        if self._virtual is not None and self._virtual[0] is features:
            return self._virtual[1], self._virtual[2]
        input_weights(features, False)  # one batch size for every key
        positions = self._sequence_features.positions(features.keys())
        ids_per_key = features.length_per_key()  # on the host (a sync if the KJT lacks it)
        starts = features.offset_per_key()
        values = features.values()
        per_table, pieces, index = [], [], 0
        for config in self._sequence_configs:
            count = 0
            for _ in config.feature_names:
                k = positions[index]
                pieces.append(values[starts[k] : starts[k + 1]])
                count += ids_per_key[k]
                index += 1
            per_table.append(count)
        stride = max(1, *per_table)
        slots = torch.arange(stride, device=values.device)
        lengths = torch.cat([(slots < count).to(torch.int64) for count in per_table])
        bags = KeyedJaggedTensor(
            keys=self._bag_features,
            values=torch.cat(pieces) if pieces else values[:0],
            lengths=lengths,
            stride=stride,
            length_per_key=per_table,
        )
        self._virtual = (features, bags, ids_per_key)
        return bags, ids_per_key

    # -----------------------------------------------------------------------------------------
    # The collection interface: the unsharded collection's tables and features

    def embedding_bag_configs(self) -> list[EmbeddingConfig]:  # type: ignore[override]
        """The logical tables, in output order (as the unsharded collection's)."""
        return self._sequence_configs

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The tables' configs (TorchRec's name)."""
        return self._sequence_configs

    def need_indices(self) -> bool:
        """Whether each output JaggedTensor carries its ids as ``weights()``."""
        return self._need_indices
