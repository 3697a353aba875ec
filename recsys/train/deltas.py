"""Incremental deltas of dynamic tables, for serving: their format, and how a base checkpoint
(:func:`apply_deltas`) or export (``recsys predict --deltas``) plus the deltas after it rebuild
the current tables without a full re-export. The trainer writes one every
``checkpoint.delta_every_steps`` (:mod:`recsys.train.delta_writer`).

Files. A delta is the directory ``<run dir>/deltas/step_<N>/`` (N zero-padded to 8 digits)::

    delta.json                        the manifest, below
    <table>.rank<r>.rows.parquet      key int64, step int64, values fixed_size_list<float32>[dim]
    <table>.rank<r>.deleted.parquet   key int64

``<table>`` is the table's name percent-encoded, ``<r>`` the rank that wrote the part
(5 digits). Under torchrun each rank writes the keys it owns; a part with no row is not
written. ``step`` is the table's own training step at which the key was last trained (its
``last_seen``), ``values`` its row then, as float32 (a bf16 / fp16 row converts exactly).

Manifest (``delta.json``)::

    {"format": "recsys-delta", "version": 1,
     "step": N,          the training step the delta was taken after
     "since": S,         the step of the previous delta (or of the resume or start)
     "world_size": W,
     "tables": {"<table>": {"dim": D, "rows": n, "deletions": m,
                            "files": [{"name": ..., "kind": "rows" | "deleted", "rank": r,
                                       "rows": k, "bytes": b, "crc32": c}, ...]}},
     "bytes": total bytes of the files}

Meaning. Per dynamic table, the delta at step N holds every key trained in steps (S, N] with
its row at step N, and the keys that lost their row (evicted, expired) after S and have none at
N (a reader may never have had some of them: deleting those is a no-op). Apply a delta with its
deletions first, then its rows (inserts and updates). Deltas chain: applied to the tables of
step B, the first delta must start at or before B (``since <= B < step``), each next one where
the previous one ends (``since`` = its ``step``); a gap is a ValueError naming the steps. A
delta carries the dynamic tables only: dense layers and fixed tables stay those of the base.

Atomic. Every rank writes into ``deltas/.tmp-step_<N>/``; after a barrier the first rank writes
``delta.json`` last, syncs, and renames the directory to ``step_<N>``. Readers skip ``.tmp-*``
and ``.stale-*`` directories, and warn about and skip a ``step_<N>`` whose manifest is missing
or does not match its files: they never apply part of a delta (a skipped delta in the middle of
a chain is then a gap).

Resume. The trainer writes a delta every ``checkpoint.delta_every_steps`` steps, and one at
every checkpoint (before it) and at the last step, so the chain continues through a resume
from any checkpoint. A resumed run first removes the deltas after its checkpoint's step (written
by the run it continues after that checkpoint: stale), renaming each to ``.stale-*`` before
deleting it; its first delta starts at the checkpoint's step. A run started fresh removes every
delta of its directory the same way. Nothing else deletes deltas: remove the ones older than
your oldest base yourself.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from recsys._files import file_checksum
from recsys.embedding.dynamic import DynamicEmbeddingBagCollection
from recsys.embedding.interface import (
    TABLES,
    WEIGHT,
    TableDelta,
    embedding_collections,
    state_prefix,
)
from recsys.embedding.slot_map import SlotMap
from recsys.ops.slot_map import EMPTY_KEY
from recsys.train.checkpoint import load_checkpoint, load_model, resolve_checkpoint

__all__ = [
    "DELTAS_DIR",
    "DeltaInfo",
    "Tables",
    "apply_delta",
    "apply_deltas",
    "apply_exported_deltas",
    "checkpoint_step",
    "delta_chain",
    "delta_dir_step",
    "dynamic_table_rows",
    "exported_dynamic_tables",
    "list_deltas",
    "read_delta",
    "replay_deltas",
]

DELTAS_DIR = "deltas"
"""Where the trainer writes deltas: this folder of the run directory."""
DYNAMIC_FILE = "dynamic.json"
"""The extra file of an export locating its dynamic tables (:func:`exported_dynamic_tables`)."""
MANIFEST = "delta.json"
"""A delta's manifest, written last."""
FORMAT = "recsys-delta"
VERSION = 1
"""The format version this recsys writes and reads."""
_STEP_DIR = re.compile(r"^step_(\d+)$")

Tables = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Table name -> (keys [n] int64 ascending, rows [n, dim] float32), on the CPU."""


def delta_dir_step(name: str) -> int | None:
    """The step of a committed delta's directory name (``step_<N>``), else None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class DeltaInfo:
    """A committed delta: its directory and manifest (see the module docstring)."""

    path: Path
    step: int
    since: int
    world_size: int
    tables: dict[str, dict[str, Any]]


def list_deltas(directory: str | Path) -> list[DeltaInfo]:
    """The committed deltas of ``directory``, by step. ``.tmp-*`` / ``.stale-*`` directories
    are skipped; a ``step_<N>`` without a manifest that matches its files is skipped with a
    warning.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        ValueError: a manifest of a newer format version than this recsys reads.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"deltas directory not found: '{directory}'")
    found = []
    for path in directory.iterdir():
        step = delta_dir_step(path.name)
        if step is None or not path.is_dir():
            continue
        info, problem = _read_manifest(path, step)
        if info is None:
            warnings.warn(f"delta '{path}' ignored: {problem}", stacklevel=2)
            continue
        found.append(info)
    return sorted(found, key=lambda d: d.step)


def _read_manifest(path: Path, step: int) -> tuple[DeltaInfo | None, str]:
    """(the delta at ``path``, "") or (None, why it is not a valid delta)."""
    file = path / MANIFEST
    if not file.is_file():
        return None, f"no {MANIFEST} (written last: the delta is incomplete)"
    try:
        manifest = json.loads(file.read_text())
        version = manifest["version"] if manifest.get("format") == FORMAT else None
        info = DeltaInfo(
            path, manifest["step"], manifest["since"], manifest["world_size"], manifest["tables"]
        )
        files = [f for t in info.tables.values() for f in t["files"]]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"unreadable {MANIFEST} ({type(error).__name__}: {error})"
    if not isinstance(version, int):
        return None, f"{MANIFEST} is not a recsys delta manifest"
    if version > VERSION:
        raise ValueError(
            f"delta '{path}' has format version {version}; this recsys reads version "
            f"{VERSION}: update recsys"
        )
    if info.step != step:
        return None, f"{MANIFEST} says step {info.step}, the directory {step}"
    for entry in files:
        where = path / entry["name"]
        if not where.is_file() or where.stat().st_size != entry["bytes"]:
            return None, f"'{entry['name']}' is missing or not of the size {MANIFEST} records"
    return info, ""


def delta_chain(deltas: list[DeltaInfo], base_step: int) -> list[DeltaInfo]:
    """The deltas to apply, in order, to tables of step ``base_step``: those after it, the
    first starting at or before it, each next one where the previous one ends.

    Raises:
        ValueError: a gap (a delta starts after the step the tables are at), or a delta that
            starts before the previous one ends (deltas of two runs mixed); the steps named.
    """
    chain, at = [], base_step
    for delta in (d for d in deltas if d.step > base_step):
        before = f"delta step {at}" if chain else f"base step {base_step}"
        if delta.since > at:
            raise ValueError(
                f"deltas have a gap: after {before}, the next delta '{delta.path.name}' holds "
                f"the changes of steps {delta.since + 1}..{delta.step}, so those of steps "
                f"{at + 1}..{delta.since} are missing (a delta skipped as invalid, or "
                f"deleted?); start from a checkpoint of step >= {delta.since} instead"
            )
        if chain and delta.since != at:
            raise ValueError(
                f"deltas do not chain: after {before}, the next delta '{delta.path.name}' "
                f"holds the changes since step {delta.since}, not since {at} (deltas of "
                "another run in the directory?)"
            )
        chain.append(delta)
        at = delta.step
    return chain


def read_delta(delta: DeltaInfo) -> dict[str, TableDelta]:
    """A delta's tables, every rank's part together: keys ascending, rows float32 [n, dim].

    Raises:
        ValueError: a file does not match its checksum, has unexpected columns, or a key is in
            two parts (of two ranks) or both among the rows and the deletions.
    """
    out = {}
    for name, entry in delta.tables.items():
        dim = entry["dim"]
        keys, steps, rows, deleted = [], [], [], []
        for file in entry["files"]:
            table = _read_file(delta.path, file)
            if file["kind"] == "deleted":
                deleted.append(_column(table, "key", delta, file))
                continue
            expected = [pa.int64(), pa.int64(), pa.list_(pa.float32(), dim)]
            if table.column_names != ["key", "step", "values"] or table.schema.types != expected:
                raise ValueError(
                    f"delta '{delta.path}': '{file['name']}' has columns {table.schema}; "
                    f"expected key, step and values fixed_size_list<float32>[{dim}]"
                )
            keys.append(table.column("key").to_numpy())
            steps.append(table.column("step").to_numpy())
            values = table.column("values").combine_chunks()
            rows.append(values.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
        out[name] = _table_delta(delta, name, dim, keys, steps, rows, deleted)
    return out


def _read_file(directory: Path, file: dict[str, Any]) -> pa.Table:
    path = directory / file["name"]
    size, crc = file_checksum(path)
    if (size, crc) != (file["bytes"], file["crc32"]):
        raise ValueError(
            f"delta '{directory}': '{file['name']}' does not match the size and checksum "
            f"{MANIFEST} records (corrupt)"
        )
    return pq.read_table(path)


def _column(table: pa.Table, name: str, delta: DeltaInfo, file: dict[str, Any]) -> np.ndarray:
    if name not in table.column_names or table.schema.field(name).type != pa.int64():
        raise ValueError(
            f"delta '{delta.path}': '{file['name']}' has no int64 column '{name}' "
            f"(columns: {table.schema})"
        )
    return table.column(name).to_numpy()


def _table_delta(
    delta: DeltaInfo,
    name: str,
    dim: int,
    keys: list[np.ndarray],
    steps: list[np.ndarray],
    rows: list[np.ndarray],
    deleted: list[np.ndarray],
) -> TableDelta:
    """One table's parts joined and sorted by key, after checking no key is in two places."""
    key = torch.from_numpy(np.concatenate(keys) if keys else np.zeros(0, np.int64))
    gone = torch.from_numpy(np.concatenate(deleted) if deleted else np.zeros(0, np.int64))
    both = torch.cat([key, gone])
    if len(torch.unique(both)) != len(both):
        raise ValueError(
            f"delta '{delta.path}', table '{name}': a key appears twice among the parts' rows "
            "and deletions (every key belongs to one rank's part, as a row or a deletion)"
        )
    order = torch.argsort(key)
    weights = torch.from_numpy(np.concatenate(rows) if rows else np.zeros((0, dim), np.float32))
    last_seen = torch.from_numpy(np.concatenate(steps) if steps else np.zeros(0, np.int64))
    return TableDelta(key[order], weights[order], last_seen[order], torch.sort(gone).values)


# ---------------------------------------------------------------------------------- applying


def apply_delta(tables: Tables, delta: dict[str, TableDelta]) -> Tables:
    """``tables`` after one delta: per table, its deletions dropped, then its rows inserted
    or replaced. Tables the delta does not name are unchanged.

    Args:
        tables: table name -> (keys [n] int64, rows [n, dim]); any key order.
        delta: what :func:`read_delta` (or a collection's ``take_delta``) returned.

    Returns:
        New tables: keys ascending, rows float32.

    Raises:
        ValueError: the delta names a table ``tables`` lacks, or rows of another dim.
    """
    out = dict(tables)
    for name, change in delta.items():
        if name not in tables:
            raise ValueError(
                f"the delta changes table '{name}', which the base does not have; its dynamic "
                f"tables are {sorted(tables)}"
            )
        keys, rows = tables[name]
        if rows.shape[1] != change.weights.shape[1]:
            raise ValueError(
                f"table '{name}': the delta's rows have dim {change.weights.shape[1]}, the "
                f"base's {rows.shape[1]}"
            )
        new_keys, new_rows = change.keys.cpu(), change.weights.detach().cpu().float()
        stays = ~(torch.isin(keys, change.deleted.cpu()) | torch.isin(keys, new_keys))
        keys = torch.cat([keys[stays], new_keys])
        rows = torch.cat([rows[stays].float(), new_rows])
        order = torch.argsort(keys)
        out[name] = (keys[order], rows[order])
    return out


def replay_deltas(tables: Tables, base_step: int, directory: str | Path) -> tuple[Tables, int]:
    """``tables`` of step ``base_step`` brought forward by the chain of deltas in
    ``directory`` after it (:func:`delta_chain`).

    Returns:
        (the tables, keys ascending; the step they are at: the last delta's, or
        ``base_step`` when no delta follows it).

    Raises:
        ValueError: a gap in the chain, or a delta that does not fit the tables.
    """
    step = base_step
    for delta in delta_chain(list_deltas(directory), base_step):
        tables = apply_delta(tables, read_delta(delta))
        step = delta.step
    return tables, step


def dynamic_table_rows(model: nn.Module) -> Tables:
    """Every dynamic table of ``model`` (unsharded) as (keys ascending, rows float32), on the
    CPU."""
    tables = {}
    for collection in embedding_collections(model).values():
        if not isinstance(collection, DynamicEmbeddingBagCollection):
            continue
        for name, table in collection.dynamic.items():
            keys, slots = table.map.entries()
            rows = collection.embedding_bags[name].weight.detach()[slots]
            tables[name] = (keys.cpu(), rows.float().cpu())
    return tables


def checkpoint_step(checkpoint: str | Path) -> int:
    """The training step a checkpoint was saved at."""
    return int(load_checkpoint(checkpoint, {"step": 0}, verify=False)["step"])


def apply_deltas(checkpoint: str | Path, directory: str | Path) -> Tables:
    """The dynamic tables of a base checkpoint brought forward by the deltas after it.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its newest checkpoint), of the
            run that wrote the deltas (any world size).
        directory: the deltas directory (``<run dir>/deltas``).

    Returns:
        Table name -> (keys [n] int64 ascending, rows [n, dim] float32): the tables at the
        last delta's step.

    Raises:
        ValueError: a gap in the chain of deltas after the checkpoint's step.

    Example::

        tables = apply_deltas("runs/dlrm/checkpoints/step_00001000", "runs/dlrm/deltas")
        keys, rows = tables["t_cat_0"]
    """
    checkpoint = resolve_checkpoint(checkpoint)
    model = load_model(checkpoint)
    tables, _ = replay_deltas(dynamic_table_rows(model), checkpoint_step(checkpoint), directory)
    return tables


# ---------------------------------------------------------------------------------- exports


def exported_dynamic_tables(
    program: torch.export.ExportedProgram, module: nn.Module, step: int
) -> dict[str, object]:
    """What an export's ``dynamic.json`` records for :func:`apply_exported_deltas`: the step
    of its checkpoint, and per dynamic table the program's names of its map keys (``keys``:
    the constants that are the map's keys tensor) and rows (``rows``), and the map's
    ``num_buckets`` and ``bucket_size`` (fixed in the program's graph).

    Args:
        program: ``torch.export.export(module, ...)``.
        module: the module exported (its collections are found by
            :func:`~recsys.embedding.interface.embedding_collections`).
        step: the step of the checkpoint the module was loaded from.
    """
    tables = {}
    for path, collection in embedding_collections(module).items():
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
    return {"step": step, "tables": tables}


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
        deltas: the deltas directory of the run the export's checkpoint is from.
        path: the export's file, for messages.

    Returns:
        The step the tables are at (the last delta's; the checkpoint's when none follows).

    Raises:
        ValueError: the export predates deltas (no ``dynamic.json``); a gap in the deltas;
            a table whose keys no longer fit the program's map (named, with the slots it
            would need: export a later checkpoint).
    """
    if info is None:
        raise ValueError(
            f"export '{path}' has no {DYNAMIC_FILE}: it was exported by a recsys without "
            "deltas; export its checkpoint again to apply deltas to it"
        )
    tables = {name: _exported_rows(module, entry) for name, entry in info["tables"].items()}
    tables, step = replay_deltas(tables, info["step"], deltas)
    for name, (keys, rows) in tables.items():
        _put_rows(module, name, info["tables"][name], keys, rows)
    return step


def _exported_rows(module: nn.Module, entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A dynamic table of a loaded export as (keys ascending, rows float32)."""
    map_keys = _tensor_at(module, entry["keys"][0])
    slots = (map_keys != EMPTY_KEY).nonzero().squeeze(1)
    keys, order = torch.sort(map_keys[slots])
    return keys, _tensor_at(module, entry["rows"]).detach()[slots[order]].float()


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
    weight = _tensor_at(module, entry["rows"])
    placed = torch.zeros_like(weight)  # the zero row (index capacity) stays zero
    placed[slots] = rows.to(weight.dtype)
    with torch.no_grad():
        for constant in entry["keys"]:
            _tensor_at(module, constant).copy_(layout.keys)
        weight.copy_(placed)


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter, buffer or constant of ``module`` at dotted ``name``."""
    owner, _, attribute = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attribute)
