"""TieredEmbeddingBagCollection: tables larger than memory, a cache where the kernels run in front
of a store in host memory or on local disk, prefetched one batch ahead.

Each table has a storage tier (:class:`StorageOptions`):

- ``"device"``: the whole table in the collection's packed buffers (as an EmbeddingBagCollection).
- ``"host"``: every row in host memory (pinned when the collection is on CUDA), a cache of
  ``cache_rows`` rows in the packed buffers on the collection's device.
- ``"disk"``: every row in a file under ``path`` (:mod:`recsys.embedding.tiered.row_store`), the
  cache in the collection's device memory (on a CPU-only machine, in RAM).

A fixed tiered table's ids are row numbers in ``[0, num_embeddings)``; a dynamic one (named in
``dynamic``) takes any int64 key, admitted as :class:`~recsys.embedding.dynamic.table.
DynamicTableOptions` say, and keeps every key it admits (no cap, no expiry: the store is the
table). Both read through the same id -> slot map in front of the packed buffers::

    ids -> unique -> cache (hit | miss: evict cold rows, dirty ones written back; read the
           row from the store, or initialize it) -> cache rows -> fused lookup + fused update

- **Exact.** A row's weights and optimizer state move together, as bytes, so a tiered table
  trains bitwise like the same table held whole in memory (tests compare every fused
  optimizer, fixed and dynamic), whatever the cache size and policy.
- **Lazy, deterministic initial rows.** A row the store never held starts from
  :func:`~recsys.embedding.row_init.initial_rows` of (seed, table, row or key) and the
  optimizer's initial state: no write of the whole table before the first step, and the same
  row wherever and whenever it is first touched. (A fixed tiered table therefore ignores its
  config's ``init_fn``; its bound is TorchRec's default, ``sqrt(1 / num_embeddings)``.)
- **Prefetch.** :meth:`TieredEmbeddingBagCollection.prefetch` prepares the next batch's rows in
  a background thread while the current batch trains (the trainer's pipeline calls it); rows of
  the batch in flight are pinned and never evicted under it. A batch whose rows do not fit
  beside them is prepared in its own forward instead (``prefetch_deferred``).
- **Any cache size.** A batch with more distinct rows than a cache holds grows that cache by
  the rows it lacks, in its forward (``grown`` counts them; the rows and state in the cache
  stay where they are): it trains bitwise as with a cache that was large enough from the
  start. The cache keeps its new size; ``cache_rows`` is where it starts.
- **Checkpoints** stream a tiered table in chunks (:meth:`save_tiered`, :meth:`load_tiered`);
  ``state_dict()`` holds its other state but not its rows, which no memory could hold.
- **Counters**: :meth:`tiered_stats` (hits, misses, rows fetched, initialized, evicted, written
  back, bytes read and written, seconds a forward waited for its prefetch).

Example::

    ebc = TieredEmbeddingBagCollection(
        [EmbeddingBagConfig(name="ads", embedding_dim=64, num_embeddings=500_000_000,
                            feature_names=["ad_id"])],
        storage=StorageOptions(tier="disk", cache_rows=2_000_000, path="/nvme/tables"),
        optimizer=RowWiseAdagrad(lr=0.05),
    )
"""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.inputs import sample_range
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.tiered.options import RowBlock, StorageOptions, tiered_layout

__all__ = ["TieredEmbeddingBagCollection"]


class TieredEmbeddingBagCollection(TieredTables, EmbeddingBagCollection):
    """An EmbeddingBagCollection whose tables may live in host memory or on disk behind a cache.

    Args:
        tables: the tables (``num_embeddings``: a fixed table's rows; a dynamic table's
            initial-row bound is ``sqrt(1 / num_embeddings)`` unless its options set one).
        storage: :class:`StorageOptions` for every table, or a dict table name -> options (the
            others are ``"device"``).
        optimizer: the fused optimizer (tiered rows carry its state; required).
        dynamic: table name -> :class:`DynamicTableOptions` of the tiered tables keyed by raw
            ids (only ``admit_after``, ``admission_capacity``, ``bucket_size`` and
            ``init_bound`` apply: a tiered dynamic table keeps every key it admits).
        is_weighted, device, backend, validate: as for EmbeddingBagCollection. On the
            ``meta`` device no store is made (a sharded collection builds each rank's part).
        seed: a row's initial value is a function of (seed, table, row or key).
        blocks: table name -> :class:`RowBlock`, for fixed tables that are one block of a
            larger table (default: each table whole).

    Raises:
        ValueError: a bad option (named), a table named twice, a dynamic table that is not
            tiered, or no fused optimizer.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        storage: StorageOptions | dict[str, StorageOptions],
        optimizer: FusedOptimizer,
        dynamic: dict[str, DynamicTableOptions] | None = None,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        seed: int = 0,
        backend: str = "auto",
        validate: bool = True,
        blocks: dict[str, RowBlock] | None = None,
    ) -> None:
        layout = tiered_layout(tables, storage, optimizer, dynamic)
        super().__init__(
            layout.packed,
            is_weighted,
            device,
            backend=backend,
            validate=validate,
            optimizer=optimizer,
        )
        self._init_tiered(tables, layout, seed, blocks)

    def pooled_values(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """As EmbeddingBagCollection's. A batch that does not train (an evaluation) and has
        more distinct rows than a cache holds is pooled in pieces of samples that fit, one after
        the other (pooling reads only each sample's own rows): an evaluation batch may be
        larger than the training batches the caches were sized for."""
        evaluating = self.caches and not self._trains() and not torch.compiler.is_exporting()
        if evaluating and not features.values().is_meta:
            pieces = self._pieces_that_fit(features)
            if len(pieces) > 1:
                pool = super().pooled_values
                return torch.cat([pool(piece) for piece in pieces])
        return super().pooled_values(features)

    def _pieces_that_fit(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """``features`` whole when its rows fit in every cache beside the prefetched batches'
        rows; else cut into runs of samples that fit (halving until they do; a single sample
        is left whole). Cutting forgets the prefetched batches (each is then prepared by its
        own forward): rows are pinned by ticket order, so the pieces' rows would stay pinned
        behind theirs."""

        def split(piece: KeyedJaggedTensor, room: dict[str, int]) -> list[KeyedJaggedTensor]:
            if piece.stride() == 1 or self._fits(piece, room):
                return [piece]
            half = piece.stride() // 2
            first = sample_range(piece, 0, half)
            return split(first, room) + split(sample_range(piece, half, piece.stride()), room)

        if self._fits(features, self._room_beside_prefetched()):
            return [features]
        self.drop_prefetched()
        return split(features, {name: cache.num_rows for name, cache in self.caches.items()})
