"""Deltas on an export: ``recsys predict --deltas`` and ``load_exported(path, deltas=...)``
(:mod:`recsys.serve.export`) bring the dynamic tables of a loaded ``.pt2`` program forward by the
deltas written after its checkpoint (:mod:`recsys.checkpoint.deltas`).

An export's extra file ``dynamic.json`` (:func:`exported_dynamic_tables`) records the step and
lineage of its checkpoint (the base the deltas must continue) and, per dynamic table, the
program's names of its map keys and rows; :func:`apply_exported_deltas` rebuilds each table's
keys and rows in place, in the program's map layout (fixed buckets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from recsys.checkpoint.deltas import DeltaBase, Tables, replay_deltas
from recsys.checkpoint.lineage import Lineage
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.interface import TABLES, WEIGHT, embedding_collections, state_prefix
from recsys.ops.slot_map.hash_map import EMPTY_KEY
from recsys.serve.packed_export import PACKED, PackedLookup

__all__ = [
    "DYNAMIC_FILE",
    "apply_exported_deltas",
    "export_base",
    "exported_dynamic_tables",
    "exported_tables",
    "put_exported_tables",
]

DYNAMIC_FILE = "dynamic.json"
"""The extra file of an export locating its dynamic tables (:func:`exported_dynamic_tables`)."""


def exported_dynamic_tables(
    program: torch.export.ExportedProgram,
    module: nn.Module,
    step: int,
    lineage: Lineage | None,
) -> dict[str, object]:
    """What an export's ``dynamic.json`` records for :func:`apply_exported_deltas`: the step
    and lineage of its checkpoint, and per dynamic table the program's names of its map keys
    (``keys``: the constants that are the map's keys tensor) and rows (``rows``), and the map's
    ``num_buckets`` and ``bucket_size`` (fixed in the program's graph).

    Args:
        program: ``torch.export.export(module, ...)``.
        module: the module exported (its collections are found by
            :func:`~recsys.embedding.interface.embedding_collections`).
        step: the step of the checkpoint the module was loaded from.
        lineage: that checkpoint's lineage (None: saved before lineages).
    """
    tables = {}
    packed = {p: m for p, m in module.named_modules() if isinstance(m, PackedLookup)}
    collections = embedding_collections(module) | {p: m.collection for p, m in packed.items()}
    for path, collection in collections.items():
        if not isinstance(collection, DynamicEmbeddingBagCollection):
            continue
        for name, table in collection.dynamic.items():
            constants = [n for n, c in program.constants.items() if c is table.map.keys]
            if not constants:
                continue  # the program never looks the table up
            tables[name] = {
                "keys": constants,
                "rows": f"{state_prefix(path)}{TABLES}.{name}.{WEIGHT}",
                "num_buckets": table.map.num_buckets,
                "bucket_size": table.map.bucket_size,
            }
            if path in packed:  # the table's rows of the packed matrix
                first, count = packed[path].table_rows[name]
                rows = f"{state_prefix(path)}{PACKED}"
                tables[name] |= {"rows": rows, "first_row": first, "num_rows": count}
    return {
        "step": step,
        "lineage": None if lineage is None else lineage.to_json(),
        "tables": tables,
    }


def export_base(info: dict[str, Any], path: str | Path) -> DeltaBase:
    """The export at ``path`` whose ``dynamic.json`` is ``info``, as the base of deltas."""
    try:
        lineage = Lineage.from_json(info.get("lineage"))
    except ValueError as error:
        raise ValueError(f"export '{path}': its {DYNAMIC_FILE} has {error}") from None
    return DeltaBase(str(path), info["step"], lineage)


def apply_exported_deltas(
    module: nn.Module, info: dict[str, Any] | None, deltas: str | Path, path: str | Path = ""
) -> int:
    """Bring the dynamic tables of a loaded export forward by the deltas after its checkpoint,
    in place: each table's keys and rows are rebuilt in the program's map layout (fixed
    buckets), so its lookups then return the rows of the last delta's step.

    Args:
        module: the export's module (``torch.export.load(path).module()``; changed in place).
        info: the export's ``dynamic.json`` (:func:`exported_dynamic_tables`); None for an
            export without one.
        deltas: the deltas directory of the run the export's checkpoint is from, or that run's
            directory.
        path: the export's file, for messages.

    Returns:
        The step the tables are at (the last delta's; the checkpoint's when none follows).

    Raises:
        ValueError: the export predates deltas (no ``dynamic.json``); a delta that does not
            continue the export's checkpoint (of another run, or of a branch resumed before
            its step; both named); a gap in the deltas; a directory that holds no deltas; a
            table whose keys no longer fit the program's map (named, with the slots it would
            need: export a later checkpoint).
    """
    if info is None:
        raise ValueError(
            f"export '{path}' has no {DYNAMIC_FILE}: it was exported by a recsys without "
            "deltas; export its checkpoint again to apply deltas to it"
        )
    tables, step = replay_deltas(exported_tables(module, info), export_base(info, path), deltas)
    put_exported_tables(module, info, tables)
    return step


def exported_tables(module: nn.Module, info: dict[str, Any]) -> Tables:
    """The dynamic tables of a loaded export (``info``: its ``dynamic.json``) as table name ->
    (keys ascending, rows float32), the form deltas apply to
    (:func:`~recsys.checkpoint.deltas.apply_delta`)."""
    return {name: _exported_rows(module, entry) for name, entry in info["tables"].items()}


def put_exported_tables(module: nn.Module, info: dict[str, Any], tables: Tables) -> None:
    """Replace the dynamic tables of a loaded export by ``tables`` (name -> (keys, rows)), in
    place, in the program's map layout.

    Raises:
        ValueError: a table whose keys no longer fit the program's map (named, with the slots
            it would need: export a later checkpoint).
    """
    for name, (keys, rows) in tables.items():
        _put_rows(module, name, info["tables"][name], keys, rows)


def _exported_rows(module: nn.Module, entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A dynamic table of a loaded export as (keys ascending, rows float32)."""
    map_keys = _tensor_at(module, entry["keys"][0])
    slots = (map_keys != EMPTY_KEY).nonzero().squeeze(1)
    keys, order = torch.sort(map_keys[slots])
    return keys, _rows_at(module, entry).detach()[slots[order]].float()


def _put_rows(
    module: nn.Module, name: str, entry: dict, keys: torch.Tensor, rows: torch.Tensor
) -> None:
    """Replace a loaded export's table by ``keys`` and ``rows``, in its map's layout."""
    num_buckets, bucket_size = entry["num_buckets"], entry["bucket_size"]
    capacity = num_buckets * bucket_size
    where = (
        f"dynamic table '{name}': the deltas leave {len(keys)} keys for the exported "
        f"program's map of {capacity} slots ({num_buckets} buckets of {bucket_size})"
    )
    if len(keys) > capacity:
        raise ValueError(
            f"{where}: it needs at least {len(keys)} slots (the table grew after the export); "
            "export a later checkpoint of the run and apply the deltas after it"
        )
    layout = SlotMap(capacity, capacity, bucket_size=bucket_size, backend="torch", name=name)
    try:
        slots = layout.restore(num_buckets, keys, torch.zeros_like(keys), torch.zeros_like(keys))
    except ValueError as error:
        raise ValueError(
            f"{where}, and they do not fit its buckets ({error}); export a later checkpoint "
            "of the run and apply the deltas after it"
        ) from None
    weight = _rows_at(module, entry)
    placed = torch.zeros_like(weight)  # the zero row (index capacity) stays zero
    placed[slots] = rows.to(weight.dtype)
    with torch.no_grad():
        for constant in entry["keys"]:
            _tensor_at(module, constant).copy_(layout.keys)
        weight.copy_(placed)


def _rows_at(module: nn.Module, entry: dict) -> torch.Tensor:
    """A dynamic table's rows in a loaded export: its weight, or its rows of a packed matrix
    (``first_row``, ``num_rows``: :mod:`recsys.serve.packed_export`), a view either way."""
    rows = _tensor_at(module, entry["rows"])
    if "first_row" in entry:
        rows = rows[entry["first_row"] : entry["first_row"] + entry["num_rows"]]
    return rows


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter, buffer or constant of ``module`` at dotted ``name``."""
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)
