"""Multi-table unpooled embedding lookup (one vector per id) over the embedding bag's packed
tables, kernels and fused optimizers.

Shapes: B batch, K keys in the KJT, F features, T tables, G dim groups (tables of equal dim,
:class:`~recsys.ops.embedding_bag.pooled.TableLayout`), n_f the ids feature f reads (all ids of its
KJT key), D_t columns of table t. Feature f reads key ``k = feature_to_key[f]`` and table
``t = feature_to_table[f]``:

    out_f = W_t[values[start_k : start_k + n_f]]          [n_f, D_t], ids in input order

Computed as a pooled lookup in which every bag holds exactly one id, so the embedding bag's
forward, its deterministic backward (duplicates reduced in a fixed order) and its fused
optimizers apply unchanged (:func:`recsys.ops.embedding_bag.pooled.table_batched_embedding_bag`):

- each dim group is one table of the pooled call (its tables are one ``[rows, D]`` matrix of the
  same buffer, rows and optimizer state at the same places) and one key of a virtual KJT, whose
  ids are the group's features' ids, each shifted by its table's first row in the group;
- the virtual batch size is B' = max_g(ids of group g) (at least 1): group g's bag b holds its
  b-th id, the bags past its ids are empty. One dim group (the usual case) pads nothing: the
  pooled [B', D] output is the [sum_f n_f, D] rows themselves; with several groups of unequal
  id counts, the empty bags cost a zero row each in the output and its gradient;
- no per-id weights, sum pooling: a one-id bag's sum is the row, with no scaling.

The ids are checked against their own tables (not the group) before they are shifted.
Everything sized on the host comes from ``ids_per_key`` (the KJT's ``length_per_key()``), so
nothing waits on the device. Dtypes as the embedding bag: rows in fp32 for fp32 / fp16 / bf16
tables; deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsys.ops.embedding_bag.pooled import (
    FusedUpdate,
    LookupPlan,
    TableLayout,
    check_on_device,
    table_batched_embedding_bag,
    validate_inputs,
)
from recsys.ops.input_checks import check_mode

__all__ = ["LookupGroups", "embedding_lookup_reference", "table_batched_embedding_lookup"]


def embedding_lookup_reference(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    ids_per_key: Sequence[int],
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
) -> list[torch.Tensor]:
    """Plain-PyTorch specification of :func:`table_batched_embedding_lookup`: each feature's
    [n_f, D_t] rows (in fp32, or fp64 for fp64 tables)."""
    starts = [sum(ids_per_key[:k]) for k in range(len(ids_per_key) + 1)]
    out_dtype = torch.promote_types(weights[0].dtype, torch.float32)
    return [
        weights[t][values[starts[k] : starts[k + 1]].long()].to(out_dtype)
        for k, t in zip(feature_to_key, feature_to_table, strict=True)
    ]


class LookupGroups:
    """What stays fixed between calls: the tables' layout, which table each feature reads, and
    the pooled plan over the dim groups (one table and one virtual key per group)."""

    def __init__(self, layout: TableLayout, feature_to_table: Sequence[int]) -> None:
        self.layout = layout
        self.feature_to_table = tuple(feature_to_table)
        group_of = {t: g for g, tables in enumerate(layout.groups) for t in tables}
        self.group_features = [
            [f for f, t in enumerate(self.feature_to_table) if group_of[t] == g]
            for g in range(len(layout.groups))
        ]
        # A feature's ids become rows of its group: shifted by its table's first row there.
        self.shift = [
            layout.row_offsets[t] - layout.row_offsets[layout.groups[group_of[t]][0]]
            for t in self.feature_to_table
        ]
        self.dims = [layout.dims[tables[0]] for tables in layout.groups]
        # The same buffer with each dim group as one table: same elements, same row space.
        self.group_layout = TableLayout.build(
            [sum(layout.rows[t] for t in tables) for tables in layout.groups], self.dims
        )
        num_groups = len(layout.groups)
        self.pooled = LookupPlan(self.group_layout, range(num_groups), ["sum"] * num_groups)
        # The per-table plan the id checks read (each id against its own table).
        self.checks = LookupPlan(layout, self.feature_to_table, ["sum"] * len(layout.rows))
        self._steps: dict[torch.device, torch.Tensor] = {}

    def steps(self, count: int, device: torch.device) -> torch.Tensor:
        """``arange(count)`` on ``device``: a view of one cached range, grown (doubled) when a
        batch needs more, so a step computes none."""
        cached = self._steps.get(device)
        if cached is None or cached.numel() < count:
            size = max(count, 2 * (0 if cached is None else cached.numel()), 1024)
            cached = self._steps[device] = torch.arange(size, device=device)
        return cached[:count]

    def group_weights(
        self, flat: torch.Tensor, tables: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each group's [rows, D] weight, for a lookup whose tables (``tables``: the views of
        ``flat``, in config order) take dense gradients: a table that is its group is passed
        as it is; a group of several tables is a view of ``flat`` whose gradient backward
        splits into its tables' (no copy either way)."""
        if all(len(tables_g) == 1 for tables_g in self.layout.groups):
            return [tables[tables_g[0]] for tables_g in self.layout.groups]
        return list(_GroupViews.apply(self.layout, self.group_layout, flat, *tables))


class _GroupViews(torch.autograd.Function):
    """The packed tables' dim groups as [rows, D] tensors (views of the buffer the tables view);
    backward hands each table its rows of its group's gradient."""

    @staticmethod
    def forward(
        ctx,
        layout: TableLayout,
        group_layout: TableLayout,
        flat: torch.Tensor,
        *tables: torch.Tensor,
    ):
        ctx.layout = layout
        return tuple(group_layout.table_views(flat))

    @staticmethod
    def backward(ctx, *group_grads: torch.Tensor):
        layout: TableLayout = ctx.layout
        grads = []
        for t in range(len(layout.rows)):
            g = next(i for i, tables in enumerate(layout.groups) if t in tables)
            first = layout.row_offsets[layout.groups[g][0]]
            start = layout.row_offsets[t] - first
            grad = group_grads[g]
            grads.append(None if grad is None else grad[start : start + layout.rows[t]])
        return None, None, None, *grads


def table_batched_embedding_lookup(
    groups: LookupGroups,
    flat: torch.Tensor,
    handles: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    batch_size: int,
    ids_per_key: Sequence[int],
    *,
    fused: FusedUpdate | None = None,
    backend: str = "auto",
    validate: bool | str = True,
    feature_names: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """Unpooled lookup of every feature over tables packed in ``flat``.

    Args:
        groups: layout, feature -> table map and the pooled plan (:class:`LookupGroups`).
        flat: the packed tables, one dtype.
        handles: the autograd inputs. Without ``fused``: each dim group's weight
            (:meth:`LookupGroups.group_weights`), which receive dense gradients. With
            ``fused``: one tensor that requires grad, so backward runs and applies the update.
        values, offsets: KJT ids and offsets ([K*B + 1]).
        feature_to_key: for each feature, the KJT key it reads.
        batch_size: B.
        ids_per_key: [K] the number of ids of each KJT key, on the host.
        fused: apply this optimizer inside backward instead of returning gradients.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``recsys.ops._triton``).
        validate: as :func:`~recsys.ops.embedding_bag.pooled.table_batched_embedding_bag`'s.
        feature_names: names used in validation errors.

    Returns:
        Per feature, its [n_f, D_t] rows in input order (views of one output tensor); fp32
        (fp64 for fp64 tables).
    """
    mode, keep = check_mode(validate), None
    if mode == "sync":
        validate_inputs(
            groups.layout.rows,
            values,
            offsets,
            feature_to_key,
            groups.feature_to_table,
            ["sum"] * len(groups.layout.rows),
            batch_size,
            feature_names=feature_names,
        )
    elif mode == "async":
        checked = check_on_device(
            groups.checks, values, offsets, feature_to_key, batch_size, None, feature_names
        )
        values, keep = checked.values, checked.ok
    starts = [0]
    for n in ids_per_key:
        starts.append(starts[-1] + n)
    group_ids, pieces = [], []
    for features in groups.group_features:
        group_ids.append(sum(ids_per_key[feature_to_key[f]] for f in features))
        for f in features:
            k = feature_to_key[f]
            ids = values[starts[k] : starts[k + 1]]
            pieces.append(ids + groups.shift[f] if groups.shift[f] else ids)
    bags = max(max(group_ids), 1)  # B'
    read = [feature_to_key[f] for features in groups.group_features for f in features]
    if len(pieces) == 1:
        group_values = pieces[0]  # a view of the KJT's ids unless shifted
    elif read == list(range(len(ids_per_key))) and not any(groups.shift):
        group_values = values  # the KJT's keys are the features in group order
    else:
        group_values = torch.cat(pieces)
    group_offsets = _group_offsets(group_ids, bags, groups.steps(bags + 1, values.device))
    rows = table_batched_embedding_bag(
        groups.pooled,
        flat,
        handles,
        group_values,
        group_offsets,
        range(len(group_ids)),
        bags,
        fused=fused,
        backend=backend,
        validate="off",
        keep=keep,
        key_lengths=group_ids,  # known on the host: no read of the device for the count
    )  # [B', sum_g D_g]
    # Split (not sliced): backward then joins the features' gradients with one concatenation,
    # where a slice per feature would zero-fill a whole [B', sum_g D_g] gradient each.
    per_group = rows.split(groups.dims, dim=1) if len(groups.dims) > 1 else (rows,)
    out: list[torch.Tensor | None] = [None] * len(feature_to_key)
    for g, features in enumerate(groups.group_features):
        sizes = [ids_per_key[feature_to_key[f]] for f in features]
        padding = [bags - group_ids[g]] if bags > group_ids[g] else []
        if len(sizes) == 1 and not padding:
            out[features[0]] = per_group[g]  # its rows are the whole output: no split to undo
            continue
        for f, part in zip(features, per_group[g].split(sizes + padding), strict=False):
            out[f] = part
    return out


def _group_offsets(group_ids: Sequence[int], bags: int, steps: torch.Tensor) -> torch.Tensor:
    """Offsets [G*B' + 1] of the virtual KJT: group g's bag b holds its id b (past its ids,
    nothing). ``steps``: 0 .. B'."""
    if len(group_ids) == 1 and group_ids[0] == bags:
        return steps
    parts, base = [], 0
    for n in group_ids:
        parts.append(steps[:bags].clamp(max=n) + base)
        base += n
    parts.append(torch.full((1,), base, dtype=steps.dtype, device=steps.device))
    return torch.cat(parts)
