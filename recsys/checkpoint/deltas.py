"""Incremental deltas of dynamic tables, for serving: their format, and how a base checkpoint
(:func:`apply_deltas`) or export (``recsys predict --deltas``:
:mod:`recsys.serve.exported_deltas`) plus the deltas after it rebuild the current tables without
a full re-export. The trainer writes one every ``checkpoint.delta_every_steps``
(:mod:`recsys.checkpoint.delta_writer`).

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
     "lineage": {"run_id": ..., "sessions": [{"id": ..., "from_step": ...}, ...],
                 "parent": ...},   the run and sessions that wrote it (recsys.checkpoint.lineage;
                                   absent in deltas written before lineages)
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

Lineage. A base (checkpoint or export) and every delta record the lineage of the run that
wrote them (:mod:`recsys.checkpoint.lineage`). Each delta must continue what it is applied to, the
base or the delta before it: the same run, and the same history up to that step (its branch of
the run split from the base's at that step or later). Anything else (another run's deltas, or
those of a branch resumed from a checkpoint older than the base) is a ValueError naming the
base and the delta with their paths, run ids and steps. A base or delta without a lineage
(written by a recsys before lineages) is checked by its steps only, with a warning; a delta
without one that follows a base or delta with one is refused (a run that records lineages
records it in every delta).

Where. Everything that applies deltas takes the deltas directory (``<run dir>/deltas``) or the
run directory holding it (:func:`deltas_directory`); a directory that is neither is an error.

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
from recsys.checkpoint.io import checkpoint_step, load_model, resolve_checkpoint
from recsys.checkpoint.lineage import Lineage, divergence, read_lineage
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.interface import TableDelta, embedding_collections

__all__ = [
    "DELTAS_DIR",
    "DeltaBase",
    "DeltaInfo",
    "Tables",
    "apply_delta",
    "apply_deltas",
    "checkpoint_base",
    "checkpoint_step",
    "delta_chain",
    "delta_dir_step",
    "deltas_directory",
    "dynamic_table_rows",
    "list_deltas",
    "read_delta",
    "replay_deltas",
]

DELTAS_DIR = "deltas"
"""Where the trainer writes deltas: this folder of the run directory."""
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
    lineage: Lineage | None = None
    """The run and sessions that wrote it; None for a delta written before lineages."""


@dataclass(frozen=True)
class DeltaBase:
    """What deltas are applied to: the tables of a checkpoint or an export, of one step of one
    run (:func:`checkpoint_base`; an export's ``dynamic.json``)."""

    path: str
    """The checkpoint or export, for messages."""
    step: int
    lineage: Lineage | None
    """The run and sessions that trained it; None for a base saved before lineages."""

    def describe(self) -> str:
        """How messages name it: its path, run id and step."""
        return f"base '{self.path}' ({_run(self.lineage)}, step {self.step})"


def checkpoint_base(checkpoint: str | Path) -> DeltaBase:
    """A checkpoint directory (or a run directory: its newest checkpoint) as a base."""
    checkpoint = resolve_checkpoint(checkpoint)
    return DeltaBase(str(checkpoint), checkpoint_step(checkpoint), read_lineage(checkpoint))


def deltas_directory(path: str | Path) -> Path:
    """The deltas directory ``path`` names: itself when it holds deltas (``step_<N>/`` with a
    manifest) or is named ``deltas`` (its run wrote none yet), else its ``deltas/`` folder (a
    run directory).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a deltas directory nor a run directory holding one.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"deltas directory not found: '{path}'")
    if any(delta_dir_step(p.parent.name) is not None for p in path.glob(f"step_*/{MANIFEST}")):
        return path
    if (path / DELTAS_DIR).is_dir():
        return path / DELTAS_DIR
    if path.name == DELTAS_DIR:
        return path
    raise ValueError(
        f"'{path}' is not a deltas directory: it holds no delta (step_<N>/ folders with a "
        f"{MANIFEST}) and no {DELTAS_DIR}/ folder; give the deltas directory (<run dir>/"
        f"{DELTAS_DIR}) or the run directory of a run trained with "
        "checkpoint.delta_every_steps > 0"
    )


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
            path,
            manifest["step"],
            manifest["since"],
            manifest["world_size"],
            manifest["tables"],
            Lineage.from_json(manifest.get("lineage")),
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


def delta_chain(deltas: list[DeltaInfo], base: DeltaBase) -> list[DeltaInfo]:
    """The deltas to apply, in order, to ``base``: those after its step, the first starting at
    or before it, each next one where the previous one ends, each continuing the base's
    lineage (see the module docstring).

    Raises:
        ValueError: a delta of another run or branch than the base (both named with their run
            ids and steps); a gap (a delta starts after the step the tables are at), or a delta
            that starts before the previous one ends (deltas of two runs mixed); the steps
            named.
    """
    chain: list[DeltaInfo] = []
    at, unchecked = base.step, []
    for delta in (d for d in deltas if d.step > base.step):
        if not _continues(base, chain[-1] if chain else None, delta):
            unchecked.append(delta)
        before = f"delta step {at}" if chain else f"base step {base.step}"
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
    if unchecked:
        warnings.warn(_unchecked(base, unchecked), stacklevel=3)
    return chain


def _continues(base: DeltaBase, previous: DeltaInfo | None, delta: DeltaInfo) -> bool:
    """Whether ``delta`` continues ``previous`` (or ``base`` when it is the first): True, or
    False when a lineage is missing and it cannot be told.

    Raises:
        ValueError: it does not continue it (the message names the base and the delta)."""
    before = base.lineage if previous is None else previous.lineage
    if before is None:
        return False
    what = base.describe()
    if previous is not None:
        what = f"delta '{previous.path}' ({_run(before)}, step {previous.step}) after {what}"
    at = base.step if previous is None else previous.step
    refused = f"delta '{delta.path}' ({_run(delta.lineage)}, step {delta.step}) does not continue "
    if delta.lineage is None:
        raise ValueError(
            f"{refused}{what}: the delta has no run lineage (written by a recsys before "
            "lineages), and a run that records lineages records one in every delta: it is of "
            "another run"
        )
    reason = divergence(before, delta.lineage, at)
    if reason is not None:
        raise ValueError(f"{refused}{what}: {reason}")
    return True


def _unchecked(base: DeltaBase, deltas: list[DeltaInfo]) -> str:
    """The warning for deltas applied without a lineage to check them against."""
    names = ", ".join(f"'{d.path.name}'" for d in deltas)
    return (
        f"applying delta(s) {names} to {base.describe()}: checked by their steps only, without "
        "a run lineage to tell whether they continue it (the base or a delta was written by a "
        "recsys before lineages)"
    )


def _run(lineage: Lineage | None) -> str:
    return "no lineage" if lineage is None else f"run {lineage.run_id}"


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


def replay_deltas(tables: Tables, base: DeltaBase, directory: str | Path) -> tuple[Tables, int]:
    """``tables`` of ``base`` brought forward by the chain of deltas after it
    (:func:`delta_chain`) in ``directory`` (:func:`deltas_directory`: the deltas directory or
    its run directory).

    Returns:
        (the tables, keys ascending; the step they are at: the last delta's, or the base's
        when no delta follows it).

    Raises:
        ValueError: a delta of another run or branch, a gap in the chain, a delta that does not
            fit the tables, or a directory that holds no deltas.
    """
    step = base.step
    for delta in delta_chain(list_deltas(deltas_directory(directory)), base):
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


def apply_deltas(checkpoint: str | Path, directory: str | Path) -> Tables:
    """The dynamic tables of a base checkpoint brought forward by the deltas after it.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its newest checkpoint), of the
            run that wrote the deltas (any world size).
        directory: the deltas directory (``<run dir>/deltas``) or the run directory.

    Returns:
        Table name -> (keys [n] int64 ascending, rows [n, dim] float32): the tables at the
        last delta's step.

    Raises:
        ValueError: a delta that does not continue the checkpoint (of another run, or of a
            branch resumed before its step), a gap in the chain of deltas after the
            checkpoint's step, a directory that holds no deltas.

    Example::

        tables = apply_deltas("runs/dlrm/checkpoints/step_00001000", "runs/dlrm/deltas")
        keys, rows = tables["t_cat_0"]
    """
    base = checkpoint_base(checkpoint)
    model = load_model(base.path)
    tables, _ = replay_deltas(dynamic_table_rows(model), base, directory)
    return tables
