"""The options of a :class:`~recsys.embedding.tiered.TieredEmbeddingBagCollection`: each table's
storage tier and cache (:class:`StorageOptions`), and the block of a larger table that a
row-wise shard holds (:class:`RowBlock`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recsys.embedding.row_cache import CACHE_POLICIES

__all__ = ["TIERS", "RowBlock", "StorageOptions"]

TIERS = ("device", "host", "disk")


@dataclass
class StorageOptions:
    """Where one table's rows live, and its cache."""

    tier: str = "device"
    """``"device"`` (whole in the packed buffers), ``"host"`` or ``"disk"`` (a cache in front)."""
    cache_rows: int = 0
    """Rows of the cache (host and disk tiers); 0: from ``cache_mb``."""
    cache_mb: float = 0.0
    """MiB of the cache's rows and optimizer state, when ``cache_rows`` is 0."""
    policy: str = "lru"
    """Which unpinned rows leave the cache first: least recently (lru) or often (lfu) used."""
    path: str = ""
    """Directory of the disk tier's files (one per table)."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"storage tier {self.tier!r}; expected one of {list(TIERS)}")
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"storage policy {self.policy!r}; expected 'lru' or 'lfu'")
        if self.cache_rows < 0 or self.cache_mb < 0 or not math.isfinite(self.cache_mb):
            raise ValueError(
                f"storage cache_rows={self.cache_rows}, cache_mb={self.cache_mb}; expected >= 0"
            )
        if self.tier != "device" and not (self.cache_rows or self.cache_mb):
            raise ValueError(f"storage tier {self.tier!r} needs cache_rows or cache_mb > 0")
        if self.tier == "disk" and not self.path:
            raise ValueError("storage tier 'disk' needs a path (a directory on local disk)")

    def rows(self, record_bytes: int) -> int:
        """Cache rows for rows of ``record_bytes`` bytes (weights and optimizer state)."""
        return self.cache_rows or max(int(self.cache_mb * 2**20) // record_bytes, 1)


@dataclass(frozen=True)
class RowBlock:
    """The rows of a fixed table that a collection's table holds when it is one block of a
    larger table (a row-wise shard): its row ``r`` is the table's row ``offset + r``, which gives
    its initial value (the table's, bound ``sqrt(1 / table_rows)``) and its key in checkpoints."""

    offset: int
    table_rows: int
