"""Dynamic tables: tables keyed by raw 64-bit ids, with no vocabulary.

- ``collection.py``: :class:`DynamicEmbeddingBagCollection`, the pooled collection.
- ``mixin.py``: :class:`DynamicTables`, what dynamic tables add to a pooled or unpooled collection.
- ``table.py``: :class:`DynamicTableOptions`; one table's map, admission counter and zero row.
- ``slot_map.py``, ``slot_layout.py``, ``score_policy.py``: the id -> slot map, its tensors and
  its eviction scores.
- ``key_arena.py``, ``arena_find.py``, ``arena_placement.py``, ``arena_admission.py``: the maps of
  a collection's LRU / LFU tables in one buffer, looked up together.
- ``admission.py``: the admission counter; ``key_routing.py``: keys to routing buckets (ranks).

``recsys.embedding.dynamic`` re-exports the collection (the import path of earlier releases).
"""

from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.mixin import DYNAMIC, DynamicTables, keyed_tables

__all__ = ["DYNAMIC", "DynamicEmbeddingBagCollection", "DynamicTables", "keyed_tables"]
