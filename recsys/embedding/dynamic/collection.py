"""DynamicEmbeddingBagCollection: tables keyed by raw 64-bit ids, with no vocabulary.

An :class:`~recsys.embedding.collection.EmbeddingBagCollection` whose chosen tables are
**dynamic**: their ids are any int64 keys (raw hashes of strings included), a key gets a row the
first time a training batch brings it, and the table grows, evicts and expires rows on its own
(see :class:`~recsys.embedding.dynamic.table.DynamicTableOptions`). In front of the packed
buffers sits an id -> slot map per dynamic table (:mod:`recsys.embedding.dynamic.slot_map`); the
fused lookup kernels and fused optimizers run unchanged on the slots::

    ids -> unique -> map (find; admit; insert, growing or evicting) -> slots -> fused lookup

- **Fresh rows are clean.** A key that gets a row (new, or back after eviction or expiry)
  starts from :func:`~recsys.embedding.row_init.initial_rows` of (seed, table, key) and from the
  optimizer's initial state (zero Adam moments, the initial Adagrad sum): never from the row or
  state a previous key left in that slot.
- **Keys without a row pool as zeros** and receive no update: keys not admitted yet (options
  ``admit_after``), and any key the table does not hold when it is looked up outside training
  (``model.eval()``, a frozen table, an export). Validation and inference never insert.
- **Never silent.** A batch's own keys are never evicted by its inserts; a batch with more
  distinct keys than the table can hold, or that overfills a bucket at the cap, is a
  ValueError naming the table. :meth:`DynamicEmbeddingBagCollection.dynamic_stats` counts size,
  capacity, load factor, hits, inserts, evictions, expirations and admission rejections.
- **Checkpoints hold keys, not slots.** ``state_dict()`` has, per dynamic table, the rows of
  its live keys in ascending key order (``embedding_bags.<t>.weight`` ``[n, dim]`` and the
  optimizer state ``embedding_bags.<t>.<state>``) and ``dynamic.<t>.keys`` / ``scores`` /
  ``last_seen`` / ``num_buckets`` (/ ``admission_keys`` / ``admission_counts``); their sizes
  vary, so load a checkpoint through :func:`recsys.embedding.interface.state_to_load`.

A dynamic table is trained by the collection's fused optimizer (its rows move when it grows,
which a torch optimizer holding the parameter could not follow): training one without a fused
optimizer is a ValueError, unless it is frozen (``requires_grad_(False)``), when it only looks
keys up.

Example::

    from torchrec import EmbeddingBagConfig
    ebc = DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig(name="user", embedding_dim=16, num_embeddings=1024,
                            feature_names=["user_id"])],
        dynamic=DynamicTableOptions(max_capacity=1_000_000, score="lru", admit_after=2),
        optimizer=RowWiseAdagrad(lr=0.05),
    )
    ebc(kjt_with_raw_user_ids)       # inserts the keys it admits
    ebc.dynamic_stats()["user"]      # {"size": ..., "capacity": ..., "hits": ..., ...}
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.mixin import DynamicTables, keyed_tables
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import FusedOptimizer

__all__ = ["DynamicEmbeddingBagCollection"]


class DynamicEmbeddingBagCollection(DynamicTables, EmbeddingBagCollection):
    """An EmbeddingBagCollection whose tables named in ``dynamic`` take any int64 id.

    Args:
        tables: the tables, as for :class:`~recsys.embedding.collection.EmbeddingBagCollection`;
            a dynamic table's ``num_embeddings`` is the number of rows it starts with.
        dynamic: :class:`DynamicTableOptions` for every table, or a dict table name -> options
            for some (the others are fixed tables, ids in ``[0, num_embeddings)``).
        is_weighted, device, backend, validate, optimizer: as for EmbeddingBagCollection
            (``backend`` also picks the map kernels: Triton on CUDA, torch on CPU).
        seed: the seed of fresh rows: a key's initial row depends only on (seed, table, key).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        dynamic: DynamicTableOptions | dict[str, DynamicTableOptions],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        seed: int = 0,
        backend: str = "auto",
        validate: bool = True,
        optimizer: FusedOptimizer | None = None,
    ) -> None:
        keyed, packed = keyed_tables(tables, dynamic, seed, optimizer, device, backend)
        super().__init__(packed, is_weighted, device, backend=backend, validate=validate)
        self._init_dynamic(tables, keyed, seed, optimizer)
