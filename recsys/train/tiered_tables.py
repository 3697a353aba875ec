"""``[model.storage]`` -> each table's storage tier, and the tiered tables' counters as log fields.

Every table with at least ``min_rows`` rows (and every dynamic table) takes the section's tier
and cache options, changed per table by ``overrides`` (``"cat_3.tier=device"``). A disk tier
without a ``path`` keeps its files under ``<run dir>/tables``.
"""

from __future__ import annotations

import tempfile
from dataclasses import fields
from pathlib import Path

from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.config import StorageConfig
from recsys.embedding.interface import embedding_collections
from recsys.embedding.tiered import TIERS, StorageOptions
from recsys.train.dynamic_tables import parse_overrides

__all__ = [
    "TIERED_DIR",
    "TieredLog",
    "private_storage",
    "storage_options",
    "tiered_collections",
]

TIERED_DIR = "tables"
_OPTION_KEYS = [f.name for f in fields(StorageOptions) if f.name != "path"]


def storage_options(
    config: StorageConfig,
    tables: list[EmbeddingBagConfig],
    dynamic: list[str],
    run_dir: str | Path,
) -> dict[str, StorageOptions]:
    """Options per table, by name, for the tables not on the device (empty: none is tiered).

    Args:
        config: the ``[model.storage]`` section.
        tables: the collection's tables (``feature_names[0]``: the feature overrides name).
        dynamic: the features whose tables are dynamic (always tiered with the section's tier).
        run_dir: the run directory (the disk tier's default place).

    Raises:
        ValueError: a bad ``overrides`` entry or option (named).
    """
    features = [t.feature_names[0] for t in tables]
    overrides = parse_overrides(
        config.overrides,
        features,
        "model.storage",
        config,
        _OPTION_KEYS,
        {"tier": TIERS, "policy": ("lru", "lfu")},
    )
    path = config.path or str(Path(run_dir) / TIERED_DIR)
    options = {}
    for table, feature in zip(tables, features, strict=True):
        big = table.num_embeddings >= config.min_rows or feature in dynamic
        values = {key: getattr(config, key) for key in _OPTION_KEYS}
        if not big:
            values["tier"] = "device"
        values.update(overrides.get(feature, {}))
        if values["tier"] == "device":
            continue
        try:
            options[table.name] = StorageOptions(**values, path=path)
        except ValueError as error:
            raise ValueError(f"model.storage for feature '{feature}': {error}") from None
    return options


def private_storage(config: StorageConfig) -> tempfile.TemporaryDirectory | None:
    """Point ``config``'s disk tier at a new temporary directory, for a model read back from a
    checkpoint: never the training run's own files (a run may still be writing them), and a
    table larger than RAM stays on disk (sparse: only the checkpoint's rows take space). The
    directory goes when the returned object does: keep it as long as the model. None when no
    table is tiered."""
    if config.tier == "device" and not config.overrides:
        return None
    directory = tempfile.TemporaryDirectory(prefix="recsys-tables-")
    config.path = directory.name
    return directory


def tiered_collections(model: nn.Module) -> list[nn.Module]:
    """``model``'s collections that hold tiered tables (sharded ones too, on every rank,
    whether or not the rank holds a shard of them)."""
    return [
        c
        for c in embedding_collections(model).values()
        if hasattr(c, "tiered_tables") and c.tiered_tables()
    ]


class TieredLog:
    """The tiered tables' counters as log fields, per log window: ``tiered/<table>/hit_rate``
    (distinct ids of the window's batches found in the cache), ``fetched_per_step`` and
    ``written_back_per_step`` (rows), ``read_mb`` / ``written_mb`` (store bytes in the window),
    ``prefetch_wait_ms_per_step`` (prefetch time not hidden behind compute), ``cache_rows``."""

    def __init__(self, model: nn.Module) -> None:
        self.collections = tiered_collections(model)
        self.last: dict[str, dict[str, float]] = self._totals()

    def _totals(self) -> dict[str, dict[str, float]]:
        return {
            table: dict(stats)
            for collection in self.collections
            for table, stats in collection.tiered_stats().items()
        }

    def fields(self, steps: int) -> dict[str, float]:
        """The fields of the window since the previous call, ``steps`` steps long."""
        now, out = self._totals(), {}
        steps = max(steps, 1)
        for table, stats in now.items():
            delta = {k: v - self.last.get(table, {}).get(k, 0) for k, v in stats.items()}
            lookups = delta["lookups"]
            out.update(
                {
                    f"tiered/{table}/hit_rate": delta["hits"] / lookups if lookups else 1.0,
                    f"tiered/{table}/fetched_per_step": delta["fetched"] / steps,
                    f"tiered/{table}/initialized_per_step": delta["initialized"] / steps,
                    f"tiered/{table}/written_back_per_step": delta["written_back"] / steps,
                    f"tiered/{table}/read_mb": delta["bytes_read"] / 2**20,
                    f"tiered/{table}/written_mb": delta["bytes_written"] / 2**20,
                    f"tiered/{table}/prefetch_wait_ms_per_step": 1e3
                    * delta["prefetch_wait_s"]
                    / steps,
                    f"tiered/{table}/cache_rows": stats["cache_rows"],
                }
            )
        self.last = now
        return out

    def summary(self, fields: dict[str, float]) -> str:
        """One short line for the progress output: the lowest hit rate and the wait."""
        rates = [v for k, v in fields.items() if k.endswith("/hit_rate")]
        waits = [v for k, v in fields.items() if k.endswith("/prefetch_wait_ms_per_step")]
        if not rates:
            return ""
        return f"cache hit rate >= {min(rates):.1%}  prefetch wait {max(waits):.1f} ms/step"
