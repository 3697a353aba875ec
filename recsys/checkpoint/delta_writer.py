"""Writing deltas of dynamic tables (the format: :mod:`recsys.checkpoint.deltas`): the trainer's
schedule (:class:`DeltaWriter`, ``checkpoint.delta_every_steps``), the atomic collective write
(:func:`write_delta`), and the removal of stale deltas when a run resumes
(:func:`remove_deltas_after`).

Under torchrun every rank calls :func:`write_delta` with its own part of each table (the keys
it owns, from its collections' ``take_delta()``); every rank writes its part files into
``deltas/.tmp-step_<N>/``, and the first rank commits the delta once all have: manifest last,
synced, the directory renamed to ``step_<N>``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch import nn

from recsys._files import file_checksum, fsync_path, write_failure, write_text_atomic
from recsys.checkpoint.deltas import FORMAT, MANIFEST, VERSION, delta_dir_step
from recsys.checkpoint.lineage import Lineage
from recsys.distributed.ranks import all_gather, from_first_rank, rank, world_size
from recsys.embedding.interface import TableDelta, embedding_collections

__all__ = ["DeltaReport", "DeltaWriter", "remove_deltas_after", "take_deltas", "write_delta"]


@dataclass(frozen=True)
class DeltaReport:
    """What :func:`write_delta` wrote (totals over every rank)."""

    path: Path
    step: int
    since: int
    rows: int
    deletions: int
    bytes: int

    def fields(self) -> dict[str, Any]:
        """The report as the fields of a metrics.jsonl event."""
        return {
            "since": self.since,
            "rows": self.rows,
            "deletions": self.deletions,
            "bytes": self.bytes,
            "path": str(self.path),
        }


def take_deltas(model: nn.Module) -> dict[str, TableDelta]:
    """Every embedding collection's :meth:`take_delta` (this process's keys), by table.

    Raises:
        ValueError: two collections have a dynamic table of the same name.
    """
    found: dict[str, TableDelta] = {}
    for path, collection in embedding_collections(model).items():
        for name, delta in collection.take_delta().items():
            if name in found:
                raise ValueError(
                    f"dynamic table '{name}' is in two embedding collections (the second at "
                    f"'{path}'): deltas name tables, so table names must be unique"
                )
            found[name] = delta
    return found


def write_delta(
    directory: str | Path,
    step: int,
    since: int,
    tables: dict[str, TableDelta],
    lineage: Lineage,
) -> DeltaReport:
    """Write ``tables`` (this rank's part of each table) as the delta ``directory/step_<step>``.

    Collective under torch.distributed: every rank calls it with its own part (a rank may
    lack tables others have); the delta appears, complete, only once every rank has written.

    Args:
        directory: the deltas directory (``<run dir>/deltas``).
        step: the training step the delta was taken after; names it.
        since: the step of the previous delta (or where training started).
        tables: what :func:`take_deltas` returned on this rank.
        lineage: the run and sessions writing it (:mod:`recsys.checkpoint.lineage`; the first
            rank's is written): what ties it to the bases it continues.

    Returns:
        A :class:`DeltaReport` (the same on every rank).

    Raises:
        OSError: a write failed on some rank (a full disk, a read-only directory): nothing
            is committed.
    """
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp-step_{step:08d}"
    me, ranks = rank(), world_size()
    error = None
    if me == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a write that crashed
            tmp.mkdir()
        except OSError as raised:
            error = str(write_failure(raised, tmp))
    error = from_first_rank(error)  # every rank waits for the directory
    if error:
        raise OSError(f"writing delta '{final}' failed: {error}")
    parts = {}
    try:
        parts = {name: _write_parts(tmp, name, me, delta) for name, delta in tables.items()}
    except OSError as raised:
        error = f"rank {me}: {write_failure(raised, tmp)}"
    gathered = all_gather((parts, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise OSError(f"writing delta '{final}' failed: {'; '.join(errors)}")
    manifest = _manifest(step, since, ranks, lineage, [p for p, _ in gathered])
    error = None
    if me == 0:
        try:
            _commit(tmp, final, manifest)
        except OSError as raised:
            error = str(write_failure(raised, final))
    error = from_first_rank(error)
    if error:
        raise OSError(f"committing delta '{final}' failed: {error}")
    totals = manifest["tables"].values()
    return DeltaReport(
        final,
        step,
        since,
        sum(t["rows"] for t in totals),
        sum(t["deletions"] for t in totals),
        manifest["bytes"],
    )


def _write_parts(tmp: Path, name: str, rank: int, delta: TableDelta) -> dict[str, Any]:
    """This rank's files of one table: {"dim", "files": [...]} as the manifest lists them."""
    stem = f"{quote(name, safe='')}.rank{rank:05d}"
    keys = delta.keys.detach().cpu().numpy().astype(np.int64)
    dim = int(delta.weights.shape[1])
    files = []
    if len(keys):
        rows = delta.weights.detach().float().cpu().numpy().reshape(-1)
        table = pa.table(
            {
                "key": pa.array(keys, pa.int64()),
                "step": pa.array(delta.last_seen.cpu().numpy().astype(np.int64), pa.int64()),
                "values": pa.FixedSizeListArray.from_arrays(pa.array(rows, pa.float32()), dim),
            }
        )
        files.append(_write_file(tmp / f"{stem}.rows.parquet", table, "rows", rank))
    deleted = delta.deleted.detach().cpu().numpy().astype(np.int64)
    if len(deleted):
        table = pa.table({"key": pa.array(deleted, pa.int64())})
        files.append(_write_file(tmp / f"{stem}.deleted.parquet", table, "deleted", rank))
    return {"dim": dim, "files": files}


def _write_file(path: Path, table: pa.Table, kind: str, rank: int) -> dict[str, Any]:
    pq.write_table(table, path)
    fsync_path(path)
    size, crc = file_checksum(path)
    return {
        "name": path.name,
        "kind": kind,
        "rank": rank,
        "rows": table.num_rows,
        "bytes": size,
        "crc32": crc,
    }


def _manifest(
    step: int,
    since: int,
    world_size: int,
    lineage: Lineage,
    parts: list[dict[str, dict[str, Any]]],
) -> dict[str, Any]:
    """The manifest of a delta from every rank's parts (in rank order)."""
    tables: dict[str, dict[str, Any]] = {}
    for rank_parts in parts:
        for name, part in rank_parts.items():
            entry = tables.setdefault(
                name, {"dim": part["dim"], "rows": 0, "deletions": 0, "files": []}
            )
            for file in part["files"]:
                entry["rows" if file["kind"] == "rows" else "deletions"] += file["rows"]
                entry["files"].append(file)
    size = sum(f["bytes"] for t in tables.values() for f in t["files"])
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "since": since,
        "world_size": world_size,
        "lineage": lineage.to_json(),
        "tables": dict(sorted(tables.items())),
        "bytes": size,
    }


def _commit(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, sync, and rename ``tmp`` to ``final`` (replacing a delta of
    the same step, first moved aside)."""
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    fsync_path(tmp)
    replaced = final.with_name(f".stale-{final.name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


class DeltaWriter:
    """The trainer's deltas, into ``directory`` (``<run dir>/deltas``): one every
    ``every_steps`` steps, and one at every checkpoint and at the last step (written before the
    checkpoint, so that a run resumed from any checkpoint continues the chain of deltas).

    Args:
        directory: where the deltas go.
        every_steps: ``checkpoint.delta_every_steps`` (0: none).
        lineage: the training session's lineage, recorded in every delta.
    """

    def __init__(self, directory: Path, every_steps: int, lineage: Lineage) -> None:
        self.directory = directory
        self.every_steps = every_steps
        self.lineage = lineage
        self.since = 0

    def start(self, model: nn.Module, step: int) -> list[Path]:
        """Before training from ``step``: remove the deltas written after it (first rank;
        they are stale), and with deltas on, start recording the tables' changes from now.

        Returns:
            The stale deltas removed (on the first rank; empty on the others).

        Raises:
            ValueError: deltas are on and no rank has a dynamic table.
        """
        removed = remove_deltas_after(self.directory, step) if rank() == 0 else []
        self.since = step
        # The first take starts recording (what it returns changed before ``step``).
        if self.every_steps and not any(all_gather(bool(take_deltas(model)))):
            raise ValueError(
                f"checkpoint.delta_every_steps = {self.every_steps}, but the model has no "
                "dynamic table (deltas hold their changes): make tables dynamic "
                "(model.dynamic.tables, or raw-id data) or set checkpoint.delta_every_steps = 0"
            )
        return removed

    def due(self, step: int, now: bool = False) -> bool:
        """Whether a delta is written after ``step``: deltas are on, the previous one is of an
        earlier step, and ``step`` is a multiple of ``every_steps`` or ``now`` (a checkpoint,
        the last step)."""
        if not self.every_steps or step <= self.since:
            return False
        return now or step % self.every_steps == 0

    def write(self, model: nn.Module, step: int) -> DeltaReport:
        """Take every dynamic table's delta since the previous one and write it (collective)."""
        report = write_delta(self.directory, step, self.since, take_deltas(model), self.lineage)
        self.since = step
        return report


def remove_deltas_after(directory: str | Path, step: int) -> list[Path]:
    """Delete the deltas of steps after ``step`` and leftovers of interrupted writes in
    ``directory`` (each renamed to ``.stale-*`` first, so no reader sees half of one).

    Returns:
        The committed deltas removed, oldest first.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        saved = delta_dir_step(path.name)
        if saved is not None and saved > step:
            removed.append(path)
        elif not path.name.startswith((".tmp-", ".stale-")):
            continue
        aside = path.with_name(f".stale-{path.name.removeprefix('.stale-')}")
        if aside != path:
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_path(directory)
    return removed
