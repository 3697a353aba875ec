"""Checkpoints with torch.distributed.checkpoint, committed atomically by a directory rename.

A checkpoint is the directory ``<run dir>/checkpoints/step_<N>``. It is first written to
``.tmp-step_<N>`` and renamed only once every rank has finished, so a crash mid-save leaves
the previous checkpoints untouched and no half-written ``step_<N>`` ever exists. The symlink
``checkpoints/latest`` is then swapped (atomically) to the new directory, and only after that
are checkpoints beyond the newest ``keep`` deleted.

Inside a checkpoint directory, next to DCP's files (``.metadata`` and one ``__<rank>_0.distcp``
per rank), the first rank writes plain-text sidecars: ``config.toml`` (the resolved config of
the run) and ``spec.json`` (the dataset's columns and table sizes), so a checkpoint alone is
enough to rebuild its model (:func:`load_model`) without the data it was trained on.

The tensors are saved in a layout that does not depend on how the run was sharded: every
table (and its optimizer state) under its logical name and full ``[num_embeddings, dim]``
shape, each rank writing the rows it owns. Any world size and sharding plan reads them back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys.config import Config, load_config, to_toml
from recsys.data.batch import DatasetSpec

_STEP_DIR = re.compile(r"^step_(\d+)$")
LATEST = "latest"
CONFIG_FILE = "config.toml"
SPEC_FILE = "spec.json"


def save_checkpoint(
    directory: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 0,
    *,
    config: Config | None = None,
    spec: DatasetSpec | None = None,
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

    Returns:
        The committed checkpoint directory.
    """
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp-step_{step:08d}"
    is_main = not _distributed() or dist.get_rank() == 0
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".tmp-step_*"):  # left by a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():
        # Single-process saves are intended; DCP warns that no process group exists.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.save(state, checkpoint_id=tmp)
    if is_main:
        if config is not None:
            _write_synced(tmp / CONFIG_FILE, to_toml(config))
        if spec is not None:
            _write_synced(tmp / SPEC_FILE, json.dumps(asdict(spec), indent=1) + "\n")
    _barrier()
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _point_latest(directory, final)
        if keep > 0:
            for old in list_checkpoints(directory)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(directory)
    _barrier()
    return final


def load_checkpoint(path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint into ``state`` in place (tensors are filled, plain values replaced).

    ``state`` gives the structure to read: keys the save wrote, with tensors of the right
    (logical) shapes, plain or sharded under any plan. Keys the save wrote but ``state`` lacks
    are not read. Returns ``state``.

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint directory.
        ValueError: ``state`` asks for keys the checkpoint does not hold, or a tensor of another
            shape (every difference is listed).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"checkpoint not found: '{path}' (no DCP .metadata in it)")
    _check_against(path, state)
    # Flattened here, as the save did: DCP's own flattening differs on load when the state
    # holds ShardedTensors (containers of plain values, e.g. param_groups, stay one key).
    flat, mapping = flatten_state_dict(state)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.load(flat, checkpoint_id=path)
    for key, value in flat.items():
        set_element(state, mapping[key], value)  # plain values are replaced, not filled
    return state


def checkpoint_shapes(path: str | Path) -> dict[str, torch.Size | None]:
    """Every key the checkpoint holds (flattened, ``"model.dense_arch.0.weight"``) with its
    logical shape, or None for a plain (non-tensor) value."""
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    return {
        key: (meta.size if isinstance(meta, TensorStorageMetadata) else None)
        for key, meta in metadata.items()
    }


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Committed checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None.

    Committed directories are complete by construction (a crash mid-save leaves only a
    ``.tmp-`` directory), so the newest one is found by name; ``directory/latest`` points at
    the same one."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def resolve_checkpoint(spec: str | Path, run_dir: str | Path | None = None) -> Path | None:
    """The checkpoint directory that ``spec`` names.

    Args:
        spec: ``"latest"`` (the newest checkpoint of ``run_dir``), a checkpoint directory, or a
            run directory or its ``checkpoints/`` directory (their newest checkpoint).
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


def read_config(path: str | Path) -> Config:
    """The resolved config a checkpoint was saved with (its ``config.toml``)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"'{file}' is missing: was '{path}' saved by recsys train?")
    return load_config(file)


def read_spec(path: str | Path) -> DatasetSpec:
    """The dataset spec a checkpoint was saved with (its ``spec.json``)."""
    file = Path(path) / SPEC_FILE
    if not file.is_file():
        raise FileNotFoundError(f"'{file}' is missing: was '{path}' saved by recsys train?")
    fields = json.loads(file.read_text())
    return DatasetSpec(**{key: tuple(value) for key, value in fields.items()})


def load_model(path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuild a checkpoint's model in this process, with its trained weights, in eval mode.

    Works whatever world size and sharding plan the checkpoint was saved with: tables are
    read back whole. No optimizer is attached (the tables' optimizer states are not read).

    Example::

        model = load_model("runs/dlrm/checkpoints/latest")
        logits = model(batch.dense, batch.sparse)  # [B, T]
    """
    from recsys.models import build_model

    path = Path(path)
    config, spec = read_config(path), read_spec(path)
    model = build_model(config.model, spec, torch.device(device))
    state = {"model": model.state_dict()}
    load_checkpoint(path, state)
    model.load_state_dict(state["model"])
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


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _point_latest(directory: Path, target: Path) -> None:
    """Swap ``directory/latest`` to ``target`` in one rename (readers never see no link)."""
    tmp = directory / f".{LATEST}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, directory / LATEST)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
