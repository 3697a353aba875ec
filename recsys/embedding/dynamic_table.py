"""Alias of :mod:`recsys.embedding.dynamic.table`, kept so that ``recsys.embedding.dynamic_table``
keeps working (README's examples import ``DynamicTableOptions`` from here). New code imports from
:mod:`recsys.embedding.dynamic.table`.
"""

from recsys.embedding.dynamic.table import DynamicTable, DynamicTableOptions, load_every_key

__all__ = ["DynamicTable", "DynamicTableOptions", "load_every_key"]
