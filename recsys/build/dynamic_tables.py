"""``[model.dynamic]`` -> the options of each dynamic table, and their counters as log fields.

Which tables are dynamic: every table when the data's ids are raw 64-bit keys (the dataset spec
says ``id_encoding = "raw"``: no vocabulary, so no fixed table could hold them), else those whose
feature ``model.dynamic.tables`` names (``["all"]``: every one). Every dynamic table takes the
section's options, changed per table by ``overrides`` (``"cat_3.max_capacity=100000"``).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import fields

from torch import nn
from torchrec import EmbeddingBagConfig

from recsys._suggest import quoted_with_hints
from recsys.config import DynamicConfig
from recsys.data.batch import DatasetSpec
from recsys.distributed.ranks import all_gather
from recsys.embedding.dynamic.table import DynamicTable, DynamicTableOptions
from recsys.embedding.interface import embedding_collections

__all__ = [
    "capacity_note",
    "dropped_note",
    "dynamic_features",
    "dynamic_options",
    "dynamic_stat_fields",
]

ALL = "all"
# [model.dynamic] keys a table override may set: the per-table options.
_OPTION_KEYS = [f.name for f in fields(DynamicTableOptions) if f.name != "init_bound"]


def dynamic_features(config: DynamicConfig, spec: DatasetSpec) -> list[str]:
    """The categorical features whose tables are dynamic, in the data's order.

    Raises:
        ValueError: ``model.dynamic.tables`` names a feature the data does not have.
    """
    if spec.id_encoding == "raw" or ALL in config.tables:
        return list(spec.sparse_names)
    unknown = [f for f in config.tables if f not in spec.sparse_names]
    if unknown:
        raise ValueError(
            f"model.dynamic.tables names {quoted_with_hints(unknown, spec.sparse_names)}, which "
            f"the data does not have; its categorical features are {list(spec.sparse_names)} "
            f"(or '{ALL}')"
        )
    return [f for f in spec.sparse_names if f in config.tables]


def dynamic_options(
    config: DynamicConfig, spec: DatasetSpec, tables: list[EmbeddingBagConfig]
) -> dict[str, DynamicTableOptions]:
    """Options per dynamic table, by table name (a table and its first-order twin, which read
    the same feature, take the same options). A table's initial rows are uniform within
    ``sqrt(1 / cardinality)`` when the data knows its feature's cardinality (as a fixed table
    of that size would be), else within ``sqrt(1 / initial_capacity)``.

    Raises:
        ValueError: a bad ``tables`` or ``overrides`` entry (named).
    """
    features = dynamic_features(config, spec)
    overrides = parse_overrides(
        config.overrides,
        features,
        "model.dynamic",
        DynamicConfig(),
        _OPTION_KEYS,
        {"score": ("lru", "lfu")},
        "a dynamic table",
    )
    cardinality = dict(zip(spec.sparse_names, spec.cardinalities, strict=True))
    options = {}
    for table in tables:
        feature = table.feature_names[0]
        if feature not in features:
            continue
        values = {key: getattr(config, key) for key in _OPTION_KEYS}
        values.update(overrides.get(feature, {}))
        bound = math.sqrt(1.0 / cardinality[feature]) if cardinality[feature] > 0 else None
        try:
            options[table.name] = DynamicTableOptions(**values, init_bound=bound)
        except ValueError as error:
            raise ValueError(f"model.dynamic for feature '{feature}': {error}") from None
    return options


def parse_overrides(
    entries: list[str],
    features: list[str],
    section: str,
    defaults: object,
    keys: list[str],
    choices: dict[str, tuple[str, ...]] | None = None,
    noun: str = "a table",
) -> dict[str, dict[str, object]]:
    """``["cat_3.max_capacity=100000", ...]`` -> ``{"cat_3": {"max_capacity": 100000}}``: the
    per-table overrides of config ``section`` (e.g. ``"model.dynamic"``), each value of the
    type of its field in ``defaults`` (a string field: one of ``choices[key]`` when given).

    Raises:
        ValueError: a malformed entry, a feature not in ``features``, a key not in ``keys``
            or a value of the wrong type (each named)."""
    parsed: dict[str, dict[str, object]] = {}
    for entry in entries:
        target, _, text = entry.partition("=")
        feature, _, key = target.strip().rpartition(".")
        where = f"{section}.overrides entry {entry!r}"
        if not text or not feature:
            raise ValueError(
                f"{where}; expected '<feature>.<key>=<value>', e.g. 'cat_3.{keys[0]}=...'"
            )
        if feature not in features:
            raise ValueError(
                f"{where}: {quoted_with_hints([feature], features)} is not {noun}'s feature; "
                f"those are {features}"
            )
        if key not in keys:
            raise ValueError(
                f"{where}: unknown key {quoted_with_hints([key], keys)}; expected one of {keys}"
            )
        allowed = (choices or {}).get(key)
        parsed.setdefault(feature, {})[key] = _value(where, key, text.strip(), defaults, allowed)
    return parsed


def _value(where: str, key: str, text: str, defaults: object, allowed) -> object:
    """The override's value, of the type the key's default has."""
    default = getattr(defaults, key)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if isinstance(default, float) and isinstance(value, int):
        value = float(value)
    if type(value) is not type(default) or (allowed and value not in allowed):
        expected = " or ".join(map(repr, allowed)) if allowed else type(default).__name__
        raise ValueError(f"{where}: {key} = {text!r}; expected {expected}")
    return value


def dynamic_stat_fields(model: nn.Module) -> dict[str, float]:
    """Every dynamic table's counters as flat log fields, ``dynamic/<table>/<counter>`` (size,
    capacity, load_factor, hits, inserts, evictions, expirations, rejected, ...)."""
    return {
        f"dynamic/{table}/{name}": value
        for collection in embedding_collections(model).values()
        for table, stats in collection.dynamic_stats().items()
        for name, value in stats.items()
    }


def key_balance(model: nn.Module) -> str:
    """A text table of how the keys of every sharded dynamic table spread over the ranks:
    keys per rank and the fullest rank over the mean ("" when no table is sharded by key).
    A collective under torchrun (every rank calls it; the counts come from every rank)."""
    lines = []
    for collection in embedding_collections(model).values():
        for table, stats in collection.dynamic_stats().items():
            ranks = sorted(
                (int(name.removeprefix("size_rank")), value)
                for name, value in stats.items()
                if name.startswith("size_rank")
            )
            if ranks:
                per_rank = " ".join(f"{int(value):,}" for _, value in ranks)
                lines.append(f"  {table}: {per_rank}  (max/mean {stats['size_max_over_mean']:.3f})")
    if not lines:
        return ""
    return "\n".join(["keys per rank of the dynamic tables (rank 0, 1, ...):", *lines])


def capacity_note(model: nn.Module) -> str:
    """One line when dynamic tables' caps are held as more rows than ``max_capacity`` says
    (a cap is whole buckets; a memory budget becomes a cap the same way), "" otherwise. The
    same on any number of ranks: a sharded table deals its buckets out to its parts."""
    rounded: dict[tuple[int, int], list[str]] = {}
    for module in model.modules():
        if isinstance(module, DynamicTable) and module.options.max_capacity:
            given, held = module.options.max_capacity, module.map.max_capacity
            if held != given:
                rounded.setdefault((given, held), []).append(module.name)
    parts = [
        f"max_capacity {given:,} is {held:,} rows ({len(names)} table(s): "
        f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        for (given, held), names in rounded.items()
    ]
    if not parts:
        return ""
    return "model.dynamic: caps are whole buckets of keys: " + "; ".join(parts)


def dropped_note(model: nn.Module) -> str:
    """After a resume on another sharding: one line naming the dynamic tables whose keys in the
    checkpoint were more than their cap holds here (each bucket kept its highest-scored keys;
    the next delta deletes the others), "" when none. A collective under torchrun."""
    mine: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, DynamicTable) and len(module.dropped_at_load):
            mine[module.name] = mine.get(module.name, 0) + len(module.dropped_at_load)
    dropped: dict[str, int] = {}
    for part in all_gather(mine):
        for name, count in part.items():
            dropped[name] = dropped.get(name, 0) + count
    if not dropped:
        return ""
    tables = ", ".join(f"{name} {count:,}" for name, count in dropped.items())
    return (
        "the checkpoint holds more keys than these dynamic tables' caps (max_capacity) hold "
        f"here; each kept its highest-scored keys and dropped the rest: {tables} (deltas, when "
        "the run writes them, list them as deleted)"
    )
