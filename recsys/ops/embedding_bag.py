"""Multi-table pooled embedding lookup (embedding bag) over KeyedJaggedTensor-layout ids, with
an optional optimizer update fused into its backward.

Shapes: B batch, K keys in the KJT, F pooled features, T tables, L total ids, N_t rows and D_t
columns of table t. Feature f reads KJT key ``k = feature_to_key[f]`` and table
``t = feature_to_table[f]``; several features may share a table. For sample b, feature f:

    ids    = values[offsets[k*B + b] : offsets[k*B + b + 1]]       (a bag, possibly empty)
    out[b, cols(f)] = sum_i w_i * W_t[ids[i]]                       pooling "sum"
                    = (sum_i w_i * W_t[ids[i]]) / max(len(ids), 1)  pooling "mean"

where w_i are the per-sample weights (1 when absent) and cols(f) is feature f's slice of the
[B, sum_f D_t(f)] output, features in order. An empty bag gives zeros. Mean pooling with
weights divides by the bag length, not by the sum of weights (as FBGEMM does).

Dtypes: tables fp32 / fp16 / bf16 (accumulated and returned in fp32) or fp64 (returned in fp64);
ids and offsets int32 or int64.

Table-batched: the tables of one call live in one flat buffer (:class:`TableLayout`), tables of
equal dim next to each other, so one kernel launch serves all of them. Backward sorts the
batch's lookups by row (stable) and reduces each touched row's gradients in that fixed order:
the result is deterministic and duplicates are summed before any optimizer sees them. Then
either

- no optimizer: each table gets a dense gradient (any torch optimizer works), or
- a fused optimizer (:mod:`recsys.embedding.optim`): the touched rows and their optimizer
  state are updated in place inside backward; no gradient the size of a table is built.

Backends (chosen in ``recsys.ops._triton``): ``triton`` (CUDA; CPU under TRITON_INTERPRET=1)
runs ``recsys.ops.embedding_bag_triton``. ``fbgemm`` (CPU, fused SGD / Adagrad /
RowWiseAdagrad only) is FBGEMM's C++ fused backward, behind FBGEMM's forward for short bags
and the torch forward for long ones. ``torch`` runs anywhere: one ``F.embedding_bag`` per
feature over its table's view of the buffer; a backward that sorts the lookups per group of
equal-dim tables, reduces each row's gradients with ``F.embedding_bag`` over the upstream
gradient, then updates the touched rows with ``index_select`` / ``index_copy_``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from recsys.ops._triton import resolve_backend, triton_interpreted

POOLINGS = ("sum", "mean")


def embedding_bag_reference(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch specification of :func:`embedding_bag` (run in float64 by the tests)."""
    B = batch_size
    out_dtype = torch.promote_types(weights[0].dtype, torch.float32)
    pooled = []
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        bag_offsets = offsets[k * B : (k + 1) * B + 1].long()
        start, stop = int(bag_offsets[0]), int(bag_offsets[-1])
        lengths = bag_offsets.diff()  # [B]
        bag = torch.repeat_interleave(torch.arange(B, device=values.device), lengths)
        rows = weights[t][values[start:stop].long()].to(out_dtype)  # [L_f, D_t]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[start:stop].to(out_dtype).unsqueeze(1)
        sums = torch.zeros(B, rows.shape[1], dtype=out_dtype, device=values.device)
        sums = sums.index_add(0, bag, rows)  # [B, D_t]
        if table_pooling[t] == "mean":
            sums = sums / lengths.clamp(min=1).to(out_dtype).unsqueeze(1)
        pooled.append(sums)
    return torch.cat(pooled, dim=1)  # [B, sum D]


def validate_inputs(
    table_rows: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    feature_names: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError`` for inputs that would read out of bounds or be silently wrong.

    ``table_rows`` is each table's row count. One pass over ids and offsets (a device sync on
    CUDA). ``feature_names`` only improves the messages.
    """
    names = (
        list(feature_names)
        if feature_names is not None
        else [f"feature {f}" for f in range(len(feature_to_key))]
    )
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"ids must be a 1-D int32/int64 tensor, got {values.dtype} {tuple(values.shape)}"
        )
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets must be a 1-D int32/int64 tensor, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    num_keys = max(feature_to_key, default=-1) + 1
    if offsets.numel() < num_keys * batch_size + 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; {num_keys} keys x batch {batch_size} "
            f"need at least {num_keys * batch_size + 1}"
        )
    if int(offsets[0]) != 0:
        raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
    steps = offsets.diff()
    if steps.numel() and int(steps.min()) < 0:
        where = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"offsets must be non-decreasing (bag lengths >= 0), but offsets[{where}] = "
            f"{int(offsets[where])} > offsets[{where + 1}] = {int(offsets[where + 1])}"
        )
    if int(offsets[-1]) != values.numel():
        raise ValueError(f"offsets end at {int(offsets[-1])} but there are {values.numel()} ids")
    if per_sample_weights is not None:
        if not per_sample_weights.is_floating_point():
            raise ValueError(
                f"per-sample weights must be floating point, got {per_sample_weights.dtype}"
            )
        if per_sample_weights.shape != values.shape:
            raise ValueError(
                f"per-sample weights have shape {tuple(per_sample_weights.shape)}, "
                f"expected one weight per id: ({values.numel()},)"
            )
    for t, pooling in enumerate(table_pooling):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} of table {t}; expected one of {POOLINGS}")
    # One pass over the ids: each id is compared with the row count of the table its key
    # feeds (keys no feature reads are not checked).
    if batch_size > 0:  # the KJT may hold more keys than the features read
        num_keys = (offsets.numel() - 1) // batch_size
    key_rows = [torch.iinfo(torch.int64).max] * num_keys
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        key_rows[k] = table_rows[t]
    bounds = offsets[[k * batch_size for k in range(num_keys)] + [offsets.numel() - 1]]
    ids_per_key = bounds.diff().long()
    limit = torch.repeat_interleave(torch.tensor(key_rows, device=values.device), ids_per_key)
    out_of_range = (values < 0) | (values >= limit)
    if bool(out_of_range.any()):
        where = int(out_of_range.nonzero()[0])
        key = (
            int(torch.searchsorted(bounds, torch.tensor(where, dtype=bounds.dtype), right=True)) - 1
        )
        f = list(feature_to_key).index(key)
        num_rows = key_rows[key]
        raise ValueError(
            f"{names[f]}: id {int(values[where])} is out of range for its table with {num_rows} "
            f"rows (expected 0 <= id < {num_rows})"
        )


@dataclass(frozen=True)
class TableLayout:
    """Where each table lives in one flat buffer of all tables (and in the row space).

    Tables of equal dim are adjacent ("dim groups", in order of first appearance), so each
    group is one [rows, D] matrix. Table t's weight is
    ``buffer[elem_offsets[t] : elem_offsets[t] + rows[t] * dims[t]].view(rows[t], dims[t])``;
    its rows are ``row_offsets[t] ...`` in the row space that per-row state (RowWiseAdagrad)
    and the backward's sort use.
    """

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    elem_offsets: tuple[int, ...]
    row_offsets: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]  # table indices of each dim group, buffer order

    @classmethod
    def build(cls, rows: Sequence[int], dims: Sequence[int]) -> TableLayout:
        for t, (n, d) in enumerate(zip(rows, dims, strict=True)):
            if n < 1 or d < 1:
                raise ValueError(f"table {t} has shape ({n}, {d}); rows and dim must be >= 1")
        groups: dict[int, list[int]] = {}
        for t, d in enumerate(dims):
            groups.setdefault(d, []).append(t)
        elem_offsets, row_offsets = [0] * len(rows), [0] * len(rows)
        elem, row = 0, 0
        for tables in groups.values():
            for t in tables:
                elem_offsets[t], row_offsets[t] = elem, row
                elem += rows[t] * dims[t]
                row += rows[t]
        return cls(
            tuple(rows),
            tuple(dims),
            tuple(elem_offsets),
            tuple(row_offsets),
            tuple(tuple(ts) for ts in groups.values()),
        )

    @property
    def numel(self) -> int:
        return sum(n * d for n, d in zip(self.rows, self.dims, strict=True))

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def max_dim(self) -> int:
        return max(self.dims)

    def buffer_order(self) -> list[int]:
        return [t for tables in self.groups for t in tables]

    def table_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each table's [N_t, D_t] view into a flat buffer of ``numel`` elements."""
        return [
            buffer[e : e + n * d].view(n, d)
            for e, n, d in zip(self.elem_offsets, self.rows, self.dims, strict=True)
        ]

    def row_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each table's [N_t] view into a flat per-row buffer of ``total_rows`` elements."""
        return [buffer[r : r + n] for r, n in zip(self.row_offsets, self.rows, strict=True)]

    def group_view(self, buffer: torch.Tensor, group: int) -> torch.Tensor:
        """Dim group ``group`` of a flat buffer as one [rows, D] matrix."""
        tables = self.groups[group]
        start, dim = self.elem_offsets[tables[0]], self.dims[tables[0]]
        return buffer[start : start + sum(self.rows[t] for t in tables) * dim].view(-1, dim)

    def group_rows(self, buffer: torch.Tensor, group: int) -> torch.Tensor:
        """Dim group ``group`` of a flat per-row buffer."""
        tables = self.groups[group]
        start = self.row_offsets[tables[0]]
        return buffer[start : start + sum(self.rows[t] for t in tables)]

    def pack(self, tables: Sequence[torch.Tensor]) -> torch.Tensor:
        """One flat buffer holding a copy of ``tables`` (same order as ``rows``)."""
        return torch.cat([tables[t].detach().reshape(-1) for t in self.buffer_order()])


@dataclass
class FusedUpdate:
    """A fused optimizer and the state it updates in backward.

    ``optimizer`` is a :class:`recsys.embedding.optim.FusedOptimizer`; ``states`` maps each of
    its state names to a flat fp32 buffer (``numel`` elements for per-element state,
    ``total_rows`` for per-row state); ``step`` is an int64 scalar tensor counting the updates
    applied so far (backward increments it).
    """

    optimizer: Any
    states: dict[str, torch.Tensor]
    step: torch.Tensor


class LookupPlan:
    """What stays fixed between calls: the layout, which table each feature reads, pooling,
    and where each feature's columns start in the output. Device-side copies of this metadata
    are cached per (device, KJT key order)."""

    def __init__(
        self,
        layout: TableLayout,
        feature_to_table: Sequence[int],
        table_pooling: Sequence[str],
    ) -> None:
        for t, pooling in enumerate(table_pooling):
            if pooling not in POOLINGS:
                raise ValueError(f"pooling {pooling!r} of table {t}; expected one of {POOLINGS}")
        if len(table_pooling) != len(layout.rows):
            raise ValueError(
                f"{len(table_pooling)} poolings for {len(layout.rows)} tables; give one per table"
            )
        for f, t in enumerate(feature_to_table):
            if not 0 <= t < len(layout.rows):
                raise ValueError(f"feature {f} reads table {t}; there are {len(layout.rows)}")
        self.layout = layout
        self.feature_to_table = tuple(feature_to_table)
        self.table_mean = tuple(p == "mean" for p in table_pooling)
        dims = [layout.dims[t] for t in self.feature_to_table]
        self.feature_cols = tuple(sum(dims[:f]) for f in range(len(dims)))
        self.total_dim = sum(dims)
        # Features of each dim group, in output order, and their columns.
        group_of = {t: g for g, tables in enumerate(layout.groups) for t in tables}
        self.group_features = [
            [f for f, t in enumerate(self.feature_to_table) if group_of[t] == g]
            for g in range(len(layout.groups))
        ]
        # One group whose features are all the features: its [B*F, D] pooled rows already are
        # the [B, total_D] output, no column scatter needed.
        self.single_group = sum(1 for fs in self.group_features if fs) == 1
        self.any_mean = any(self.table_mean[t] for t in self.feature_to_table)
        self._meta: dict[tuple, dict[str, torch.Tensor]] = {}

    def meta(self, device: torch.device, feature_to_key: Sequence[int]) -> dict[str, torch.Tensor]:
        cache_key = (device, tuple(feature_to_key))
        if cache_key not in self._meta:
            layout = self.layout

            def tensor(data: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
                return torch.tensor(list(data), dtype=dtype, device=device)

            order = layout.buffer_order()
            meta = {
                "feat_key": tensor(feature_to_key),
                "feat_table": tensor(self.feature_to_table, torch.int32),
                "feat_col": tensor(self.feature_cols),
                "feat_mean": tensor(
                    [self.table_mean[t] for t in self.feature_to_table], torch.bool
                ),
                "table_dim": tensor(layout.dims, torch.int32),
                "table_offset": tensor(layout.elem_offsets),
                "table_row_offset": tensor(layout.row_offsets),
                "table_mean": tensor(self.table_mean, torch.int32),
                # first row of each table in buffer order, and that table's index
                "row_bounds": tensor([layout.row_offsets[t] for t in order]),
                "bound_table": tensor(order, torch.int32),
            }
            for g, features in enumerate(self.group_features):
                group_start = layout.row_offsets[layout.groups[g][0]]
                meta[f"group{g}_key"] = tensor([feature_to_key[f] for f in features])
                meta[f"group{g}_row"] = tensor(
                    [layout.row_offsets[self.feature_to_table[f]] - group_start for f in features]
                )
                meta[f"group{g}_mean"] = tensor(
                    [self.table_mean[self.feature_to_table[f]] for f in features], torch.bool
                )
                dim = layout.dims[layout.groups[g][0]]
                meta[f"group{g}_cols"] = tensor(
                    [self.feature_cols[f] + c for f in features for c in range(dim)]
                )
            self._meta[cache_key] = meta
        return self._meta[cache_key]


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Cast ``x`` to ``dtype``, rounding stochastically when it is fp16 / bf16: a value between
    two neighbours ``lo < hi`` of ``dtype`` becomes ``hi`` with probability
    ``(x - lo) / (hi - lo)``, so ``E[result] == x`` and updates far below the dtype's precision
    still count on average. The Triton kernel computes the same."""
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    mantissa_bits, min_exponent = (10, -14) if dtype == torch.float16 else (7, -126)
    x = x.float()
    magnitude = x.abs()
    exponent = ((magnitude.view(torch.int32) >> 23) & 0xFF) - 127
    ulp = torch.exp2((exponent.clamp(min=min_exponent) - mantissa_bits).float())
    units = magnitude / ulp  # exact: ulp is a power of two
    low = units.floor()
    noise = torch.rand(x.shape, generator=generator, device=x.device)
    rounded = (low + (noise < units - low).float()) * ulp
    return torch.where(x < 0, -rounded, rounded).to(dtype)  # representable: exact cast


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rounding_seed(step: int) -> int:
    """Seed of the stochastic rounding of update ``step``: a pure function of the step, so two
    runs (and a resumed run) round identically."""
    return (step * 2654435761 + 0x5EED) % (2**31 - 1)


# --------------------------------------------------------------------------- torch backend


def _group_lookups(
    plan: LookupPlan,
    meta: dict[str, torch.Tensor],
    group: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    scale_dtype: torch.dtype,
) -> dict[str, torch.Tensor | None]:
    """The lookups of one dim group with bags in sample-major order (bag b * F_g + f).

    Returns ids (group-local rows, int64), offsets [B*F_g + 1], bag of each lookup, and each
    lookup's scale (per-sample weight times 1/length for mean pooling; None when all are 1).
    """
    B, device = batch_size, values.device
    keys = meta[f"group{group}_key"]  # [F_g]
    num_features = keys.numel()
    bag_index = keys[:, None] * B + torch.arange(B, device=device)  # [F_g, B]
    starts = offsets[bag_index].long()
    lengths = offsets[bag_index + 1].long() - starts
    starts, lengths = starts.t().reshape(-1), lengths.t().reshape(-1)  # [B*F_g] sample-major
    bag_offsets = torch.zeros(B * num_features + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, dim=0, out=bag_offsets[1:])
    total = int(bag_offsets[-1])
    bag = torch.repeat_interleave(
        torch.arange(B * num_features, device=device), lengths, output_size=total
    )
    position = torch.arange(total, device=device) + (starts - bag_offsets[:-1])[bag]
    feature = bag % num_features if num_features > 1 else torch.zeros_like(bag)
    ids = values[position].long() + meta[f"group{group}_row"][feature]
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights[position].to(scale_dtype)
    means = meta[f"group{group}_mean"]
    if bool(plan.any_mean) and bool(means.any()):
        inverse = 1.0 / lengths.clamp(min=1).to(scale_dtype)
        inverse = torch.where(means[feature], inverse[bag], torch.ones((), dtype=scale_dtype))
        scale = inverse if scale is None else scale * inverse
    return {"ids": ids, "offsets": bag_offsets, "bag": bag, "scale": scale}


def _pool_torch(
    plan: LookupPlan,
    flat: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    feature_to_key: Sequence[int],
    batch_size: int,
) -> torch.Tensor:
    """One ``F.embedding_bag`` per feature over its table's view of the packed buffer, reading
    the feature's KJT slice in place (ATen's CPU kernel; measured faster than one call over
    the whole buffer, whose bags would first have to be reordered sample-major)."""
    B, out_dtype = batch_size, _accumulate_dtype(flat.dtype)
    tables = plan.layout.table_views(flat)
    num_keys = max(feature_to_key, default=-1) + 1
    bounds = offsets[[k * B for k in range(num_keys + 1)]].tolist()
    pooled = []
    for k, t in zip(feature_to_key, plan.feature_to_table, strict=True):
        start, stop = bounds[k], bounds[k + 1]
        bag_offsets = (offsets[k * B : (k + 1) * B + 1] - start).to(values.dtype)
        psw = None if per_sample_weights is None else per_sample_weights[start:stop]
        mean = plan.table_mean[t]
        ids, table = values[start:stop], tables[t]
        if table.dtype in (torch.float16, torch.bfloat16):
            # ATen pools in the table's dtype; gather the rows and pool them in fp32 instead.
            table = table[ids.long()].float()  # [L_f, D_t]
            ids = torch.arange(ids.numel(), device=ids.device, dtype=ids.dtype)
        out = F.embedding_bag(
            ids,
            table,
            bag_offsets,
            # ATen rejects per-sample weights with mean pooling: sum, then divide below.
            mode="mean" if mean and psw is None else "sum",
            per_sample_weights=None if psw is None else psw.to(table.dtype),
            include_last_offset=True,
        ).to(out_dtype)  # [B, D_t]
        if mean and psw is not None:
            out = out / bag_offsets.diff().clamp(min=1).to(out_dtype).unsqueeze(1)
        pooled.append(out)
    if not pooled:
        return torch.zeros(B, 0, dtype=out_dtype, device=flat.device)
    return torch.cat(pooled, dim=1)  # [B, total_D]


def _reduce_torch(
    plan: LookupPlan,
    meta: dict[str, torch.Tensor],
    group: int,
    lookups: dict,
    grad_out: torch.Tensor,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct group-local rows [U] and their reduced gradients [U, D]."""
    dim = plan.layout.dims[plan.layout.groups[group][0]]
    if plan.single_group:
        grad = grad_out.view(-1, dim)  # [B*F, D]
    else:
        grad = grad_out.index_select(1, meta[f"group{group}_cols"]).view(-1, dim)
    rows, order = torch.sort(lookups["ids"], stable=True)
    rows, counts = torch.unique_consecutive(rows, return_counts=True)
    segments = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, dim=0, out=segments[1:])
    scale = lookups["scale"]
    reduced = F.embedding_bag(
        lookups["bag"][order],
        grad,
        segments,
        mode="sum",
        per_sample_weights=None if scale is None else scale[order].to(grad.dtype),
        include_last_offset=True,
    )  # [U, D]
    return rows, reduced


def _update_rows_torch(
    fused: FusedUpdate,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    generator: torch.Generator,
) -> None:
    """Apply the fused optimizer to ``rows`` of a [N, D] ``weight`` and its ``states``."""
    compute = _accumulate_dtype(weight.dtype)
    current = weight.index_select(0, rows).to(compute)
    state_rows = {name: state.index_select(0, rows) for name, state in states.items()}
    updated = fused.optimizer.update(current, grad.to(compute), state_rows, step)
    weight.index_copy_(0, rows, stochastic_round(updated, weight.dtype, generator))
    for name, state in states.items():
        state.index_copy_(0, rows, state_rows[name])


# --------------------------------------------------------------------------- triton backend


def _segments_triton(
    plan: LookupPlan,
    meta: dict[str, torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    scale_dtype: torch.dtype,
) -> dict[str, torch.Tensor | None]:
    """Every lookup of the batch sorted by row (stable), cut into one segment per distinct
    row: segment starts, table, table-local row and global row key of each segment, and each
    sorted lookup's upstream-gradient offset and scale."""
    B, device = batch_size, values.device
    num_features = meta["feat_key"].numel()
    bag_index = meta["feat_key"][:, None] * B + torch.arange(B, device=device)  # [F, B]
    starts = offsets[bag_index].long().reshape(-1)  # feature-major bags
    lengths = offsets[bag_index + 1].long().reshape(-1) - starts
    ends = torch.cumsum(lengths, dim=0)
    total = int(ends[-1]) if ends.numel() else 0
    bag = torch.repeat_interleave(
        torch.arange(num_features * B, device=device), lengths, output_size=total
    )
    position = torch.arange(total, device=device) + (starts - (ends - lengths))[bag]
    feature, sample = bag // B, bag % B
    table = meta["feat_table"][feature].long()
    key = meta["table_row_offset"][table] + values[position].long()
    grad_off = sample * plan.total_dim + meta["feat_col"][feature]
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights[position].to(scale_dtype)
    if plan.any_mean:
        inverse = 1.0 / lengths.clamp(min=1).to(scale_dtype)
        inverse = torch.where(
            meta["feat_mean"][feature], inverse[bag], torch.ones((), dtype=scale_dtype)
        )
        scale = inverse if scale is None else scale * inverse
    key, order = torch.sort(key, stable=True)
    unique, counts = torch.unique_consecutive(key, return_counts=True)
    start = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, dim=0, out=start[1:])
    bound = torch.searchsorted(meta["row_bounds"], unique, right=True) - 1
    seg_table = meta["bound_table"][bound]
    return {
        "start": start,
        "table": seg_table,
        "row": unique - meta["table_row_offset"][seg_table.long()],
        "key": unique,
        "grad_off": grad_off[order],
        "scale": None if scale is None else scale[order],
    }


def _block_l(values: torch.Tensor, num_bags: int) -> int:
    """Ids loaded per step of the pooling loop: about the mean bag length, 1..32."""
    mean = values.numel() / max(num_bags, 1)
    block = 1
    while block < mean and block < 32:
        block *= 2
    return block


# --------------------------------------------------------------------------- fbgemm backend


def fbgemm_unsupported(plan: LookupPlan, flat: torch.Tensor, fused: FusedUpdate | None) -> str:
    """Why FBGEMM's CPU fused backward cannot serve this call ("" when it can).

    The ``fbgemm`` backend runs FBGEMM's CPU table-batched forward and hands the fused update
    to ``torch.ops.fbgemm.split_embedding_backward_codegen_{sgd,adagrad,rowwise_adagrad}_cpu``
    (fbgemm-gpu-cpu), which reduces duplicate rows and updates them in one C++ pass.
    """
    if flat.device.type != "cpu":
        return "it runs on CPU tensors only"
    if fused is None:
        return "it only fuses an optimizer (optimizer=None takes dense gradients)"
    name, decay = type(fused.optimizer).__name__, fused.optimizer.weight_decay
    if name not in ("SGD", "Adagrad", "RowWiseAdagrad"):
        return f"it has no CPU kernel for {name}"
    if decay:  # its L2 mode does not match the weight decay of recsys.embedding.optim
        return "weight decay runs on the torch path"
    if flat.dtype != torch.float32:
        return f"tables are {flat.dtype}; its CPU backward is fp32 here"
    if len(plan.layout.groups) > 1:
        return "tables of different dims (its row space must follow feature order)"
    if len(set(plan.table_mean)) > 1:
        return "it takes one pooling mode for all tables, these mix sum and mean"
    if _fbgemm_ops() is None:
        return "fbgemm_gpu does not import"
    return ""


def _fbgemm_ops():
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        return torch.ops.fbgemm
    except Exception:  # a missing or broken install means "not available"
        return None


def _fbgemm_meta(plan: LookupPlan) -> dict[str, Any]:
    if hasattr(plan, "fbgemm_meta"):
        return plan.fbgemm_meta
    layout, tables = plan.layout, plan.feature_to_table
    num_features = len(tables)
    dims = [layout.dims[t] for t in tables]
    meta = {
        "weights_offsets": torch.tensor([layout.elem_offsets[t] for t in tables]),
        "row_offsets": torch.tensor([layout.row_offsets[t] for t in tables]),
        "D_offsets": torch.tensor([0, *torch.tensor(dims).cumsum(0).tolist()], dtype=torch.int32),
        "max_D": max(dims),
        "hash_size_cumsum": torch.tensor(
            [*(layout.row_offsets[t] for t in tables), layout.total_rows]
        ),
        "total_hash_size_bits": max(1, math.ceil(math.log2(layout.total_rows + 1))),
        "placements": torch.full((num_features,), 3, dtype=torch.int32),  # HOST
        "pooling_mode": 1 if plan.table_mean[0] else 0,  # PoolingMode.MEAN / SUM
    }
    plan.fbgemm_meta = meta
    return meta


# Mean ids per bag below which FBGEMM's forward beats one ATen embedding_bag per feature
# (2-core EPYC, 26 x 1M x 64, batch 2048: 0.9 vs 1.6 ms at 1, 2.2 vs 3.2 at 2, 8.6 vs 5.8 at 4,
# 30 vs 14 at 20); the fused backward is FBGEMM's either way.
FBGEMM_FORWARD_MAX_BAG = 3


def _fbgemm_inputs(
    plan: LookupPlan,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    feature_to_key: Sequence[int],
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch as FBGEMM reads it: int64 ids and [F*B + 1] offsets, features in order."""
    B, num_features = batch_size, len(plan.feature_to_table)
    if tuple(feature_to_key) != tuple(range(num_features)):
        # Gather each feature's bags from its KJT key.
        keys = torch.tensor(feature_to_key)
        bag_index = (keys[:, None] * B + torch.arange(B)).reshape(-1)  # [F*B]
        starts = offsets[bag_index].long()
        lengths = offsets[bag_index + 1].long() - starts
        new_offsets = torch.zeros(num_features * B + 1, dtype=torch.int64)
        torch.cumsum(lengths, dim=0, out=new_offsets[1:])
        total = int(new_offsets[-1])
        bag = torch.repeat_interleave(torch.arange(num_features * B), lengths, output_size=total)
        position = torch.arange(total) + (starts - new_offsets[:-1])[bag]
        values, offsets = values[position], new_offsets
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights[position]
    else:
        offsets = offsets[: num_features * B + 1]
        values = values[: int(offsets[-1])]
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.float().contiguous()
    return values.long().contiguous(), offsets.long().contiguous(), per_sample_weights


def _pool_fbgemm(
    plan: LookupPlan, flat: torch.Tensor, inputs: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """FBGEMM's CPU forward (through its SGD lookup op, which builds no graph here: forward
    of an autograd.Function runs without grad, and the update only happens in its backward)."""
    meta = _fbgemm_meta(plan)
    values, offsets, indice_weights = inputs
    return _fbgemm_ops().split_embedding_codegen_lookup_sgd_function_cpu(
        flat,
        meta["placements"],
        meta["weights_offsets"],
        meta["D_offsets"],
        plan.total_dim,
        meta["max_D"],
        meta["hash_size_cumsum"],
        meta["total_hash_size_bits"],
        values,
        offsets,
        meta["pooling_mode"],
        indice_weights,
        None,  # feature_requires_grad
        False,  # gradient_clipping
        0.0,  # max_gradient
        False,  # stochastic_rounding
        0.0,  # learning_rate (unused: no backward through this call)
        0,  # output dtype FP32
    )


def _backward_fbgemm(ctx, grad_out: torch.Tensor, fused: FusedUpdate) -> None:
    plan = ctx.plan
    meta = _fbgemm_meta(plan)
    values, offsets, indice_weights = ctx.fbgemm_inputs
    optimizer = fused.optimizer
    name = type(optimizer).__name__
    common = (
        grad_out.float().contiguous(),
        ctx.flat,
        meta["placements"],
        meta["weights_offsets"],
        meta["D_offsets"],
        meta["max_D"],
        meta["hash_size_cumsum"],
        meta["total_hash_size_bits"],
        values,
        offsets,
        meta["pooling_mode"],
        torch.empty(0) if indice_weights is None else indice_weights,
        False,  # stochastic rounding: fp32 tables only
    )
    ops = _fbgemm_ops()
    if name == "SGD":
        ops.split_embedding_backward_codegen_sgd_cpu(*common, torch.tensor(optimizer.lr))
        return
    state = fused.states["sum"]
    state_offsets = meta["row_offsets"] if name == "RowWiseAdagrad" else meta["weights_offsets"]
    state_args = (state, meta["placements"], state_offsets, torch.tensor(optimizer.lr))
    if name == "Adagrad":
        ops.split_embedding_backward_codegen_adagrad_cpu(*common, *state_args, optimizer.eps)
    else:  # eps, weight_decay 0 (mode NONE), max_norm 0
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common, *state_args, optimizer.eps, 0.0, 0, 0.0
        )


# --------------------------------------------------------------------------- autograd


def _dense_grads(
    layout: TableLayout,
    keys: torch.Tensor,
    reduced: torch.Tensor,
    needs: Sequence[bool],
    dtype: torch.dtype,
) -> list[torch.Tensor | None]:
    """Dense per-table gradients from sorted distinct global row keys and their gradients."""
    bounds = torch.tensor(
        [[r, r + n] for r, n in zip(layout.row_offsets, layout.rows, strict=True)],
        device=keys.device,
    )
    cuts = torch.searchsorted(keys, bounds.reshape(-1)).view(-1, 2).tolist()
    grads: list[torch.Tensor | None] = []
    for t, (lo, hi) in enumerate(cuts):
        if not needs[t]:
            grads.append(None)
            continue
        n, d = layout.rows[t], layout.dims[t]
        grad = torch.zeros(n, d, dtype=dtype, device=keys.device)
        grad.index_copy_(0, keys[lo:hi] - layout.row_offsets[t], reduced[lo:hi, :d].to(dtype))
        grads.append(grad)
    return grads


class _TableBatchedEmbeddingBag(torch.autograd.Function):
    """Forward pools; backward reduces per row, then fused update or dense table gradients.

    ``handles`` are the autograd inputs: the tables' weights (views of ``flat``) when they get
    gradients, or one placeholder tensor that requires grad when the update is fused.
    """

    @staticmethod
    def forward(
        ctx,
        plan: LookupPlan,
        flat: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        feature_to_key: Sequence[int],
        batch_size: int,
        backend: str,
        fused: FusedUpdate | None,
        *handles: torch.Tensor,
    ) -> torch.Tensor:
        ctx.plan, ctx.flat, ctx.fused, ctx.backend = plan, flat, fused, backend
        ctx.feature_to_key, ctx.batch_size = feature_to_key, batch_size
        if backend == "triton":
            from recsys.ops import embedding_bag_triton

            out = torch.empty(
                batch_size, plan.total_dim, dtype=_accumulate_dtype(flat.dtype), device=flat.device
            )
            embedding_bag_triton.pool(
                values,
                offsets,
                per_sample_weights,
                flat,
                out,
                plan.meta(values.device, feature_to_key),
                batch_size,
                len(plan.feature_to_table),
                plan.layout.max_dim,
                _block_l(values, len(plan.feature_to_table) * batch_size),
            )
        elif backend == "fbgemm" and values.numel() < FBGEMM_FORWARD_MAX_BAG * max(
            len(plan.feature_to_table) * batch_size, 1
        ):
            ctx.fbgemm_inputs = _fbgemm_inputs(
                plan, values, offsets, per_sample_weights, feature_to_key, batch_size
            )
            out = _pool_fbgemm(plan, flat, ctx.fbgemm_inputs)
        else:
            out = _pool_torch(
                plan, flat, values, offsets, per_sample_weights, feature_to_key, batch_size
            )
            if backend == "fbgemm":
                ctx.fbgemm_inputs = _fbgemm_inputs(
                    plan, values, offsets, per_sample_weights, feature_to_key, batch_size
                )
        if backend != "fbgemm":
            psw = () if per_sample_weights is None else (per_sample_weights,)
            ctx.save_for_backward(values, offsets, *psw)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        nothing = [None] * len(ctx.needs_input_grad)
        needs = ctx.needs_input_grad[9:]
        fused: FusedUpdate | None = ctx.fused
        if fused is None and not any(needs):
            return tuple(nothing)
        plan, layout, flat = ctx.plan, ctx.plan.layout, ctx.flat
        grad_out = grad_out.contiguous()
        step = 0
        if fused is not None:
            fused.step += 1
            step = int(fused.step)
        meta = plan.meta(grad_out.device, ctx.feature_to_key)
        if ctx.backend == "fbgemm":
            _backward_fbgemm(ctx, grad_out, fused)
            return tuple(nothing)
        if ctx.backend == "triton":
            keys, reduced = _backward_triton(ctx, grad_out, meta, fused, step)
        else:
            keys, reduced = _backward_torch(ctx, grad_out, meta, fused, step)
        if fused is not None:
            return tuple(nothing)
        grads = _dense_grads(layout, keys, reduced, needs, flat.dtype)
        return (None,) * 9 + tuple(grads)


def _backward_torch(ctx, grad_out, meta, fused, step):
    plan, layout, flat = ctx.plan, ctx.plan.layout, ctx.flat
    generator = torch.Generator(device=flat.device).manual_seed(_rounding_seed(step))
    values, offsets, *psw = ctx.saved_tensors
    all_keys, all_reduced = [], []
    for g, features in enumerate(plan.group_features):
        if not features:
            continue
        lookups = _group_lookups(
            plan,
            meta,
            g,
            values,
            offsets,
            psw[0] if psw else None,
            ctx.batch_size,
            _accumulate_dtype(grad_out.dtype),
        )
        rows, reduced = _reduce_torch(plan, meta, g, lookups, grad_out, ctx.batch_size)
        if fused is None:
            group_start = layout.row_offsets[layout.groups[g][0]]
            all_keys.append(rows + group_start)
            all_reduced.append(reduced)
            continue
        states = {
            name: layout.group_rows(buffer, g)
            if fused.optimizer.states[name] == "row"
            else layout.group_view(buffer, g)
            for name, buffer in fused.states.items()
        }
        _update_rows_torch(
            fused, layout.group_view(flat, g), states, rows, reduced, step, generator
        )
    if fused is not None:
        return None, None
    # Groups are in row-space order, so the keys stay sorted; pad dims to the widest.
    width = layout.max_dim
    padded = [F.pad(r, (0, width - r.shape[1])) for r in all_reduced]
    return torch.cat(all_keys), torch.cat(padded)


def _backward_triton(ctx, grad_out, meta, fused, step):
    from recsys.ops import embedding_bag_triton

    plan, flat = ctx.plan, ctx.flat
    values, offsets, *psw = ctx.saved_tensors
    segments = _segments_triton(
        plan,
        meta,
        values,
        offsets,
        psw[0] if psw else None,
        ctx.batch_size,
        _accumulate_dtype(grad_out.dtype),
    )
    num_lookups = segments["grad_off"].numel()
    block_l = _block_l(segments["grad_off"], segments["key"].numel()) if num_lookups else 1
    if fused is None:
        reduced = embedding_bag_triton.reduce_segments(
            segments, grad_out, meta, plan.layout.max_dim, block_l=block_l
        )
        return segments["key"], reduced
    names = list(fused.optimizer.states)
    embedding_bag_triton.reduce_segments(
        segments,
        grad_out,
        meta,
        plan.layout.max_dim,
        weights=flat,
        states=tuple(fused.states[name] for name in names),
        optimizer_code=fused.optimizer.code,
        scalars=fused.optimizer.scalars(step),
        seed=_rounding_seed(step),
        block_l=block_l,
    )
    return None, None


def choose_backend(
    backend: str, plan: LookupPlan, flat: torch.Tensor, fused: FusedUpdate | None
) -> str:
    """The backend that serves a call: ``"triton"``, ``"fbgemm"`` or ``"torch"`` (the rules
    are in ``recsys.ops._triton``). Raises ``ValueError`` for one that cannot run it."""
    backend = resolve_backend(
        backend,
        flat.device,
        op="embedding_bag",
        has_triton=True,
        cpu_paths={"fbgemm": fbgemm_unsupported(plan, flat, fused)},
    )
    if backend == "triton" and not triton_interpreted() and flat.device.type != "cuda":
        raise ValueError("backend='triton' needs the tables on a CUDA device")
    return backend


def table_batched_embedding_bag(
    plan: LookupPlan,
    flat: torch.Tensor,
    handles: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    *,
    fused: FusedUpdate | None = None,
    backend: str = "auto",
    validate: bool = True,
    feature_names: Sequence[str] | None = None,
) -> torch.Tensor:
    """Pooled lookup of every feature over tables packed in ``flat`` (see :class:`TableLayout`).

    Args:
        plan: layout, feature -> table map and poolings (:class:`LookupPlan`).
        flat: the packed tables, one dtype.
        handles: the autograd inputs. Without ``fused``: each table's weight (views of
            ``flat``), which receive dense gradients. With ``fused``: one tensor that requires
            grad, so backward runs and applies the update.
        values, offsets: KJT ids and offsets ([K*B + 1]).
        feature_to_key: for each feature, the KJT key it reads.
        batch_size: B.
        per_sample_weights: optional [L] weight of each id.
        fused: apply this optimizer inside backward instead of returning gradients.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``recsys.ops._triton``).
        validate: check ids, offsets and weights first (one pass).
        feature_names: names used in validation errors.

    Returns:
        [B, total_D] pooled embeddings; fp32 (fp64 for fp64 tables).
    """
    if validate:
        validate_inputs(
            plan.layout.rows,
            values,
            offsets,
            feature_to_key,
            plan.feature_to_table,
            ["mean" if m else "sum" for m in plan.table_mean],
            batch_size,
            per_sample_weights,
            feature_names,
        )
    backend = choose_backend(backend, plan, flat, fused)
    return _TableBatchedEmbeddingBag.apply(
        plan,
        flat,
        values,
        offsets,
        per_sample_weights,
        tuple(feature_to_key),
        batch_size,
        backend,
        fused,
        *handles,
    )


def embedding_bag(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    validate: bool = True,
    feature_names: Sequence[str] | None = None,
) -> torch.Tensor:
    """Pooled lookup of F features over T separate tables in one call.

    The functional form: it packs the tables into one buffer on every call (a copy), and
    gradients flow back to ``weights`` as dense tensors. ``recsys.EmbeddingBagCollection``
    keeps its tables packed and can fuse the optimizer; use it for training.

    Args:
        weights: T tables, table t of shape [N_t, D_t], one dtype.
        values: [L] ids in KeyedJaggedTensor layout (key-major).
        offsets: [K*B + 1] KJT offsets: bag b of key k is values[offsets[k*B+b]:offsets[k*B+b+1]].
        feature_to_key: for each output feature, the KJT key it reads.
        feature_to_table: for each output feature, the table it looks up.
        table_pooling: per table, ``"sum"`` or ``"mean"``.
        batch_size: B.
        per_sample_weights: optional [L] weight of each id.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``recsys.ops._triton``).
        validate: check ids, offsets and weights first (one pass; turn off for speed once the
            input pipeline is trusted).
        feature_names: names used in validation errors.

    Returns:
        [B, sum_f D_t(f)] pooled embeddings, features in order; fp32 (fp64 for fp64 tables).

    Example::

        W = [torch.randn(10, 4)]
        ids, offsets = torch.tensor([1, 2, 7]), torch.tensor([0, 2, 3])
        embedding_bag(W, ids, offsets, [0], [0], ["sum"], batch_size=2)  # [2, 4]
    """
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise ValueError(f"all tables must share one dtype, got {sorted(map(str, dtypes))}")
    if any(w.dim() != 2 for w in weights):
        raise ValueError(f"tables must be 2-D, got shapes {[tuple(w.shape) for w in weights]}")
    layout = TableLayout.build([w.shape[0] for w in weights], [w.shape[1] for w in weights])
    plan = LookupPlan(layout, feature_to_table, table_pooling)
    return table_batched_embedding_bag(
        plan,
        layout.pack(weights),
        weights,
        values,
        offsets,
        feature_to_key,
        batch_size,
        per_sample_weights,
        backend=backend,
        validate=validate,
        feature_names=feature_names,
    )
