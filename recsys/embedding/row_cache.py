"""Alias of :mod:`recsys.embedding.tiered.row_cache`, kept so that ``recsys.embedding.row_cache``
keeps working (``docs/serving.md`` names this module). New code imports from
:mod:`recsys.embedding.tiered.row_cache`.
"""

from recsys.embedding.tiered.row_cache import CACHE_POLICIES, CacheTooSmallError, RowCache, RowCodec

__all__ = ["CACHE_POLICIES", "CacheTooSmallError", "RowCache", "RowCodec"]
