"""``[model.storage]`` -> each table's storage tier, and the tiered tables' counters as log fields.

Every table with at least ``min_rows`` rows (and every dynamic table) takes the section's tier
and cache options, changed per table by ``overrides`` (``"cat_3.tier=device"``). A disk tier
without a ``path`` keeps its files under ``<run dir>/tables``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import fields
from pathlib import Path

from torch import nn
from torchrec import EmbeddingBagConfig

from recsys._files import format_bytes, mount_device
from recsys.build.dynamic_tables import parse_overrides
from recsys.config import StorageConfig
from recsys.distributed.ranks import all_gather
from recsys.embedding.interface import embedding_collections
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.mixin import TieredTables
from recsys.embedding.tiered.options import TIERS, StorageOptions
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore

__all__ = [
    "TIERED_DIR",
    "TieredLog",
    "cache_note",
    "close_stores",
    "disk_note",
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
    if not config.path and any(_tier(config, overrides, f) == "disk" for f in features):
        Path(path).mkdir(parents=True, exist_ok=True)  # the run's own: no mount to check
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


def _tier(config: StorageConfig, overrides: dict[str, dict], feature: str) -> str:
    return overrides.get(feature, {}).get("tier", config.tier)


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


def close_stores(model: nn.Module) -> None:
    """Let go of every tiered table's store files in ``model`` (sharded ones' local shards too):
    a run that ends releases its disk tier's locks, so a next run in the same process may use
    the same path."""
    for module in model.modules():
        if isinstance(module, TieredTables):  # pooled or unpooled (a sequence model's)
            module.close()


def cache_note(
    model: nn.Module, batch_size: int, world_size: int, max_ids_per_sample: dict[str, int]
) -> str:
    """A line naming every tiered table whose cache is smaller than the most distinct rows
    one training batch could touch ("" when none is): at most ``batch_size`` x
    ``world_size`` samples (a shard serves every rank's) times the table's features' most ids
    per sample, and at most the rows it holds (a fixed table). Such a run trains: a batch with
    more distinct rows than the cache grows it in its forward (counted as ``cache_grown``),
    bitwise as a larger cache would; the next batch is prepared ahead when both fit, else in
    its own forward (``prefetch_deferred``); evaluation batches are pooled in pieces that fit.
    Features without a known bound (multi-hot parquet columns) are not counted. A collective
    under torchrun: every rank returns the same line."""
    samples, short = batch_size * world_size, {}
    for module in model.modules():
        if not isinstance(module, TieredEmbeddingBagCollection):
            continue
        for config in module.embedding_bag_configs():
            cache = module.caches.get(config.name)
            bags = [max_ids_per_sample.get(f) for f in config.feature_names]
            if cache is None or None in bags:
                continue
            needed, why = samples * sum(bags), f"{samples} samples x {sum(bags)} id(s)"
            if config.name not in module.dynamic_options and config.num_embeddings < needed:
                needed, why = config.num_embeddings, "every row it holds"
            if needed > cache.num_rows:
                short[config.name] = (cache.num_rows, needed, why)
    found: dict[str, tuple] = {}
    for part in all_gather(short):  # the largest need over the ranks' shards
        for table, entry in part.items():
            if table not in found or entry[1] > found[table][1]:
                found[table] = entry
    if not found:
        return ""
    tables = "; ".join(
        f"'{table}' caches {rows} rows of up to {needed} ({why})"
        for table, (rows, needed, why) in found.items()
    )
    return (
        f"model.storage: {len(found)} tiered table cache(s) smaller than a worst-case batch of "
        f"{batch_size} x {world_size} rank(s): {tables}. A batch with more distinct rows grows "
        "its cache by what it lacks (tiered/<table>/cache_grown in the log)"
    )


def disk_note(model: nn.Module) -> str:
    """A line when the disk tier's fixed tables could outgrow the free space of their disk
    ("" when they fit): rows are written as training first touches them, and a full disk stops
    the run with a NoSpaceError naming the device."""
    largest: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, TieredEmbeddingBagCollection):
            for cache in module.caches.values():
                records = cache.store.records
                if isinstance(records, DiskRecords) and isinstance(cache.store, FixedStore):
                    where = str(records.path.parent)
                    largest[where] = largest.get(where, 0) + records.num_records * records.width
    notes = []
    for where, size in largest.items():
        free = shutil.disk_usage(where).free
        if size > free:
            notes.append(
                f"model.storage: the disk tier's tables in '{where}' can grow to "
                f"{format_bytes(size)} as training touches their rows; "
                f"{mount_device(Path(where))} has {format_bytes(free)} free"
            )
    return "\n".join(notes)


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
    ``prefetch_wait_ms_per_step`` (prefetch time not hidden behind compute), ``cache_rows``,
    ``prefetch_deferred`` (batches whose rows did not fit beside the batch in flight's, so were
    prepared in their own forward, not ahead), ``cache_grown`` (rows added to the cache for
    batches with more distinct rows than it held)."""

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
                    f"tiered/{table}/prefetch_deferred": delta["prefetch_deferred"],
                    f"tiered/{table}/cache_grown": delta["grown"],
                }
            )
        self.last = now
        return out

    def summary(self, fields: dict[str, float]) -> str:
        """One short line for the progress output: the lowest hit rate and the wait."""
        rates = [v for k, v in fields.items() if k.endswith("/hit_rate")]
        waits = [v for k, v in fields.items() if k.endswith("/prefetch_wait_ms_per_step")]
        deferred = max([v for k, v in fields.items() if k.endswith("/prefetch_deferred")] or [0])
        if not rates:
            return ""
        line = f"cache hit rate >= {min(rates):.1%}  prefetch wait {max(waits):.1f} ms/step"
        if deferred:  # the cache holds one batch, not two: prefetch waits for the step
            line += f"  {deferred:.0f} prefetch(es) deferred (raise cache_rows to overlap them)"
        grown = sum(v for k, v in fields.items() if k.endswith("/cache_grown"))
        if grown:  # a batch had more distinct rows than a cache held
            line += f"  caches grown by {grown:.0f} rows"
        return line
