"""Checkpoints with torch.distributed.checkpoint, committed atomically by a directory rename.

A checkpoint is the directory ``<run dir>/checkpoints/step_<N>``. It is first written to
``.tmp-step_<N>`` and renamed only once every rank has finished, so a crash mid-save leaves
the previous checkpoints untouched and no half-written ``step_<N>`` ever exists. The symlink
``checkpoints/latest`` is then swapped (atomically) to the new directory, and only after that
are checkpoints beyond the newest ``keep`` deleted.

Inside a checkpoint directory, next to DCP's files (``.metadata`` and one ``__<rank>_0.distcp``
per rank), the first rank writes plain-text sidecars: ``config.toml`` (the resolved config of
the run), ``spec.json`` (the dataset's columns and table sizes), so a checkpoint alone is
enough to rebuild its model (:func:`load_model`) without the data it was trained on, and
``lineage.json`` (the run id and sessions that trained it, :mod:`recsys.checkpoint.lineage`: what
ties deltas to it; checkpoints saved before lineages have none and load as before).

Last before the commit, ``checksums.json`` records the size and CRC-32 of every file (each rank
checksums a share of them). Loading verifies them first (:func:`verify_checkpoint`): a flipped
byte or a truncated file is a :class:`CheckpointError` naming the file, never weights read into
a model. ``resume = "latest"`` goes back to the newest checkpoint that verifies
(:func:`find_resumable`).

The tensors are saved in a layout that does not depend on how the run was sharded: every
table (and its optimizer state) under its logical name and full ``[num_embeddings, dim]``
shape, each rank writing the rows it owns. Any world size and sharding plan reads them back.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys._files import file_checksum, fsync_path, write_failure
from recsys.build.models import build_model, fused_embedding_optimizer
from recsys.build.tiered_tables import private_storage, tiered_collections
from recsys.checkpoint.lineage import LINEAGE_FILE, Lineage
from recsys.config import Config, load_saved_config, to_toml
from recsys.data.batch import DatasetSpec
from recsys.distributed.ranks import all_gather, barrier, from_first_rank, is_distributed
from recsys.embedding.dynamic.table import load_every_key
from recsys.embedding.interface import state_to_load

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
BEST = "best"
CONFIG_FILE = "config.toml"
SPEC_FILE = "spec.json"
CHECKSUMS_FILE = "checksums.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted: a file missing, truncated or changed since it was
    saved, or metadata that does not read back."""


def save_checkpoint(
    directory: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 0,
    *,
    config: Config | None = None,
    spec: DatasetSpec | None = None,
    protect: int | None = None,
    write_files: Callable[[Path], None] | None = None,
    lineage: Lineage | None = None,
) -> Path:
    """Save ``state`` (nested dicts of tensors and plain values) as ``directory/step_<step>``.

    Collective when torch.distributed is initialized: every rank calls it with its own state
    (ShardedTensors are written by the ranks that hold their shards; a plain value or tensor
    that every rank has under the same key is written once).

    Args:
        directory: the run's checkpoints directory.
        step: training step, names the checkpoint.
        state: what to save, e.g. ``{"model": ..., "optimizers": ..., "step": step}``.
        keep: keep only the newest ``keep`` checkpoints (0: keep all).
        config: the run's resolved config, written as ``config.toml`` in the checkpoint.
        spec: the dataset's spec, written as ``spec.json`` (what :func:`load_model` needs).
        protect: a step whose checkpoint ``keep`` never deletes (the best one).
        write_files: writes this rank's own files into the directory being written (the
            tiered tables' rows, streamed); they are checksummed and committed with the rest.
        lineage: the lineage of the session saving it, written as ``lineage.json``.

    Returns:
        The committed checkpoint directory.
    """
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp-step_{step:08d}"
    is_main = not is_distributed() or dist.get_rank() == 0
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        remove_uncommitted(directory)  # left by a save that crashed
    barrier()
    with _quiet_dcp():
        try:
            dcp.save(state, checkpoint_id=tmp)
        except (Exception, CheckpointException) as error:
            failure = write_failure(error, tmp)
            if failure is error:
                raise
            raise failure from error
    if write_files is not None:
        write_files(tmp)
    if is_main:
        if config is not None:
            _write_synced(tmp / CONFIG_FILE, to_toml(config))
        if spec is not None:
            _write_synced(tmp / SPEC_FILE, json.dumps(asdict(spec), indent=1) + "\n")
        if lineage is not None:
            _write_synced(tmp / LINEAGE_FILE, json.dumps(lineage.to_json(), indent=1) + "\n")
    barrier()
    names = from_first_rank(sorted(p.name for p in tmp.iterdir() if p.is_file()))
    sums = dict(_gather_list([(name, _checksum_fields(tmp / name)) for name in _my_share(names)]))
    if is_main:
        manifest = {"algorithm": "crc32", "files": dict(sorted(sums.items()))}
        _write_synced(tmp / CHECKSUMS_FILE, json.dumps(manifest, indent=1) + "\n")
        replaced = directory / f".old-{final.name}"
        if final.exists():  # e.g. a damaged checkpoint of this step, skipped by the resume
            final.rename(replaced)
        tmp.rename(final)
        _point_latest(directory, final)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep > 0:
            # Only older steps: a later checkpoint left by a run this one forked from (a resume
            # of an older checkpoint) is not this run's to delete.
            older = [
                p
                for p in list_checkpoints(directory)
                if _step_of(p) < step and _step_of(p) != protect
            ]
            for old in older[: max(len(older) - (keep - 1), 0)]:
                shutil.rmtree(old, ignore_errors=True)
        fsync_path(directory)
    barrier()
    return final


def remove_uncommitted(directory: str | Path) -> None:
    """Delete what an unfinished save left in the checkpoints ``directory`` (``.tmp-step_<N>``
    being written, ``.old-step_<N>`` being replaced); committed checkpoints are untouched. Only
    while no save is running (one process, or all ranks between saves)."""
    directory = Path(directory)
    for stale in [*directory.glob(".tmp-step_*"), *directory.glob(".old-step_*")]:
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(
    path: str | Path, state: dict[str, Any], *, verify: bool = True
) -> dict[str, Any]:
    """Load a checkpoint into ``state`` in place (tensors are filled, plain values replaced).

    ``state`` gives the structure to read: keys the save wrote, with tensors of the right
    (logical) shapes, plain or sharded under any plan. Keys the save wrote but ``state`` lacks
    are not read. Collective under torch.distributed (every rank calls it). Returns ``state``.

    Args:
        path: the checkpoint directory.
        state: what to read, filled in place.
        verify: check every file against ``checksums.json`` first (:func:`verify_checkpoint`);
            False when the caller has just verified it.

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint directory.
        CheckpointError: a file is missing, truncated or corrupt (named in the message).
        ValueError: ``state`` asks for keys the checkpoint does not hold, or a tensor of another
            shape (every difference is listed).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"checkpoint not found: '{path}' (no DCP .metadata in it)")
    if verify:
        verify_checkpoint(path)
    with _quiet_dcp():
        _check_against(path, state)
        # Flattened here, as the save did: DCP's own flattening differs on load when the state
        # holds ShardedTensors (containers of plain values, e.g. param_groups, stay one key).
        flat, mapping = flatten_state_dict(state)
        dcp.load(flat, checkpoint_id=path)
    for key, value in flat.items():
        set_element(state, mapping[key], value)  # plain values are replaced, not filled
    return state


def verify_checkpoint(path: str | Path) -> None:
    """Check every file of a checkpoint against the sizes and CRC-32s its ``checksums.json``
    recorded when it was saved. Collective under torch.distributed: each rank reads a share of
    the files, and every rank raises the same error.

    A checkpoint saved before checksums existed (no ``checksums.json``) is not verified; a
    warning says so.

    Raises:
        CheckpointError: a file missing, of another size (truncated) or with another checksum
            (corrupt), or an unreadable ``checksums.json``; the message names the file.
    """
    path = Path(path)
    manifest_file = path / CHECKSUMS_FILE
    problem = None
    expected: dict[str, dict[str, int]] = {}
    if not manifest_file.is_file():
        warnings.warn(
            f"checkpoint '{path}' has no {CHECKSUMS_FILE} (saved by an older recsys): its files "
            "are not verified",
            stacklevel=2,
        )
    else:
        try:
            expected = json.loads(manifest_file.read_text())["files"]
        except (ValueError, KeyError, TypeError, OSError) as error:
            problem = f"'{manifest_file}' is unreadable ({error})"
    problems = _gather_list(
        [problem]
        if problem
        else [_verify_file(path, n, expected[n]) for n in _my_share(sorted(expected))]
    )
    problems = [p for p in problems if p]
    if problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint '{path}' is damaged: {problems[0]}{more}")


def find_resumable(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint ``resume = "latest"`` continues from: the one ``checkpoints/latest``
    points to (else the newest), or, when it does not verify, the newest older one that does.

    Collective under torch.distributed (verification reads the files on every rank).

    Returns:
        (the checkpoint, absolute, or None when the run has none; one line per checkpoint
        skipped, saying why).

    Raises:
        CheckpointError: the run has checkpoints and none of them verifies.
    """
    directory = Path(run_dir) / "checkpoints"
    newest = latest_checkpoint(directory)
    if newest is None:
        return None, []
    candidates = [newest] + [p for p in reversed(list_checkpoints(directory)) if p != newest]
    candidates = [p for p in candidates if _step_of(p) <= _step_of(newest)]
    skipped = []
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
            checkpoint_shapes(candidate)  # the metadata reads back
        except CheckpointError as error:
            skipped.append(f"skipped {candidate.name}: {error}")
            continue
        return candidate.resolve(), skipped
    raise CheckpointError(f"no checkpoint of '{run_dir}' verifies:\n  " + "\n  ".join(skipped))


def checkpoint_shapes(path: str | Path) -> dict[str, torch.Size | None]:
    """Every key the checkpoint holds (flattened, ``"model.dense_arch.0.weight"``) with its
    logical shape, or None for a plain (non-tensor) value.

    Raises:
        CheckpointError: the DCP ``.metadata`` file does not read back (truncated or corrupt).
    """
    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise
    except Exception as error:  # pickle raises many kinds on a damaged file
        raise CheckpointError(
            f"checkpoint '{path}': its .metadata does not read back "
            f"({type(error).__name__}: {error})"
        ) from None
    return {
        key: (meta.size if isinstance(meta, TensorStorageMetadata) else None)
        for key, meta in metadata.items()
    }


def tensor_reader(path: str | Path) -> Callable[[list[str]], dict[str, torch.Tensor]]:
    """A reader of whole tensors of checkpoint ``path`` by (flattened) key, for what a model
    must know before it is loaded (see :func:`recsys.embedding.interface.state_to_load`).
    Each call is a collective under torch.distributed: every rank asks for the same keys."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        state = {}
        for key in keys:
            meta = metadata.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint '{path}' holds no tensor {key!r}")
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        if keys:
            with _quiet_dcp():
                dcp.load(state, checkpoint_id=path)
        return state

    return read


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Committed checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint ``directory/latest`` points to (the last one committed), or, without
    that link, the newest committed one by step; None when there is none.

    Committed directories are complete by construction (a crash mid-save leaves only a
    ``.tmp-`` directory). The link, not the highest step, is followed: a run that resumed an
    older checkpoint commits lower steps than ones it left behind."""
    directory = Path(directory)
    link = directory / LATEST
    if link.is_symlink() and _STEP_DIR.match(os.readlink(link)) and link.resolve().is_dir():
        return directory / os.readlink(link)
    found = list_checkpoints(directory)
    return found[-1] if found else None


def resolve_checkpoint(spec: str | Path, run_dir: str | Path | None = None) -> Path | None:
    """The checkpoint directory that ``spec`` names.

    Args:
        spec: ``"latest"`` (the newest checkpoint of ``run_dir``), ``"best"`` (its best one,
            see ``checkpoint.keep_best``), a checkpoint directory (``<run>/checkpoints/best``
            too), or a run directory or its ``checkpoints/`` directory (their newest
            checkpoint).
        run_dir: the run directory ``"latest"`` refers to.

    Returns:
        The checkpoint directory (absolute, links resolved); None for ``"latest"`` when the
        run has no checkpoint yet (a fresh start, e.g. the first attempt of an elastic job).

    Raises:
        FileNotFoundError: a path that is not a checkpoint and holds none.
    """
    if str(spec) == LATEST:
        if run_dir is None:
            raise ValueError("'latest' needs the run directory it refers to")
        found = latest_checkpoint(Path(run_dir) / "checkpoints")
        return found.resolve() if found is not None else None
    if str(spec) == BEST:
        if run_dir is None:
            raise ValueError("'best' needs the run directory it refers to")
        link = Path(run_dir) / "checkpoints" / BEST
        if not (link / ".metadata").is_file():
            raise FileNotFoundError(
                f"'{link}' does not exist: the run kept no best checkpoint "
                '(train it with checkpoint.keep_best = "valid_auc")'
            )
        return link.resolve()
    path = Path(spec)
    if (path / ".metadata").is_file():
        return path.resolve()  # a `latest` link is followed now, not when it may have moved
    for directory in (path / "checkpoints", path):
        if (found := latest_checkpoint(directory)) is not None:
            return found.resolve()
    raise FileNotFoundError(
        f"checkpoint not found: '{path}' is neither a checkpoint directory (step_<N>/ with a "
        "DCP .metadata file) nor a run or checkpoints directory holding one"
    )


def checkpoint_step(checkpoint: str | Path) -> int:
    """The training step a checkpoint was saved at."""
    return int(load_checkpoint(checkpoint, {"step": 0}, verify=False)["step"])


def read_config(path: str | Path) -> Config:
    """The resolved config a checkpoint was saved with (its ``config.toml``)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"'{file}' is missing: was '{path}' saved by recsys train?")
    return load_saved_config(file)


def read_spec(path: str | Path) -> DatasetSpec:
    """The dataset spec a checkpoint was saved with (its ``spec.json``)."""
    file = Path(path) / SPEC_FILE
    if not file.is_file():
        raise FileNotFoundError(f"'{file}' is missing: was '{path}' saved by recsys train?")
    fields = json.loads(file.read_text())
    return DatasetSpec.from_json(fields)


def load_model(path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuild a checkpoint's model in this process, with its trained weights, in eval mode.

    ``path`` is a checkpoint directory, or a run directory / its ``checkpoints/`` (their
    latest checkpoint). Works whatever world size and sharding plan the checkpoint was saved
    with: tables are read back whole. No optimizer is attached (the tables' optimizer states
    are not read; tiered tables keep theirs, in their rows, and load into their tier, a disk
    tier in a temporary directory of the model's own).

    Example::

        model = load_model("runs/dlrm/checkpoints/latest")
        logits = model(batch.dense, batch.sparse)  # [B, T]
    """
    path = resolve_checkpoint(path)
    verify_checkpoint(path)  # before its sidecars are trusted
    config, spec = read_config(path), read_spec(path)
    tables = private_storage(config.model.storage)  # never the run's own files
    model = build_model(
        config.model,
        spec,
        torch.device(device),
        seed=config.run.seed,
        embedding_optimizer=fused_embedding_optimizer(config.train),
    )
    shapes = checkpoint_shapes(path)
    state = {"model": state_to_load(model, shapes, "model.", tensor_reader(path))}
    load_checkpoint(path, state, verify=False)
    load_every_key(model)  # scores as the run did, whatever the sharding
    model.load_state_dict(state["model"])
    for collection in tiered_collections(model):
        collection.tiered_files().load(path)
    if tables is not None:
        model.tiered_directory = tables  # removed with the model
    return model.eval()


def _check_against(path: Path, state: dict[str, Any]) -> None:
    """Raise one ValueError listing every key of ``state`` the checkpoint lacks or holds with
    another shape."""
    saved = checkpoint_shapes(path)
    missing, mismatched = [], []
    for key, value in _flatten(state):
        if key not in saved:
            missing.append(key)
        elif (
            hasattr(value, "shape")
            and saved[key] is not None
            and tuple(saved[key]) != tuple(value.shape)
        ):
            mismatched.append(f"{key}: checkpoint {list(saved[key])}, here {list(value.shape)}")
    if missing or mismatched:
        lines = [f"'{path}' does not match what is being loaded:"]
        if missing:
            lines.append(f"  not in the checkpoint ({len(missing)}): {', '.join(missing)}")
        for line in mismatched:
            lines.append(f"  shape differs: {line}")
        raise ValueError("\n".join(lines))


def _flatten(state: dict[str, Any]) -> list[tuple[str, Any]]:
    """``state`` under the flattened keys DCP stores it with."""
    flat, _ = flatten_state_dict(state)
    return list(flat.items())


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP's warnings that say nothing to a user: a single-process save or load is intended
    (no process group), and sharded tables are ShardedTensors until torchrec moves to DTensor
    (every access warns that ShardedTensor is deprecated)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def _step_of(checkpoint: Path) -> int:
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def _checksum_fields(path: Path) -> dict[str, int]:
    size, crc = file_checksum(path)
    return {"bytes": size, "crc32": crc}


def _verify_file(directory: Path, name: str, expected: dict[str, int]) -> str | None:
    """What is wrong with file ``name`` of a checkpoint, or None."""
    path = directory / name
    if not path.is_file():
        return f"'{name}' is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"'{name}' is {size:,} bytes, {expected['bytes']:,} when saved (truncated?)"
    if file_checksum(path)[1] != expected["crc32"]:
        return f"'{name}' does not match the checksum recorded when it was saved (corrupt)"
    return None


def _my_share(names: Any) -> list[str]:
    """This rank's share of a list of file names (all of them in one process)."""
    if not is_distributed():
        return list(names)
    return list(names)[dist.get_rank() :: dist.get_world_size()]


def _gather_list(part: list[Any]) -> list[Any]:
    """Every rank's list concatenated in rank order (on every rank)."""
    return [item for p in all_gather(part) for item in p]


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _point_latest(directory: Path, target: Path, name: str = LATEST) -> None:
    """Swap ``directory/<name>`` to ``target`` in one rename (readers never see no link)."""
    tmp = directory / f".{name}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, directory / name)


def point_best(checkpoint: Path) -> None:
    """Link ``<checkpoints dir>/best`` to ``checkpoint`` (atomically; rank 0 only)."""
    if not is_distributed() or dist.get_rank() == 0:
        _point_latest(checkpoint.parent, checkpoint, BEST)
        fsync_path(checkpoint.parent)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators' states (torch, numpy, Python, and CUDA on
    ``device``): a resumed run continues their streams exactly."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
