"""The model a server answers with: an export (or a checkpoint exported on load) whose dynamic
tables follow the deltas a training run writes, one atomic version at a time.

A :class:`ServedVersion` is immutable once published: its program, the step its tables are at,
and the base the next delta must continue (the export's checkpoint, then the last delta
applied). :meth:`ServedModel.refresh` builds the next version beside the served one (a copy of
the program with the deltas' rows put in, :mod:`recsys.serve.exported_deltas`) and publishes it
with one reference assignment, so a batch scored with :meth:`ServedModel.score` reads one
version from start to end and requests in flight finish on the version they started with. A
delta that does not continue the served version (another run, a branch resumed before its
step, a gap) or that is corrupt (a file that fails its checksum) is refused and logged once; the
served version stays, and so does every later delta of that chain (they would build on it).

A new base is loaded the same way: when the model's source changes (a ``.pt2`` replaced by a
new ``recsys export`` to the same path, or, for a run or checkpoints directory, its ``latest``
checkpoint moving on), :meth:`ServedModel.refresh` loads it beside the served version (a
directory's checkpoint is exported first), applies the deltas written after it, and publishes
both as one version: the dense layers and fixed tables move with the base, the dynamic tables
with the deltas. A base that cannot load, or that reads other features than the served one
(requests are checked against those), is refused and logged once; the served version stays.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recsys.checkpoint.deltas import (
    DeltaBase,
    Tables,
    apply_delta,
    delta_chain,
    deltas_directory,
    list_deltas,
    read_delta,
)
from recsys.checkpoint.io import SPEC_FILE, resolve_checkpoint
from recsys.data.batch import DatasetSpec
from recsys.serve.cached_tables import copy_program
from recsys.serve.compiled_program import COMPILE_CHOICES, compile_refusal, compiled_program
from recsys.serve.export import export_model, load_program
from recsys.serve.exported_deltas import (
    DYNAMIC_FILE,
    export_base,
    exported_tables,
    put_exported_tables,
)
from recsys.serve.program_file import archive_has, archive_text, check_served_export

__all__ = ["ServedModel", "ServedVersion"]

logger = logging.getLogger("recsys.serve")


@dataclass(frozen=True)
class ServedVersion:
    """One published state of the served model (never changed after publishing)."""

    module: nn.Module | Callable[..., torch.Tensor]
    """The program: ``(dense, values, lengths) -> probabilities [B, T]`` (key-major ids); the
    exported program's module, or its AOTInductor compilation (``compile="aoti"``)."""
    step: int
    """The training step its tables are at: the export's checkpoint's, or the last delta's."""
    base: DeltaBase | None
    """What the next delta must continue (None: the export has no dynamic tables to follow)."""
    tables: Tables
    """Its dynamic tables as (keys, rows), the form deltas apply to."""
    info: dict | None = None
    """The export's ``dynamic.json``: where its dynamic tables sit in the program."""


class ServedModel:
    """An exported model for online scoring, optionally following a run's deltas.

    Args:
        path: a ``.pt2`` file from ``recsys export``, or a checkpoint (directory, or a run
            directory: its newest checkpoint), exported to a temporary file on load.
            :meth:`refresh` loads a new base from it when it changes (the file replaced, the
            run's ``latest`` checkpoint moved on).
        deltas: the deltas directory (or run directory) of the run the model comes from:
            :meth:`refresh` applies the deltas written after the served step.
        cache_rows: rows of each tiered table's cache (:mod:`recsys.serve.cached_tables`;
            default: the training run's); a model without tiered tables ignores it.
        compile: ``"aoti"``: score with each base compiled by AOTInductor
            (:mod:`recsys.serve.compiled_program`; not with ``deltas`` or tiered tables);
            ``"off"``: the exported program.

    Raises:
        FileNotFoundError, ValueError: as :func:`~recsys.serve.export.load_program` and
            :func:`~recsys.serve.export.export_model` (a file that is no export, a directory
            that is no checkpoint); deltas for an export without dynamic tables.

    Example::

        served = ServedModel("model.pt2", deltas="runs/dlrm")
        served.refresh()  # apply the deltas written since
        scores, step = served.score(dense, lengths, values)  # sample-major ids
    """

    def __init__(
        self,
        path: str | Path,
        deltas: str | Path | None = None,
        cache_rows: int | None = None,
        compile: str = "off",
    ) -> None:
        self.path = Path(path)
        self.cache_rows = cache_rows
        if compile not in COMPILE_CHOICES:
            raise ValueError(f"compile={compile!r}; expected one of {', '.join(COMPILE_CHOICES)}")
        if compile == "aoti" and deltas is not None:
            raise ValueError(compile_refusal(None, deltas=True))
        self.compile = compile
        self.deltas = None if deltas is None else deltas_directory(deltas)
        self._refused: set[str] = set()
        self._lock = threading.Lock()  # one refresh at a time; scoring never takes it
        self._watcher: threading.Thread | None = None
        self.num_refused = 0
        """Deltas (or chains of them) and new bases refused so far."""
        self.num_bases = 1
        """Bases loaded so far (the first, then each new one published)."""
        try:
            self._source = self._source_stamp()
        except (OSError, ValueError):
            self._source = None  # _load_base raises its own error for a missing source
        self.version = self._load_base()
        self.spec: DatasetSpec = self._spec

    def _source_stamp(self) -> object:
        """What identifies the served base at its source: a directory's checkpoint (its
        ``latest``), or the file's inode, mtime and size (a new export is a new file)."""
        if self.path.is_dir():
            return str(resolve_checkpoint(self.path))
        stat = self.path.stat()
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    def _load_base(self) -> ServedVersion:
        """The version of the base at :attr:`path` now, no delta applied (sets ``_spec``)."""
        if self.compile == "aoti":
            return self._compiled_base()
        if self.path.is_dir():
            with tempfile.TemporaryDirectory(prefix="recsys-serve-") as work:
                exported = export_model(self.path, Path(work) / "m.pt2")
                module, spec, info = load_program(exported, self.cache_rows)
        else:
            module, spec, info = load_program(self.path, self.cache_rows)
        # The program's graph checks its inputs' shapes itself (its guards); torch's pytree
        # check of the call's structure in front of it repeats what every request's checks
        # guarantee (three tensors), for 40 to 130 us a call on a CPU (a one-row request's
        # score about 8 % faster). (A copy made for deltas has no such hook: copy_program.)
        module.validate_inputs = False
        if self.deltas is not None and hasattr(module, "cached_tables"):
            raise ValueError(
                f"'{self.path}' keeps its tables in the host or disk tier (tiered tables, "
                "looked up through a cache): training writes no deltas for tiered tables, "
                "which change with a new base (export a later checkpoint to the served file, "
                "or serve the run directory); serve it without --deltas"
            )
        if self.deltas is not None and not (info and info["tables"]):
            raise ValueError(
                f"'{self.path}' has no dynamic tables for deltas to update (--deltas applies to "
                "models with dynamic tables, exported by a recsys that writes deltas)"
            )
        self._spec = spec
        if info and info["tables"]:
            base = export_base(info, self.path)
            return ServedVersion(module, info["step"], base, exported_tables(module, info), info)
        return ServedVersion(module, info["step"] if info else -1, None, {}, info)

    def _compiled_base(self) -> ServedVersion:
        """The base compiled by AOTInductor (``compile="aoti"``), from one snapshot of the
        source (a directory's checkpoint exported, a file linked or copied), so the spec, the
        step and the program all come from one file even if the source is replaced meanwhile."""
        with tempfile.TemporaryDirectory(prefix="recsys-serve-") as work:
            snapshot = Path(work) / "m.pt2"
            if self.path.is_dir():
                export_model(self.path, snapshot)
            else:
                _link_or_copy(self.path, snapshot)
            try:
                check_served_export(snapshot, deltas=False)
            except ValueError as error:  # worded for the source, not the snapshot
                raise ValueError(str(error).replace(str(snapshot), str(self.path))) from None
            spec = DatasetSpec.from_json(json.loads(archive_text(snapshot, SPEC_FILE)))
            info = None
            if archive_has(snapshot, f"extra/{DYNAMIC_FILE}"):
                info = json.loads(archive_text(snapshot, DYNAMIC_FILE))
            module = compiled_program(snapshot, shown=self.path)
        self._spec = spec
        return ServedVersion(module, info["step"] if info else -1, None, {}, info)

    @property
    def step(self) -> int:
        """The step the served version is at (-1: an export that predates steps)."""
        return self.version.step

    def cache_stats(self) -> dict[str, dict[str, float]]:
        """The served version's tiered tables' cache counters, per table (empty without
        tiered tables; see :meth:`recsys.serve.cached_tables.CachedTables.stats`)."""
        tables = getattr(self.version.module, "cached_tables", None)
        return {} if tables is None else tables.stats()

    def score(
        self, dense: np.ndarray, lengths: np.ndarray, values: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """Probabilities for B samples, from one version.

        Args:
            dense: float32 [B, N_dense], in ``spec.dense_names`` order.
            lengths: int64 [B, F]: sample b's number of ids of feature f (``spec.sparse_names``
                order).
            values: int64 [L]: the ids, sample-major (sample 0's feature 0 ids, its feature 1
                ids, ..., then sample 1's), L = lengths.sum().

        Returns:
            (float32 [B, T] probabilities, tasks in ``spec.label_names`` order; the step of the
            version that scored them).
        """
        version = self.version  # read once: the whole batch sees one version
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)  # [B, F]
        values = np.ascontiguousarray(values, dtype=np.int64)  # [L]
        if len(lengths) > 1:  # sample-major -> key-major (one sample's ids are both)
            # numpy: on a small batch its calls cost a few us where torch's cost tens; feature
            # numbers in the smallest integer type, which numpy's stable sort radix-sorts
            features = np.arange(lengths.shape[1], dtype=np.min_scalar_type(lengths.shape[1]))
            feature_of_id = np.repeat(np.tile(features, len(lengths)), lengths.ravel())
            values = values[np.argsort(feature_of_id, kind="stable")]
        with torch.no_grad():
            probabilities = version.module(
                torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
                torch.from_numpy(values),
                torch.from_numpy(np.ascontiguousarray(lengths.T).reshape(-1)),  # lengths[f*B + b]
            )
        return probabilities.numpy(), version.step

    def refresh(self) -> int:
        """Load a new base if the source has one (see the module docstring), apply the deltas
        written after the served step, and publish the result as one new version. A base or
        delta that cannot be used is refused and logged (once), and the served version stays.

        Returns:
            The number of deltas applied (0: none new, or refused; a new base alone counts 0).
        """
        with self._lock:
            served = self.version
            new_base = self._new_base()
            if new_base is not None:
                served = new_base
            applied = 0
            if self.deltas is not None:
                served, applied = self._apply_deltas(served)
            if new_base is None and not applied:
                return 0
            self.version = served
        if new_base is not None:
            self.num_bases += 1
            logger.info("loaded a new base from '%s' at step %d", self.path, new_base.step)
        if applied:
            logger.info("serving step %d (%d delta(s) applied)", served.step, applied)
        return applied

    def _new_base(self) -> ServedVersion | None:
        """The source's base when it changed since the served one was loaded (None: unchanged,
        or refused)."""
        try:
            stamp = self._source_stamp()
        except (OSError, ValueError):
            return None  # a file being replaced, or no checkpoint yet: look again next poll
        if stamp == self._source:
            return None
        key = f"base:{stamp}"
        if key in self._refused:
            return None
        spec = self._spec
        try:
            version = self._load_base()
        except Exception as error:  # a corrupt or unreadable export / checkpoint
            self._spec = spec
            self._refuse(key, f"refused the new base at '{self.path}': {error}")
            return None
        if self._spec != spec:
            new = self._spec
            self._spec = spec
            self._refuse(
                key,
                f"refused the new base at '{self.path}': it reads other features or tasks "
                f"({new.dense_names}, {new.sparse_names}, {new.label_names}, ids "
                f"{new.id_encoding}) than the served model ({spec.dense_names}, "
                f"{spec.sparse_names}, {spec.label_names}, ids {spec.id_encoding}); restart "
                "the server to serve it",
            )
            return None
        self._source = stamp
        return version

    def _apply_deltas(self, served: ServedVersion) -> tuple[ServedVersion, int]:
        """``served`` with the deltas written after it applied, and their number."""
        assert served.base is not None  # checked when the base loaded
        try:
            chain = delta_chain(list_deltas(self.deltas), served.base)
        except (ValueError, FileNotFoundError) as error:
            self._refuse(str(error), str(error))
            return served, 0
        tables, base, step, applied = served.tables, served.base, served.step, 0
        for delta in chain:
            try:
                tables = apply_delta(tables, read_delta(delta))
            except (ValueError, OSError) as error:
                self._refuse(str(delta.path), f"refused delta '{delta.path}': {error}")
                break
            base = DeltaBase(str(delta.path), delta.step, delta.lineage)
            step, applied = delta.step, applied + 1
        if not applied:
            return served, 0
        module = copy_program(served.module)
        try:
            put_exported_tables(module, served.info, tables)
        except ValueError as error:
            self._refuse(f"fit:{step}", f"refused the deltas up to step {step}: {error}")
            return served, 0
        return ServedVersion(module, step, base, tables, served.info), applied

    def watch(self, poll_seconds: float) -> None:
        """Start a thread that calls :meth:`refresh` every ``poll_seconds`` until :meth:`close`
        (new deltas, and a new base at the source)."""
        if self._watcher is not None:
            return
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.wait(poll_seconds):
                try:
                    self.refresh()
                except Exception:  # an unforeseen failure must not end the watching
                    logger.exception("refreshing failed; still serving step %d", self.step)

        self._watcher = threading.Thread(target=loop, name="recsys-deltas")
        self._watcher.start()

    def close(self) -> None:
        """Stop the watching thread (after the refresh in hand)."""
        if self._watcher is not None:
            self._stop.set()
            self._watcher.join()
            self._watcher = None

    def _refuse(self, key: str, message: str) -> None:
        """Log a refusal once per cause (the watcher retries every poll)."""
        if key not in self._refused:
            self._refused.add(key)
            logger.error("%s; still serving step %d", message, self.version.step)
            self.num_refused += 1


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a snapshot of ``source``: a hard link (the same bytes, whatever replaces
    ``source`` later), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
