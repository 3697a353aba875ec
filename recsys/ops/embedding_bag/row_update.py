"""Apply a fused sparse optimizer to some rows of a table, in place, in plain PyTorch.

For rows ``r`` [U] of a [N, D] ``weight`` and their reduced gradients ``g`` [U, D]:

    w = weight[r] in the compute dtype (fp32; fp64 for fp64 tables)
    w' = optimizer.update(w, g, state[r], step)        (state rows updated in place)
    weight[r] = round(w') to the table's dtype: stochastic for fp16 / bf16 when the optimizer's
                ``stochastic_rounding`` is on (noise from ``generator``), else nearest
    state[r] = the updated state rows

Rows must be distinct (duplicates are reduced beforehand); the result is deterministic given
the generator's state. The torch backend of :mod:`recsys.ops.embedding_bag.pooled` calls this for
each chunk of touched rows; replicated tables of a sharded collection call it for their rows too, so
both apply the same update.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from recsys.ops._triton import accumulate_dtype
from recsys.ops.embedding_bag.layout import (
    FusedUpdate,
    RowOptimizer,
    TableLayout,
    rounding_seed,
    stochastic_round,
)

__all__ = ["update_keyed_rows", "update_rows"]


@torch.no_grad()
def update_rows(
    optimizer: RowOptimizer,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    generator: torch.Generator | None = None,
    keep: torch.Tensor | None = None,
) -> None:
    """Update ``rows`` of ``weight`` and of each optimizer state in ``states``, in place.

    Args:
        optimizer: a :class:`~recsys.ops.embedding_bag.layout.RowOptimizer` (any optimizer of
            :mod:`recsys.embedding.optim`).
        weight: [N, D] table (fp32 / fp16 / bf16 / fp64).
        states: the optimizer's state name -> [N] (per-row) or [N, D] (per-element) fp32
            tensor.
        rows: [U] int64 distinct row indices into ``weight`` and ``states``.
        grad: [U, D] gradient of each of ``rows`` (cast to the compute dtype).
        step: the step being applied (1 for the first).
        generator: noise of the stochastic rounding (seed it with
            :func:`recsys.ops.embedding_bag.layout.rounding_seed` of ``step`` for runs that
            repeat exactly); unused unless the table is fp16 / bf16 and
            ``optimizer.stochastic_rounding``.
        keep: a device bool; where False, rows and states keep their values (an update
            withheld without a host sync).

    Example::

        generator = torch.Generator().manual_seed(rounding_seed(step))
        update_rows(RowWiseAdagrad(lr=0.1), weight, {"sum": row_sums}, rows, grad, step, generator)
    """
    compute = accumulate_dtype(weight.dtype)
    current = weight.index_select(0, rows).to(compute)  # [U, D]
    state_rows = {name: state.index_select(0, rows) for name, state in states.items()}
    updated = optimizer.update(current, grad.to(compute), state_rows, step)
    if optimizer.stochastic_rounding:
        updated = stochastic_round(updated, weight.dtype, generator)
    updated = updated.to(weight.dtype)
    if keep is not None:
        updated = torch.where(keep, updated, weight.index_select(0, rows))
        for name, state in states.items():
            state_rows[name] = torch.where(keep, state_rows[name], state.index_select(0, rows))
    weight.index_copy_(0, rows, updated)
    for name, state in states.items():
        state.index_copy_(0, rows, state_rows[name])


@torch.no_grad()
def update_keyed_rows(
    layout: TableLayout,
    flat: torch.Tensor,
    fused: FusedUpdate,
    keys: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    chunk_bytes: int = 1 << 20,
    group_rows: Sequence[int] | None = None,
) -> None:
    """Apply ``fused`` to rows ``keys`` of the tables packed in ``flat``: :func:`update_rows`
    per dim group (usually one for all tables), not per table, on chunks of rows whose
    gradients take at most ``chunk_bytes`` (cache-sized temporaries; the result is the same).

    Args:
        layout, flat: the packed tables (:class:`TableLayout`).
        fused: the optimizer, its flat state buffers and ``keep``.
        keys: [U] sorted distinct rows in the layout's row space.
        grad: [U, >= max_dim] their gradients (a group reads its first D columns).
        step: the step being applied; the stochastic rounding's noise is seeded with
            :func:`rounding_seed` of it.
        group_rows: how many of ``keys`` each dim group has, when the host knows it.
    """
    generator = torch.Generator(device=flat.device).manual_seed(rounding_seed(step))
    starts = [layout.row_offsets[tables[0]] for tables in layout.groups]
    if len(starts) == 1:
        cuts = [0, keys.numel()]
    elif group_rows is not None:
        cuts = [0, *itertools.accumulate(group_rows)]
    else:  # keys are sorted and groups follow each other in the row space (a host read)
        bounds = torch.tensor(starts[1:], dtype=keys.dtype, device=keys.device)
        cuts = [0, *torch.searchsorted(keys, bounds).tolist(), keys.numel()]
    for g, tables in enumerate(layout.groups):
        lo, hi, dim = cuts[g], cuts[g + 1], layout.dims[tables[0]]
        states = {
            name: layout.group_rows(buffer, g)
            if fused.optimizer.states[name] == "row"
            else layout.group_view(buffer, g)
            for name, buffer in fused.states.items()
        }
        weight = layout.group_view(flat, g)
        chunk = max(1, chunk_bytes // (dim * grad.element_size()))
        for first in range(lo, hi, chunk):
            last = min(hi, first + chunk)
            rows, rows_grad = keys[first:last] - starts[g], grad[first:last, :dim]
            update_rows(
                fused.optimizer, weight, states, rows, rows_grad, step, generator, fused.keep
            )
