"""The run directory: what ``recsys train`` writes, and the rule that keeps one run from
overwriting another.

``runs/<name>/`` holds ``config.toml``, ``metrics.jsonl``, ``checkpoints/`` and
``tensorboard/``. Two recipes (or one recipe on two datasets, or a ``make train`` and a torchrun
launch) default to the same directory, so a new run that finds another run's checkpoints or
logged events there is refused with the ways out: another ``--run.dir``,
``--checkpoint.resume=latest`` to continue that run, or ``--run.overwrite=true`` to replace it.
A directory left by a run that failed before it logged anything (only ``config.toml``) is reused
silently: there is nothing in it to lose.
"""

from __future__ import annotations

import difflib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from recsys._files import is_inside, write_text_atomic
from recsys.checkpoint.io import LATEST, list_checkpoints
from recsys.config import Config, to_toml
from recsys.train.metrics import TENSORBOARD_DIR

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"
CHECKPOINTS_DIR = "checkpoints"


def previous_run(run_dir: str | Path) -> list[str]:
    """What an earlier run left in ``run_dir`` that a new run would destroy: committed
    checkpoints and logged events, one phrase each (empty when there is nothing)."""
    run_dir = Path(run_dir)
    found = []
    checkpoints = list_checkpoints(run_dir / CHECKPOINTS_DIR)
    if checkpoints:
        found.append(
            f"{len(checkpoints)} checkpoint(s) up to {CHECKPOINTS_DIR}/{checkpoints[-1].name}"
        )
    steps = _logged_steps(run_dir / METRICS_FILE)
    if steps is not None:
        found.append(f"{METRICS_FILE} with events up to step {steps}")
    return found


def check_run_dir(run_dir: str | Path, *, continuing: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a directory that holds another one.

    Args:
        run_dir: ``run.dir``.
        continuing: this run resumes a checkpoint of ``run_dir`` (``resume = "latest"`` or a
            path inside it): its files are this run's own.
        overwrite: ``run.overwrite``: the previous run's files are to be replaced (by
            :func:`clear_previous_run`, once this run has started successfully).

    Raises:
        ValueError: ``run_dir`` holds another run; the message lists what it holds and the
            options that resolve it.
    """
    if continuing or overwrite:
        return
    found = previous_run(run_dir)
    if not found:
        return
    raise ValueError(
        f"run directory '{run_dir}' holds another run ({'; '.join(found)}). Keep it and write "
        f"this run elsewhere: --run.dir={_free_name(Path(run_dir))}; continue it (with its own "
        f"config): --config {Path(run_dir) / CONFIG_FILE} --checkpoint.resume=latest; or "
        "replace it: --run.overwrite=true"
    )


def fresh_start_note(run_dir: str | Path) -> str:
    """The line ``resume = "latest"`` prints when ``run_dir`` holds no checkpoint: the run
    starts fresh (the first attempt of an elastic job, or a typo in ``run.name``). The
    directories beside it that hold checkpoints under a close name are offered: a user who
    asked to resume must not train hours from scratch without a word."""
    run_dir = Path(run_dir)
    parent = run_dir.parent
    others = []
    if parent.is_dir():
        others = [
            p.name
            for p in sorted(parent.iterdir())
            if p.is_dir() and p.name != run_dir.name and list_checkpoints(p / CHECKPOINTS_DIR)
        ]
    close = difflib.get_close_matches(run_dir.name, others, n=3)
    hint = ""
    if close:
        hint = (
            f" (close names that hold checkpoints: {', '.join(str(parent / c) for c in close)}; "
            "to resume one, give its --run.name or --run.dir)"
        )
    return f"resume=latest: no checkpoint under {run_dir}: starting fresh{hint}"


def clear_previous_run(run_dir: str | Path) -> list[str]:
    """Delete what recsys wrote in ``run_dir`` (config.toml, metrics.jsonl, checkpoints/,
    tensorboard/), and nothing else; returns what was deleted."""
    run_dir = Path(run_dir)
    removed = previous_run(run_dir)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    (run_dir / CONFIG_FILE).unlink(missing_ok=True)
    shutil.rmtree(run_dir / CHECKPOINTS_DIR, ignore_errors=True)
    shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
    return removed


def _logged_steps(metrics: Path) -> int | None:
    """The last step a train or eval event of ``metrics`` logged; None without one."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("split") in ("train", "valid", "test"):
            last = event.get("step", last)
    return last


def _free_name(run_dir: Path, taken: Callable[[Path], object] = Path.exists) -> Path:
    """``run_dir`` with the first suffix ``_2``, ``_3``, ... that is not ``taken``."""
    index = 2
    while taken(candidate := run_dir.with_name(f"{run_dir.name}_{index}")):
        index += 1
    return candidate


def unused_run_dir(config: Config) -> Path:
    """The directory an unnamed run writes to: ``run.dir`` itself when it holds no other run
    (or this run continues or replaces it), else the first of ``<run.dir>_2``, ``_3``, ...
    that holds none, as TensorBoard and Lightning number versions."""
    run_dir = Path(config.run.dir)
    if continuing(config) or config.run.overwrite or not previous_run(run_dir):
        return run_dir
    return _free_name(run_dir, taken=previous_run)


def seed_everything(seed: int) -> None:
    """Seed torch, numpy's and Python's global generators: nothing in recsys draws from the
    last two, but a user's model or data code may, and a checkpoint stores all three."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def continuing(config: Config) -> bool:
    """Whether this run continues a run of its own directory: resume = "latest", or a
    checkpoint inside run.dir."""
    resume = config.checkpoint.resume
    return resume == LATEST or (bool(resume) and is_inside(resume, Path(config.run.dir)))


def write_run_dir(config: Config, say: Callable[[str], None]) -> None:
    """Create the run directory (replacing a previous run's files with run.overwrite) and
    write the run's config into it."""
    run_dir = Path(config.run.dir)
    if config.run.overwrite and not continuing(config):
        removed = clear_previous_run(run_dir)
        if removed:
            say(f"--run.overwrite: replaced {'; '.join(removed)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_FILE, to_toml(config))
