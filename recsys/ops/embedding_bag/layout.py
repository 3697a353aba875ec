"""Data layout of the table-batched embedding bag: the packed buffer (:class:`TableLayout`),
what stays fixed between calls (:class:`LookupPlan`, on a device :class:`PlanTensors`), the
fused optimizer the backends apply (:class:`RowOptimizer`) and its state (:class:`FusedUpdate`),
the batch's lookups (:class:`BagLookups`), and the rounding shared by every backend."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

POOLINGS = ("sum", "mean")

# The fused optimizers the Triton backward applies, by code (its OPT constexpr); each optimizer
# of recsys.embedding.optim carries its code.
SGD_CODE, ADAGRAD_CODE, ROWWISE_ADAGRAD_CODE, ADAM_CODE = 0, 1, 2, 3


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


@runtime_checkable
class RowOptimizer(Protocol):
    """What the embedding bag's backends read of a fused optimizer (the optimizers of
    :mod:`recsys.embedding.optim` are the implementations): the hyperparameters, the state
    layout, the Triton code and the reference update of touched rows."""

    lr: float
    weight_decay: float
    stochastic_rounding: bool
    """fp16 / bf16 tables: round updated weights stochastically (else to nearest)."""
    code: ClassVar[int]
    """Which update the Triton backward applies (``SGD_CODE`` ... ``ADAM_CODE``)."""
    states: ClassVar[dict[str, str]]
    """State name -> ``"row"`` (one fp32 per row) or ``"element"`` (one per weight element)."""

    def scalars(self, step: int) -> dict[str, float]:
        """Every hyperparameter the kernels take, for the step being applied (1 for the
        first): lr, eps, beta1, beta2, weight_decay, bias_correction1, bias_correction2."""
        ...

    def update(
        self, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        """Reference update of touched rows: [U, D] ``weight`` rows (compute dtype) and their
        reduced ``grad`` -> the updated rows; ``state`` rows updated in place."""
        ...


@dataclass
class FusedUpdate:
    """A fused optimizer and the state it updates in backward.

    ``optimizer`` is a :class:`RowOptimizer` (a :class:`recsys.embedding.optim.FusedOptimizer`);
    ``states`` maps each of its state names to a flat fp32 buffer (``numel`` elements for
    per-element state, ``total_rows`` for per-row state); ``step`` is an int64 scalar tensor
    counting the updates applied so far (backward increments it: :meth:`advance`). ``keep``: a
    device bool, False when the batch failed its ``"async"`` input check; the backends then
    leave every row and state as it was (the update is withheld without a host sync).
    ``exchange``: for tables every rank holds (replicated), maps this rank's touched rows (sorted
    distinct row keys [U] and their reduced gradients [U, max_dim]) to the rows and gradients
    to apply on every rank (e.g. all ranks' rows, summed and averaged); the backward then
    applies the update to those rows
    (:func:`recsys.ops.embedding_bag.row_update.update_keyed_rows`). ``distinct_rows``: with
    ``exchange``, per dim group the distinct rows this batch touches, when the host knows them (the
    torch backend then reads nothing on the host); ``exchanged_rows``: per dim group, the rows
    ``exchange`` returns, when the host knows them.
    """

    optimizer: RowOptimizer
    states: dict[str, torch.Tensor]
    step: torch.Tensor
    keep: torch.Tensor | None = None
    exchange: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = (
        None
    )
    distinct_rows: tuple[int, ...] | None = None
    exchanged_rows: tuple[int, ...] | None = None

    def advance(self) -> int:
        """``step += 1``; the new value, known on the host without reading the tensor (read
        once after the counter changed elsewhere: a checkpoint load, a reset)."""
        counter = self.step
        ref, version, value = _HOST_STEPS.get(id(counter), (None, -1, 0))
        if ref is None or ref() is not counter or version != counter._version:
            value = int(counter)  # new, or changed outside advance(): read it once
        counter += 1
        _HOST_STEPS[id(counter)] = (weakref.ref(counter), counter._version, value + 1)
        return value + 1


# id of a step counter -> (a reference to it, its tensor version when last advanced, its
# value then)
_HOST_STEPS: dict[int, tuple[weakref.ref, int, int]] = {}


@dataclass(frozen=True)
class GroupTensors:
    """One dim group's features (output order) as device tensors; F_g features of dim D."""

    key: torch.Tensor  # [F_g] int64: the KJT key each feature reads
    row: torch.Tensor  # [F_g] int64: its table's first row, relative to the group's first row
    mean: torch.Tensor  # [F_g] bool: its table is mean-pooled
    cols: torch.Tensor  # [F_g * D] int64: its output columns, feature after feature


@dataclass(frozen=True)
class PlanTensors:
    """A :class:`LookupPlan` for one KJT key order, as the tensors the kernels and the
    backward's index arithmetic read (all on one device)."""

    feat_key: torch.Tensor  # [F] int64: the KJT key each feature reads
    feat_table: torch.Tensor  # [F] int32: the table it looks up
    feat_col: torch.Tensor  # [F] int64: its first output column
    feat_mean: torch.Tensor  # [F] bool: its table is mean-pooled
    table_dim: torch.Tensor  # [T] int32
    table_offset: torch.Tensor  # [T] int64: first element of each table in the flat buffer
    table_row_offset: torch.Tensor  # [T] int64: first row of each table in the row space
    table_mean: torch.Tensor  # [T] int32: 1 where mean-pooled
    row_bounds: torch.Tensor  # [T] int64: first row of each table, in buffer order
    bound_table: torch.Tensor  # [T] int32: the table of each entry of row_bounds
    groups: tuple[GroupTensors, ...]  # one per dim group of the layout


class LookupPlan:
    """What stays fixed between calls: the layout, which table each feature reads, pooling,
    and where each feature's columns start in the output. Its :class:`PlanTensors` are cached
    per (device, KJT key order)."""

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
        self.group_any_mean = [
            any(self.table_mean[self.feature_to_table[f]] for f in features)
            for features in self.group_features
        ]
        self._tensors: dict[tuple, PlanTensors] = {}
        # What a backend derives once per plan (e.g. FBGEMM's offsets), by backend name.
        self.backend_meta: dict[str, Any] = {}

    def tensors(self, device: torch.device, feature_to_key: Sequence[int]) -> PlanTensors:
        """This plan as device tensors, for a KJT whose feature f is key ``feature_to_key[f]``
        (built on first use, then cached)."""
        cache_key = (device, tuple(feature_to_key))
        if cache_key not in self._tensors:
            self._tensors[cache_key] = self._build_tensors(device, feature_to_key)
        return self._tensors[cache_key]

    def _build_tensors(self, device: torch.device, feature_to_key: Sequence[int]) -> PlanTensors:
        layout, order = self.layout, self.layout.buffer_order()

        def tensor(data: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(list(data), dtype=dtype, device=device)

        return PlanTensors(
            feat_key=tensor(feature_to_key),
            feat_table=tensor(self.feature_to_table, torch.int32),
            feat_col=tensor(self.feature_cols),
            feat_mean=tensor([self.table_mean[t] for t in self.feature_to_table], torch.bool),
            table_dim=tensor(layout.dims, torch.int32),
            table_offset=tensor(layout.elem_offsets),
            table_row_offset=tensor(layout.row_offsets),
            table_mean=tensor(self.table_mean, torch.int32),
            row_bounds=tensor([layout.row_offsets[t] for t in order]),
            bound_table=tensor(order, torch.int32),
            groups=tuple(
                self._group_tensors(g, feature_to_key, tensor)
                for g in range(len(self.group_features))
            ),
        )

    def _group_tensors(
        self,
        group: int,
        feature_to_key: Sequence[int],
        tensor: Callable[..., torch.Tensor],
    ) -> GroupTensors:
        layout, features = self.layout, self.group_features[group]
        group_start = layout.row_offsets[layout.groups[group][0]]
        dim = layout.dims[layout.groups[group][0]]
        return GroupTensors(
            key=tensor([feature_to_key[f] for f in features]),
            row=tensor(
                [layout.row_offsets[self.feature_to_table[f]] - group_start for f in features]
            ),
            mean=tensor([self.table_mean[self.feature_to_table[f]] for f in features], torch.bool),
            cols=tensor([self.feature_cols[f] + c for f in features for c in range(dim)]),
        )


@dataclass(frozen=True)
class BagLookups:
    """Every lookup of some features' bags, bags in a chosen order (see :func:`bag_lookups`);
    X bags, L lookups."""

    lengths: torch.Tensor  # [X] int64: each bag's length
    offsets: torch.Tensor  # [X + 1] int64: where each bag starts among the L lookups
    bag: torch.Tensor  # [L] int64: each lookup's bag
    position: torch.Tensor  # [L] int64: each lookup's index into the KJT values


def bag_lookups(
    offsets: torch.Tensor,
    keys: torch.Tensor,
    batch_size: int,
    *,
    sample_major: bool,
    num_lookups: int | None = None,
) -> BagLookups:
    """Every lookup of the features that read KJT ``keys`` [F], bags in feature-major (bag
    f*B + b) or sample-major (b*F + f) order. ``num_lookups``: their count when the host knows
    it (else it is read from the device: a sync)."""
    B, device = batch_size, offsets.device
    bag_index = keys[:, None] * B + torch.arange(B, device=device)  # [F, B]
    if sample_major:
        bag_index = bag_index.t()
    bag_index = bag_index.reshape(-1)
    starts = offsets[bag_index].long()
    lengths = offsets[bag_index + 1].long() - starts
    bag_offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, dim=0, out=bag_offsets[1:])
    total = int(bag_offsets[-1]) if num_lookups is None else num_lookups
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=total
    )
    position = torch.arange(total, device=device) + (starts - bag_offsets[:-1])[bag]
    return BagLookups(lengths=lengths, offsets=bag_offsets, bag=bag, position=position)


def sorted_segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort lookups by row key (stable, so equal keys keep their order and every reduction
    over a segment is deterministic): the distinct keys [U], the sorting permutation [L], and
    where each distinct key's run of lookups starts in sorted order [U + 1]."""
    sorted_keys, order = torch.sort(keys, stable=True)
    unique, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    starts = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=keys.device)
    torch.cumsum(counts, dim=0, out=starts[1:])
    return unique, order, starts


def padded_segments(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sorted_segments` without reading the number U of distinct keys on the host: the
    distinct keys padded to [L] with 0, the sorting permutation [L], and the segment starts
    padded to [L + 1] with L (segments U..L-1 are empty). The same segments, in the same
    order, as :func:`sorted_segments`."""
    sorted_keys, order = torch.sort(keys, stable=True)
    num = keys.numel()
    first = torch.ones(num, dtype=torch.bool, device=keys.device)
    torch.ne(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    segment = torch.cumsum(first, dim=0) - 1  # [L]: each sorted lookup's segment
    # Each segment's first lookup writes its position; the others write to a spare last slot,
    # which then gets the end (L).
    starts = torch.full((num + 1,), num, dtype=torch.int64, device=keys.device)
    target = torch.where(first, segment, num)
    starts.scatter_(0, target, torch.arange(num, device=keys.device))
    starts[num:].fill_(num)
    unique = torch.zeros(num, dtype=keys.dtype, device=keys.device)
    unique.scatter_(0, segment, sorted_keys)  # the lookups of a segment write the same key
    return unique, order, starts


def lookup_scale(
    lookups: BagLookups,
    per_sample_weights: torch.Tensor | None,
    mean: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Each lookup's factor on its row's gradient: its per-sample weight, times 1/length of
    its bag where ``mean`` (a bool per lookup) says the bag is mean-pooled; None when all 1."""
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights[lookups.position].to(dtype)
    if mean is not None:
        inverse = 1.0 / lookups.lengths.clamp(min=1).to(dtype)
        inverse = torch.where(mean, inverse[lookups.bag], torch.ones((), dtype=dtype))
        scale = inverse if scale is None else scale * inverse
    return scale


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


def rounding_seed(step: int) -> int:
    """Seed of the stochastic rounding of update ``step``: a pure function of the step, so two
    runs (and a resumed run) round identically."""
    return (step * 2654435761 + 0x5EED) % (2**31 - 1)
