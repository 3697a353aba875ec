"""Which run, and which history of it, a checkpoint, an export or a delta comes from: so that
deltas are applied only to a base whose tables they continue (:mod:`recsys.checkpoint.deltas`).

A run is one model trained from its initialization: a fresh start, or a fine-tuning
(``checkpoint.init_from``), gets a new random run id. A session is one launch that trains it
(the start, then every resume) and gets a random session id. A lineage is the run id and the
sessions that led to a state, in order, each with the step it started from: a fresh run's first
session starts at 0; a resume appends its session, at the step it resumed, to the lineage of
the checkpoint it loaded. A fine-tuned run records its parent's run id and step as information
only. The ids come from the operating system's randomness (:mod:`secrets`), never from the
generators training draws from; under torchrun the first rank's ids are every rank's.

Where. Every checkpoint holds the lineage of the session that saved it (``lineage.json``, beside
``config.toml``), every export that of its checkpoint (in ``dynamic.json``), every delta that of
the session that wrote it (in ``delta.json``), all as::

    {"run_id": "<16 hex>", "sessions": [{"id": "<16 hex>", "from_step": S}, ...],
     "parent": null | {"run_id": "<16 hex>" | null, "step": N}}

Same tables. The tables at step B of a lineage were trained by its sessions that started
before B (:meth:`Lineage.history_at`; a session that resumed at B loaded them). Two lineages
hold the same tables at step B when they are of one run with the same history at B: so a delta
continues a base of step B when its run is the base's and its branch split from the base's at
B or later (a resume from an older checkpoint than the base starts a branch that trained the
base's steps again: its deltas are refused, even where that retraining was bitwise the same).

Checkpoints saved before recsys recorded lineages have no ``lineage.json``; they resume as
before, the resumed session starting a new run id (what came before it is unknown).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LINEAGE_FILE",
    "Lineage",
    "Session",
    "divergence",
    "new_run",
    "read_lineage",
    "resumed_run",
]

LINEAGE_FILE = "lineage.json"
"""A checkpoint's lineage: this file of its directory."""


def _new_id() -> str:
    """A random id (64 bits of the OS's randomness: no training RNG stream moves)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Session:
    """One launch of training: its id and the step it started from (0, or the step of the
    checkpoint it resumed)."""

    id: str
    from_step: int


@dataclass(frozen=True)
class Lineage:
    """A run id and the sessions that trained a state, oldest first (see the module
    docstring). ``parent``: the (run id or None, step) a fine-tuned run started from."""

    run_id: str
    sessions: tuple[Session, ...]
    parent: tuple[str | None, int] | None = None

    def history_at(self, step: int) -> tuple[Session, ...]:
        """The sessions that trained the tables of ``step`` (those that started before it)."""
        return tuple(s for s in self.sessions if s.from_step < step)

    def to_json(self) -> dict[str, Any]:
        """The lineage as the JSON object the files hold."""
        parent = None
        if self.parent is not None:
            parent = {"run_id": self.parent[0], "step": self.parent[1]}
        sessions = [{"id": s.id, "from_step": s.from_step} for s in self.sessions]
        return {"run_id": self.run_id, "sessions": sessions, "parent": parent}

    @staticmethod
    def from_json(fields: Any) -> Lineage | None:
        """What :meth:`to_json` wrote (None for None: a file that predates lineages).

        Raises:
            ValueError: ``fields`` is not a lineage.
        """
        if fields is None:
            return None
        try:
            sessions = tuple(Session(str(s["id"]), int(s["from_step"])) for s in fields["sessions"])
            parent = fields.get("parent")
            if parent is not None:
                run_id = parent["run_id"]
                parent = (None if run_id is None else str(run_id), int(parent["step"]))
            lineage = Lineage(str(fields["run_id"]), sessions, parent)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a run lineage ({type(error).__name__}: {error})") from None
        if not sessions:
            raise ValueError("not a run lineage: it has no session")
        return lineage


def new_run(parent: Lineage | None = None, parent_step: int | None = None) -> Lineage:
    """The lineage of a new run (a fresh start, or fine-tuning from a checkpoint of
    ``parent_step`` whose lineage is ``parent``): a new run id, one session from step 0."""
    origin = None
    if parent_step is not None:
        origin = (parent.run_id if parent is not None else None, parent_step)
    return Lineage(_new_id(), (Session(_new_id(), 0),), origin)


def resumed_run(lineage: Lineage | None, step: int) -> Lineage:
    """The lineage of a session that resumes a checkpoint of ``step`` saved with ``lineage``:
    a new session appended; for a checkpoint saved before lineages (None), a new run id whose
    only session starts at ``step`` (what trained the steps before it is unknown)."""
    session = Session(_new_id(), step)
    if lineage is None:
        return Lineage(_new_id(), (session,))
    return Lineage(lineage.run_id, (*lineage.sessions, session), lineage.parent)


def read_lineage(checkpoint: str | Path) -> Lineage | None:
    """The lineage a checkpoint directory was saved with (None: saved before lineages).

    Raises:
        ValueError: its ``lineage.json`` does not read back.
    """
    file = Path(checkpoint) / LINEAGE_FILE
    if not file.is_file():
        return None
    try:
        return Lineage.from_json(json.loads(file.read_text()))
    except ValueError as error:
        raise ValueError(
            f"checkpoint '{checkpoint}': {LINEAGE_FILE} is unreadable: {error}"
        ) from None


def divergence(before: Lineage, after: Lineage, step: int) -> str | None:
    """Why ``after``'s tables at ``step`` are not ``before``'s (None: they are: one run, one
    history up to ``step``), in words that name ``before`` the base and ``after`` the delta.
    """
    if before.run_id != after.run_id:
        return (
            "they are of different runs; apply a run's deltas to a checkpoint or export of that "
            "same run"
        )
    base, delta = before.history_at(step), after.history_at(step)
    if base == delta:
        return None
    split = next(
        (i for i, (b, d) in enumerate(zip(base, delta, strict=False)) if b != d),
        min(len(base), len(delta)),
    )
    if split < len(delta):
        session = delta[split]
        return (
            f"the delta's branch of run {after.run_id} resumed from step {session.from_step} "
            f"(session {session.id}), before step {step}, and trained steps "
            f"{session.from_step + 1}..{step} again: its tables at step {step} are not the "
            f"base's; use a base saved on that branch (a checkpoint of step >= "
            f"{session.from_step} written since, or an export of one)"
        )
    session = base[split]
    return (
        f"the base's branch of run {before.run_id} resumed from step {session.from_step} "
        f"(session {session.id}), before step {step}, and trained steps "
        f"{session.from_step + 1}..{step} again, which the delta's branch did not: apply the "
        "deltas that the base's branch wrote"
    )
