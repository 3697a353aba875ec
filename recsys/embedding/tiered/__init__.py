"""Tiered tables: tables in host memory or on disk behind a cache where the kernels run.

- ``collection.py``: :class:`TieredEmbeddingBagCollection`, the pooled collection.
- ``mixin.py``: :class:`TieredTables`, what tiered tables add to a pooled or unpooled collection.
- ``options.py``: :class:`StorageOptions` (a table's tier and cache), :class:`RowBlock`,
  :func:`tiered_layout`.
- ``row_store.py``, ``store_lock.py``: every row of a table, in host memory or a file, and the
  lock of a store's directory.
- ``row_cache.py``: :class:`RowCache`, the cache rows in the packed buffers.
- ``prefetch.py``: a coming batch's rows prepared in a background thread.
- ``files.py``: the tiered tables' rows streamed into and out of checkpoints.

``recsys.embedding.tiered`` re-exports the names its module had in earlier releases.
"""

from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.tiered.options import (
    TIERS,
    RowBlock,
    StorageOptions,
    TieredLayout,
    tiered_layout,
)

__all__ = [
    "TIERS",
    "RowBlock",
    "StorageOptions",
    "TieredEmbeddingBagCollection",
    "TieredLayout",
    "TieredTables",
    "tiered_layout",
]
