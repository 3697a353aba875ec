"""What a training step moves besides its plan, for the step cost model
(:func:`~recsys.distributed.step_cost.predict_step`): the batch, its ids per bag, the
optimizers' state, the precisions, the dense part and how the batch and the ranks' work were
timed."""

from __future__ import annotations

from dataclasses import dataclass, field

from recsys.distributed.id_profiles import IdProfile
from recsys.distributed.op_trace import OpTrace

__all__ = ["StepInputs", "dense_bytes"]


@dataclass(frozen=True)
class StepInputs:
    """What a step moves besides the plan.

    Attributes:
        batch_size: samples per rank per step (B).
        pooling_factors: feature -> mean ids per bag (default 1.0 for a feature not given).
        optimizer_states: the fused optimizer's ``states`` (name -> ``"row"`` / ``"element"``).
        forward_precision / backward_precision: how pooled vectors and their gradients travel.
        dense_parameters: the model's dense (DDP) parameters.
        dense_state_values: fp32 values a dense optimizer keeps per parameter (adam 2, sgd 0).
        pipeline: ``train.pipeline``: the next batch's input dist behind this forward.
        replicas: R; 1 = flat. The plan is then for W / R ranks.
        sync_every: 2D: steps between two replica syncs.
        extras: int64 values every rank adds to each destination's counts (the input check's
            verdict); the replicated tables' row counts and bitmaps are added from the plan.
        dense_precision: ``train.precision``, which dense rate of the topology applies.
        id_profiles: table name -> how often each of its rows is read
            (:class:`~recsys.distributed.id_profiles.IdProfile`; uniform for a table not given):
            the distinct rows a batch touches.
        fused_update: the tables are updated by a fused optimizer (``train.
            fused_embedding_update``): replicated tables exchange their touched rows'
            gradients, their row counts known from the input dist.
        dense_trace: the ops of the step's dense part, traced at ``batch_size``
            (:class:`~recsys.distributed.op_trace.OpTrace`); None: 6 flops per dense
            parameter per sample.
        input_s: seconds a rank's batch takes to make on a host of the launch with no other
            rank busy (its loader workers sharing it out; 0: not modelled).
        input_inline: the batches are made inside the step (else by loader workers or a
            prefetching thread, beside it).
        compute_s: seconds a step of the ranks takes less its collectives, making the batch
            included, timed on a host of the launch with no other rank busy and the peers
            mirrored, the slowest rank between each two collectives
            (:func:`~recsys.train.rank_timing.rank_step_seconds`; 0: not timed, the lookups,
            updates and dense part are modelled).
    """

    batch_size: int
    pooling_factors: dict[str, float] = field(default_factory=dict)
    optimizer_states: dict[str, str] = field(default_factory=dict)
    forward_precision: str = "fp32"
    backward_precision: str = "fp32"
    dense_parameters: int = 0
    dense_state_values: int = 2
    pipeline: bool = False
    replicas: int = 1
    sync_every: int = 1
    extras: int = 0
    dense_precision: str = "fp32"
    id_profiles: dict[str, IdProfile] = field(default_factory=dict)
    fused_update: bool = True
    dense_trace: OpTrace | None = None
    input_s: float = 0.0
    input_inline: bool = True
    compute_s: float = 0.0

    @property
    def dense_bytes(self) -> int:
        return dense_bytes(self.dense_parameters, self.dense_state_values)


def dense_bytes(parameters: int, state_values: int) -> int:
    """Each rank's bytes of the dense part: fp32 weights, gradients and optimizer state."""
    return parameters * 4 * (2 + state_values)
