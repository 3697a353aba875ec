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
"""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
import warnings
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
from recsys.data.batch import DatasetSpec
from recsys.serve.export import export_model, load_program
from recsys.serve.exported_deltas import export_base, exported_tables, put_exported_tables

__all__ = ["ServedModel", "ServedVersion"]

logger = logging.getLogger("recsys.serve")


@dataclass(frozen=True)
class ServedVersion:
    """One published state of the served model (never changed after publishing)."""

    module: nn.Module
    """The program: ``(dense, values, lengths) -> probabilities [B, T]`` (key-major ids)."""
    step: int
    """The training step its tables are at: the export's checkpoint's, or the last delta's."""
    base: DeltaBase | None
    """What the next delta must continue (None: the export has no dynamic tables to follow)."""
    tables: Tables
    """Its dynamic tables as (keys, rows), the form deltas apply to."""


class ServedModel:
    """An exported model for online scoring, optionally following a run's deltas.

    Args:
        path: a ``.pt2`` file from ``recsys export``, or a checkpoint (directory, or a run
            directory: its newest checkpoint), exported to a temporary file on load.
        deltas: the deltas directory (or run directory) of the run the model comes from:
            :meth:`refresh` applies the deltas written after the served step.

    Raises:
        FileNotFoundError, ValueError: as :func:`~recsys.serve.export.load_program` and
            :func:`~recsys.serve.export.export_model` (a file that is no export, a directory
            that is no checkpoint); deltas for an export without dynamic tables.

    Example::

        served = ServedModel("model.pt2", deltas="runs/dlrm")
        served.refresh()  # apply the deltas written since
        scores, step = served.score(dense, lengths, values)  # sample-major ids
    """

    def __init__(self, path: str | Path, deltas: str | Path | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            with tempfile.TemporaryDirectory(prefix="recsys-serve-") as work:
                module, spec, info = load_program(export_model(path, Path(work) / "model.pt2"))
        else:
            module, spec, info = load_program(path)
        self.path = path
        self.spec: DatasetSpec = spec
        self.deltas = None if deltas is None else deltas_directory(deltas)
        self._info = info
        self._refused: set[str] = set()
        self._lock = threading.Lock()  # one refresh at a time; scoring never takes it
        self._watcher: threading.Thread | None = None
        self.num_refused = 0
        """Deltas (or chains of them) refused so far."""
        if self.deltas is not None and not (info and info["tables"]):
            raise ValueError(
                f"'{path}' has no dynamic tables for deltas to update (--deltas applies to "
                "models with dynamic tables, exported by a recsys that writes deltas)"
            )
        if info and info["tables"]:
            self.version = ServedVersion(
                module, info["step"], export_base(info, path), exported_tables(module, info)
            )
        else:
            step = info["step"] if info else -1
            self.version = ServedVersion(module, step, None, {})

    @property
    def step(self) -> int:
        """The step the served version is at (-1: an export that predates steps)."""
        return self.version.step

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
        lengths_t = torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64))  # [B, F]
        values_t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))  # [L]
        # Sample-major -> key-major (the program's order): stable sort of each id's feature.
        feature = torch.arange(lengths_t.shape[1]).repeat(lengths_t.shape[0])  # [B*F]
        feature_of_id = torch.repeat_interleave(feature, lengths_t.reshape(-1))  # [L]
        order = torch.argsort(feature_of_id, stable=True)
        with torch.no_grad():
            probabilities = version.module(
                torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
                values_t[order],
                lengths_t.t().reshape(-1),  # [F*B]: lengths[f*B + b]
            )
        return probabilities.numpy(), version.step

    def refresh(self) -> int:
        """Apply the deltas written after the served step and publish the result as one new
        version. A delta that does not continue the served version, or is corrupt, is refused
        and logged (once), and the served version stays.

        Returns:
            The number of deltas applied (0: none new, or refused).
        """
        if self.deltas is None:
            return 0
        with self._lock:
            served = self.version
            assert served.base is not None  # checked in __init__
            try:
                chain = delta_chain(list_deltas(self.deltas), served.base)
            except (ValueError, FileNotFoundError) as error:
                self._refuse(str(error), str(error))
                return 0
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
                return 0
            with warnings.catch_warnings():
                # torch's pytree copies the program's input spec through a deprecated class
                warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
                module = copy.deepcopy(served.module)
            try:
                put_exported_tables(module, self._info, tables)
            except ValueError as error:
                self._refuse(f"fit:{step}", f"refused the deltas up to step {step}: {error}")
                return 0
            self.version = ServedVersion(module, step, base, tables)
        logger.info("serving step %d (%d delta(s) applied)", step, applied)
        return applied

    def watch(self, poll_seconds: float) -> None:
        """Start a thread that calls :meth:`refresh` every ``poll_seconds`` until :meth:`close`
        (no thread without ``deltas``)."""
        if self.deltas is None or self._watcher is not None:
            return
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.wait(poll_seconds):
                try:
                    self.refresh()
                except Exception:  # an unforeseen failure must not end the watching
                    logger.exception("applying deltas failed; still serving step %d", self.step)

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
