"""Alias of :mod:`recsys.embedding.tiered.row_store`, kept so that ``recsys.embedding.row_store``
keeps working (``docs/serving.md`` names this module). New code imports from
:mod:`recsys.embedding.tiered.row_store`.
"""

from recsys.embedding.tiered.row_store import (
    DiskRecords,
    FixedStore,
    HostRecords,
    KeyedStore,
    RecordArray,
    RowBits,
    RowStore,
    store_directory,
)

__all__ = [
    "DiskRecords",
    "FixedStore",
    "HostRecords",
    "KeyedStore",
    "RecordArray",
    "RowBits",
    "RowStore",
    "store_directory",
]
