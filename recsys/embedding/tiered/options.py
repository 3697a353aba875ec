"""The options of a :class:`~recsys.embedding.tiered.collection.TieredEmbeddingBagCollection`: each
table's storage tier and cache (:class:`StorageOptions`), and the block of a larger table that a
row-wise shard holds (:class:`RowBlock`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import options_by_table, row_bytes
from recsys.embedding.tiered.row_cache import CACHE_POLICIES

__all__ = ["TIERS", "RowBlock", "StorageOptions", "TieredLayout", "tiered_layout"]

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


@dataclass
class TieredLayout:
    """How a tiered collection's tables are held (see :func:`tiered_layout`)."""

    options: dict[str, StorageOptions]  # every table's (``"device"`` for the untiered)
    dynamic: dict[str, DynamicTableOptions]  # the tiered tables keyed by raw ids
    tiered: dict[str, BaseEmbeddingConfig]  # the tables in host memory or on disk
    record_bytes: dict[str, int]  # a tiered table's bytes per row (weights and state)
    cache_rows: dict[str, int]  # a tiered table's cache rows
    packed: list[BaseEmbeddingConfig]  # the packed tables: a tiered table's cache + 1 row


def tiered_layout(
    tables: list[BaseEmbeddingConfig],
    storage: StorageOptions | dict[str, StorageOptions],
    optimizer: FusedOptimizer,
    dynamic: dict[str, DynamicTableOptions] | None,
) -> TieredLayout:
    """Each table's tier and cache, checked (arguments as
    :class:`TieredEmbeddingBagCollection`'s).

    Raises:
        ValueError: a bad option (named), a dynamic table that is not tiered, or no fused
            optimizer."""
    if not isinstance(optimizer, FusedOptimizer):
        raise ValueError(
            f"optimizer={optimizer!r}; a tiered table is trained by a fused optimizer "
            "(its rows and their state move between tiers together)"
        )
    given = options_by_table(tables, storage, StorageOptions, "storage")
    options = {c.name: given.get(c.name, StorageOptions()) for c in tables}
    dynamic = dict(dynamic or {})
    untiered = [name for name in dynamic if options[name].tier == "device"]
    if untiered:
        raise ValueError(
            f"dynamic tables {untiered} have storage tier 'device' in a tiered collection; "
            "give them tier 'host' or 'disk' (or use a dynamic collection)"
        )
    for name, table_options in dynamic.items():
        unsupported = {
            key: getattr(table_options, key)
            for key in ("max_capacity", "memory_budget_mb", "ttl_steps")
            if getattr(table_options, key)
        }
        if unsupported:
            raise ValueError(
                f"dynamic table '{name}' is tiered, which keeps every key it admits: "
                f"{unsupported} is not supported there yet; expected 0 (or tier 'device')"
            )
    tiered = {c.name: c for c in tables if options[c.name].tier != "device"}
    record_bytes = {name: row_bytes(config, optimizer) for name, config in tiered.items()}
    # A fixed table's cache never needs more rows than the table has.
    cache_rows = {
        n: options[n].rows(record_bytes[n])
        if n in dynamic
        else min(options[n].rows(record_bytes[n]), c.num_embeddings)
        for n, c in tiered.items()
    }
    packed = [
        replace(c, num_embeddings=cache_rows[c.name] + 1) if c.name in tiered else c for c in tables
    ]
    for config in tables:
        if not config.feature_names:
            config.feature_names = [config.name]
    return TieredLayout(options, dynamic, tiered, record_bytes, cache_rows, packed)
