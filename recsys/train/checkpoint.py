"""Checkpoints with torch.distributed.checkpoint, committed atomically by a directory rename.

A checkpoint is the directory ``<run dir>/checkpoints/step_<N>``. It is first written to
``.tmp-step_<N>`` and renamed only once every rank has finished, so a crash mid-save leaves
the previous checkpoints untouched and no half-written ``step_<N>`` ever exists.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step_(\d+)$")


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 0) -> Path:
    """Save ``state`` (nested dicts of tensors and plain values) as ``directory/step_<step>``.

    Collective when torch.distributed is initialized: every rank calls it with its own state.

    Args:
        directory: the run's checkpoints directory.
        step: training step, names the checkpoint.
        state: what to save, e.g. ``{"model": ..., "optimizers": ..., "step": step}``.
        keep: keep only the newest ``keep`` checkpoints (0: keep all).

    Returns:
        The committed checkpoint directory.
    """
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp-step_{step:08d}"
    is_main = not _distributed() or dist.get_rank() == 0
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    with warnings.catch_warnings():
        # Single-process saves are intended; DCP warns that no process group exists.
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.save(state, checkpoint_id=tmp)
    _barrier()
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if keep > 0:
            for old in list_checkpoints(directory)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint into ``state`` in place (tensors are filled, plain values replaced).

    ``state`` gives the structure to read: the same keys a save wrote, with tensors of the
    right shapes. Returns ``state``.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint not found: '{path}'")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.load(state, checkpoint_id=path)
    return state


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Committed checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
