"""Dynamic and tiered tables in the unpooled EmbeddingCollection
(:mod:`recsys.embedding.unpooled`), as the pooled bag collection has them: the same id -> slot
maps, caches and stores in front of the same packed buffers, fused lookup and fused optimizers
(one vector per id instead of one per bag).

- :class:`DynamicEmbeddingCollection`: tables keyed by any int64 id, growing as training brings
  new keys (:mod:`recsys.embedding.dynamic.collection`). Keys without a row (outside training, or
  not admitted yet) read the zero row and take no update. ``live_keys(table)`` lists the keys a
  table holds: a retrieval model's item corpus.
- :class:`TieredEmbeddingCollection`: tables in host memory or on disk behind a cache
  (:mod:`recsys.embedding.tiered.collection`). A lookup outside training with more distinct ids than
  a cache holds is looked up in runs of ids that fit (each id's vector is its row alone).

Both train bitwise like a fixed :class:`EmbeddingCollection` holding the same rows, and save
their state as their pooled twins do (keys and rows in key order; tiered rows streamed), under
TorchRec's ``embeddings.<table>....`` keys.

Example::

    ec = DynamicEmbeddingCollection(
        [EmbeddingConfig(name="item", embedding_dim=32, num_embeddings=4096,
                         feature_names=["history", "candidates"])],
        dynamic=DynamicTableOptions(),
        optimizer=RowWiseAdagrad(lr=0.05),
    )
    ec(kjt_of_raw_item_keys)["history"].values()  # [ids, 32]; new keys inserted
    ec.live_keys("item")                           # the keys it holds, ascending
"""

from __future__ import annotations

import itertools

import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from recsys.embedding.dynamic.mixin import DynamicTables, keyed_tables
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.tiered.options import RowBlock, StorageOptions, tiered_layout
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.ops._triton import accumulate_dtype

__all__ = ["DynamicEmbeddingCollection", "TieredEmbeddingCollection"]


class DynamicEmbeddingCollection(DynamicTables, EmbeddingCollection):
    """An :class:`EmbeddingCollection` whose tables named in ``dynamic`` take any int64 id.

    Args:
        tables: ``torchrec.EmbeddingConfig`` per table; a dynamic table's ``num_embeddings`` is
            the number of rows it starts with.
        dynamic: :class:`DynamicTableOptions` for every table, or a dict table name -> options
            for some (the others are fixed tables, ids in ``[0, num_embeddings)``).
        device, need_indices, backend, validate, optimizer: as for EmbeddingCollection (a
            dynamic table is trained by a fused optimizer, or frozen).
        seed: a key's initial row depends only on (seed, table, key).
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        dynamic: DynamicTableOptions | dict[str, DynamicTableOptions],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        seed: int = 0,
        backend: str = "auto",
        validate: bool = True,
        optimizer: FusedOptimizer | None = None,
    ) -> None:
        keyed, packed = keyed_tables(tables, dynamic, seed, optimizer, device, backend)
        super().__init__(packed, device, need_indices, backend=backend, validate=validate)
        self._init_dynamic(tables, keyed, seed, optimizer)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The logical tables' configs (a dynamic table's ``num_embeddings``: the rows it
        started with; :meth:`live_keys` says which keys it holds)."""
        return self._logical_configs


class TieredEmbeddingCollection(TieredTables, EmbeddingCollection):
    """An :class:`EmbeddingCollection` whose tables may live in host memory or on disk behind a
    cache (arguments as :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection`'s,
    with ``need_indices`` as EmbeddingCollection's)."""

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        storage: StorageOptions | dict[str, StorageOptions],
        optimizer: FusedOptimizer,
        dynamic: dict[str, DynamicTableOptions] | None = None,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        seed: int = 0,
        backend: str = "auto",
        validate: bool = True,
        blocks: dict[str, RowBlock] | None = None,
    ) -> None:
        layout = tiered_layout(tables, storage, optimizer, dynamic)
        super().__init__(
            layout.packed,
            device,
            need_indices,
            backend=backend,
            validate=validate,
            optimizer=optimizer,
        )
        self._init_tiered(tables, layout, seed, blocks)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The logical tables' configs (``num_embeddings``: a fixed table's rows, not its
        cache's)."""
        return self._logical_configs

    def _rows(
        self, features: KeyedJaggedTensor, positions: list[int], ids_per_key: list[int]
    ) -> list[torch.Tensor]:
        """As EmbeddingCollection's; outside training, a batch with more distinct ids than a
        cache holds is looked up in runs of ids that fit, one after the other (an id's vector
        is its row alone), which forgets the prefetched batches (each is then prepared by its
        own forward)."""
        evaluating = self.caches and not self._trains() and not torch.compiler.is_exporting()
        if not evaluating or features.values().is_meta:
            return super()._rows(features, positions, ids_per_key)
        if self._fits(features, self._room_beside_prefetched()):
            return super()._rows(features, positions, ids_per_key)
        self.drop_prefetched()
        room = min(cache.num_rows for cache in self.caches.values())
        values, starts, keys = features.values(), features.offset_per_key(), features.keys()
        dtype = accumulate_dtype(self._flat.dtype)
        out = []
        for feature, (k, table) in enumerate(
            zip(positions, self._plan.feature_to_table, strict=True)
        ):
            runs = [values.new_zeros(0, self._layout.dims[table], dtype=dtype)]
            for start in range(starts[k], starts[k + 1], room):
                stop = min(start + room, starts[k + 1])
                lengths = [0] * len(keys)
                lengths[k] = stop - start
                piece = KeyedJaggedTensor(
                    keys=keys,
                    values=values[start:stop],
                    lengths=values.new_tensor(lengths),
                    stride=1,
                    length_per_key=lengths,
                    offset_per_key=[0, *itertools.accumulate(lengths)],
                )
                runs.append(super()._rows(piece, positions, lengths)[feature])
            out.append(torch.cat(runs))
        return out
