"""Checkpoints and what is derived from them: save, load, verify and resume
(:mod:`~recsys.checkpoint.io`), fine-tuning from one (:mod:`~recsys.checkpoint.finetune`), the
incremental deltas of the dynamic tables (:mod:`~recsys.checkpoint.delta_writer` writes them,
:mod:`~recsys.checkpoint.deltas` reads and applies them) and the lineage that ties checkpoints,
exports and deltas to the run that wrote them (:mod:`~recsys.checkpoint.lineage`).

Example::

    from recsys.checkpoint import apply_deltas, load_model

    model = load_model("runs/dlrm/checkpoints/latest")
    tables = apply_deltas("runs/dlrm/checkpoints/step_00001000", "runs/dlrm")
"""

from recsys.checkpoint.deltas import (
    apply_deltas,
    checkpoint_base,
    delta_chain,
    list_deltas,
    read_delta,
)
from recsys.checkpoint.io import load_model

__all__ = [
    "apply_deltas",
    "checkpoint_base",
    "delta_chain",
    "list_deltas",
    "load_model",
    "read_delta",
]
