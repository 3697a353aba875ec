"""Triton kernels of the table-batched embedding bag (see ``recsys.ops.embedding_bag.pooled``).

All tables of a collection live in one flat buffer; table t starts at element
``table_offset[t]`` and has rows of ``table_dim[t]`` elements. Two kernels, each one launch for
all tables:

- ``_pool_kernel``: one program per (bag, dim tile). Reads the bag's ids from the KJT values in
  blocks of BLOCK_L, gathers their rows, accumulates in fp32 (fp64 for fp64 tables) and writes
  the pooled row straight into its columns of the [B, total_D] output.
- ``_segment_kernel``: backward, one program per distinct touched row. The caller sorts the
  batch's lookups by row (stable), so a row's lookups are one contiguous segment; the program
  sums their upstream gradients (each scaled by its per-sample weight and 1/length for mean
  pooling) in sorted order, which makes the result deterministic, then either writes the
  reduced gradient to a compact [U, D] buffer (no optimizer) or applies the fused optimizer to
  the row and its state in place.

fp16 / bf16 tables are updated in fp32 and stored with stochastic rounding: a value between
two neighbours of the table's dtype rounds up with probability equal to its distance from the
lower one, in units of the gap (computed in fp32 with exact power-of-two arithmetic); or, with
``stochastic_rounding=False``, to the nearest neighbour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from recsys.ops._triton import accumulate_dtype, triton_dtype
from recsys.ops.embedding_bag.layout import (
    FusedUpdate,
    LookupPlan,
    PlanTensors,
    bag_lookups,
    lookup_scale,
    padded_segments,
    rounding_seed,
    sorted_segments,
)

# Optimizer codes (embedding_bag_layout.SGD_CODE ...); NONE writes the reduced gradient instead.
OPT_NONE = -1


@triton.jit
def _pool_kernel(
    values_ptr,
    offsets_ptr,
    psw_ptr,
    weights_ptr,
    out_ptr,
    feat_key_ptr,
    feat_table_ptr,
    feat_col_ptr,
    table_dim_ptr,
    table_offset_ptr,
    table_mean_ptr,
    B,
    total_D,
    HAS_PSW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)  # feature-major: f * B + b
    f = bag // B
    b = bag - f * B
    key = tl.load(feat_key_ptr + f).to(tl.int64)
    t = tl.load(feat_table_ptr + f)
    D = tl.load(table_dim_ptr + t).to(tl.int64)
    base = tl.load(table_offset_ptr + t)
    col = tl.load(feat_col_ptr + f)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    start = tl.load(offsets_ptr + key * B + b).to(tl.int64)
    end = tl.load(offsets_ptr + key * B + b + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for i in range(start, end, BLOCK_L):
        lookup = i + tl.arange(0, BLOCK_L)
        lmask = lookup < end
        ids = tl.load(values_ptr + lookup, mask=lmask, other=0).to(tl.int64)
        rows = tl.load(
            weights_ptr + base + ids[:, None] * D + d[None, :],
            mask=lmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(ACC)
        if HAS_PSW:
            psw = tl.load(psw_ptr + lookup, mask=lmask, other=0.0).to(ACC)
            rows = rows * psw[:, None]
        acc += tl.sum(rows, axis=0)
    if tl.load(table_mean_ptr + t) != 0:
        acc = acc / tl.maximum(end - start, 1).to(ACC)
    tl.store(out_ptr + b * total_D + col + d, acc, mask=dmask)


@triton.jit
def _segment_kernel(
    seg_start_ptr,
    seg_table_ptr,
    seg_row_ptr,
    grad_off_ptr,
    scale_ptr,
    grad_ptr,
    table_dim_ptr,
    table_offset_ptr,
    table_row_offset_ptr,
    weights_ptr,
    state1_ptr,
    state2_ptr,
    compact_ptr,
    keep_ptr,
    lr,
    eps,
    beta1,
    beta2,
    weight_decay,
    bias_correction1,
    bias_correction2,
    seed,
    OPT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    ACC: tl.constexpr,
    LOW_PRECISION: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    lo = tl.load(seg_start_ptr + s)
    hi = tl.load(seg_start_ptr + s + 1)
    t = tl.load(seg_table_ptr + s)
    row = tl.load(seg_row_ptr + s)
    D = tl.load(table_dim_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    # Sum the segment's gradients, BLOCK_L lookups at a time, in sorted order.
    g = tl.zeros([BLOCK_D], dtype=ACC)
    for i in range(lo, hi, BLOCK_L):
        lookup = i + tl.arange(0, BLOCK_L)
        lmask = lookup < hi
        off = tl.load(grad_off_ptr + lookup, mask=lmask, other=0)
        rows = tl.load(
            grad_ptr + off[:, None] + d[None, :], mask=lmask[:, None] & dmask[None, :], other=0.0
        ).to(ACC)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + lookup, mask=lmask, other=0.0).to(ACC)
            rows = rows * scale[:, None]
        g += tl.sum(rows, axis=0)

    if OPT == -1:  # no optimizer: hand the reduced gradient back
        tl.store(compact_ptr + s * BLOCK_D + d, g, mask=dmask)
    else:
        # A segment past the batch's distinct rows (the sync-free grid is sized for every
        # lookup) is empty and updates nothing; nor does a batch that failed its input check.
        dmask = dmask & (lo + d * 0 < hi)
        if HAS_KEEP:
            dmask = dmask & (tl.load(keep_ptr + d * 0) != 0)
        live = tl.sum(dmask.to(tl.int32), axis=0) > 0  # for the row's one-value state
        element = tl.load(table_offset_ptr + t) + row * D + d
        w = tl.load(weights_ptr + element, mask=dmask, other=0.0).to(ACC)
        g = g + weight_decay * w
        if OPT == 0:  # SGD
            w = w - lr * g
        elif OPT == 1:  # Adagrad
            acc = tl.load(state1_ptr + element, mask=dmask, other=0.0) + g * g
            tl.store(state1_ptr + element, acc, mask=dmask)
            w = w - lr * g / (tl.sqrt(acc) + eps)
        elif OPT == 2:  # RowWiseAdagrad
            row_state = state1_ptr + tl.load(table_row_offset_ptr + t) + row
            acc = tl.load(row_state) + tl.sum(tl.where(dmask, g * g, 0.0), axis=0) / D
            tl.store(row_state, acc, mask=live)
            w = w - lr * g / (tl.sqrt(acc) + eps)
        else:  # Adam (lazy)
            m = beta1 * tl.load(state1_ptr + element, mask=dmask, other=0.0) + (1 - beta1) * g
            v = beta2 * tl.load(state2_ptr + element, mask=dmask, other=0.0) + (1 - beta2) * g * g
            tl.store(state1_ptr + element, m, mask=dmask)
            tl.store(state2_ptr + element, v, mask=dmask)
            w = w - lr * (m / bias_correction1) / (tl.sqrt(v / bias_correction2) + eps)
        if LOW_PRECISION:
            # Round to fp16 / bf16 in fp32 with exact power-of-two arithmetic, so the cast
            # below is exact (and the same under the CPU interpreter as on a GPU).
            w = w.to(tl.float32)
            magnitude = tl.abs(w)
            exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            ulp = tl.exp2((tl.maximum(exponent, MIN_EXPONENT) - MANTISSA_BITS).to(tl.float32))
            units = magnitude / ulp
            low = tl.floor(units)
            if STOCHASTIC:  # up with probability equal to the distance from low
                up = tl.rand(seed, (s * BLOCK_D + d).to(tl.int32)) < units - low
            else:  # to nearest, ties to even
                odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
                up = (units - low > 0.5) | ((units - low == 0.5) & odd)
            rounded = (low + tl.where(up, 1.0, 0.0)) * ulp
            w = tl.where(w < 0, -rounded, rounded)
        tl.store(weights_ptr + element, w.to(weights_ptr.dtype.element_ty), mask=dmask)


def pool(
    values: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    weights: torch.Tensor,
    out: torch.Tensor,
    tensors: PlanTensors,
    batch_size: int,
    num_features: int,
    max_dim: int,
    block_l: int,
) -> None:
    """Launch ``_pool_kernel`` over every (bag, dim tile); fills ``out`` [B, total_D]."""
    if batch_size == 0 or num_features == 0:
        return
    block_d = min(triton.next_power_of_2(max_dim), 128)
    grid = (num_features * batch_size, triton.cdiv(max_dim, block_d))
    _pool_kernel[grid](
        values,
        offsets,
        psw if psw is not None else weights,
        weights,
        out,
        tensors.feat_key,
        tensors.feat_table,
        tensors.feat_col,
        tensors.table_dim,
        tensors.table_offset,
        tensors.table_mean,
        batch_size,
        out.shape[1],
        HAS_PSW=psw is not None,
        ACC=triton_dtype(accumulate_dtype(out.dtype)),
        BLOCK_L=block_l,
        BLOCK_D=block_d,
    )


@dataclass(frozen=True)
class Segments:
    """The batch's L lookups sorted by global row key (stable), cut into U segments, one per
    distinct touched row. Padded (the fused path: U is not read on the host), every tensor of
    size U has L entries, and segments U..L-1 are empty (start = L) with row 0 of table 0."""

    start: torch.Tensor  # [U + 1] int64: where each segment starts among the sorted lookups
    table: torch.Tensor  # [U] int32: the segment's table
    row: torch.Tensor  # [U] int64: its row within that table
    key: torch.Tensor  # [U] int64: its row in the row space (sorted)
    grad_off: torch.Tensor  # [L] int64: each sorted lookup's element offset in grad_out
    scale: torch.Tensor | None  # [L]: its factor on the gradient; None when all 1


@dataclass(frozen=True)
class SegmentUpdate:
    """What ``_segment_kernel`` needs to apply a fused optimizer in place."""

    weights: torch.Tensor  # the flat buffer of all tables
    states: tuple[torch.Tensor, ...]  # the optimizer's flat state buffers, in its state order
    optimizer_code: int  # the optimizer's code (embedding_bag_layout.SGD_CODE ...)
    scalars: dict[str, float]  # its hyperparameters for this step (``optimizer.scalars``)
    seed: int  # of the stochastic rounding
    stochastic: bool  # fp16 / bf16 tables: round stochastically (else to nearest)
    keep: torch.Tensor | None = None  # device bool: False withholds the update


def _kernel_scalars(update: SegmentUpdate | None) -> tuple[float, ...]:
    """lr, eps, beta1, beta2, weight_decay, bias_correction1, bias_correction2."""
    scalars = {} if update is None else update.scalars
    return (
        float(scalars.get("lr", 0.0)),
        float(scalars.get("eps", 0.0)),
        float(scalars.get("beta1", 0.0)),
        float(scalars.get("beta2", 0.0)),
        float(scalars.get("weight_decay", 0.0)),
        float(scalars.get("bias_correction1", 1.0)),
        float(scalars.get("bias_correction2", 1.0)),
    )


def _rounding_bits(weights: torch.Tensor | None) -> tuple[bool, int, int]:
    """Whether the tables are fp16 / bf16, and that dtype's mantissa bits and minimum
    exponent (0, 0 otherwise)."""
    if weights is None or weights.dtype not in (torch.float16, torch.bfloat16):
        return False, 0, 0
    mantissa, min_exponent = (10, -14) if weights.dtype == torch.float16 else (7, -126)
    return True, mantissa, min_exponent


def reduce_segments(
    segments: Segments,
    grad: torch.Tensor,
    tensors: PlanTensors,
    max_dim: int,
    update: SegmentUpdate | None = None,
    block_l: int = 8,
) -> torch.Tensor | None:
    """Launch ``_segment_kernel`` once per touched row.

    Without ``update`` returns the reduced gradients [U, next_pow2(max_dim)] (row u holds
    its table's dim columns, zeros after); with it, updates its weights and states in place
    and returns None.
    """
    num_segments = segments.row.numel()
    block_d = triton.next_power_of_2(max_dim)
    acc = accumulate_dtype(grad.dtype)
    compact = None
    if update is None:
        compact = torch.zeros(num_segments, block_d, dtype=acc, device=grad.device)
    if num_segments == 0:
        return compact
    weights = None if update is None else update.weights
    low_precision, mantissa, min_exponent = _rounding_bits(weights)
    states = () if update is None else update.states
    keep = None if update is None else update.keep
    placeholder = grad
    _segment_kernel[(num_segments,)](
        segments.start,
        segments.table,
        segments.row,
        segments.grad_off,
        segments.scale if segments.scale is not None else placeholder,
        grad,
        tensors.table_dim,
        tensors.table_offset,
        tensors.table_row_offset,
        weights if weights is not None else placeholder,
        states[0] if len(states) > 0 else placeholder,
        states[1] if len(states) > 1 else placeholder,
        compact if compact is not None else placeholder,
        keep.view(torch.uint8) if keep is not None else placeholder,
        *_kernel_scalars(update),
        0 if update is None else update.seed,
        OPT=OPT_NONE if update is None else update.optimizer_code,
        HAS_SCALE=segments.scale is not None,
        HAS_KEEP=keep is not None,
        ACC=triton_dtype(acc),
        LOW_PRECISION=low_precision,
        STOCHASTIC=True if update is None else update.stochastic,
        MANTISSA_BITS=mantissa,
        MIN_EXPONENT=min_exponent,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
    )
    return compact


# --------------------------------------------------------------------------- glue


def _segments(
    plan: LookupPlan,
    tensors: PlanTensors,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    scale_dtype: torch.dtype,
    num_lookups: int | None = None,
    padded: bool = False,
) -> Segments:
    """Every lookup of the batch sorted by row (stable), cut into one segment per distinct
    row (see :class:`Segments`). ``num_lookups``: L when the host knows it (else read from the
    device); ``padded``: segments sized L, so nothing waits for the count of distinct rows."""
    B = batch_size
    lookups = bag_lookups(offsets, tensors.feat_key, B, sample_major=False, num_lookups=num_lookups)
    feature, sample = lookups.bag // B, lookups.bag % B
    table = tensors.feat_table[feature].long()
    key = tensors.table_row_offset[table] + values[lookups.position].long()
    grad_off = sample * plan.total_dim + tensors.feat_col[feature]
    mean = tensors.feat_mean[feature] if plan.any_mean else None
    scale = lookup_scale(lookups, per_sample_weights, mean, scale_dtype)
    unique, order, start = padded_segments(key) if padded else sorted_segments(key)
    bound = torch.searchsorted(tensors.row_bounds, unique, right=True) - 1
    seg_table = tensors.bound_table[bound]
    return Segments(
        start=start,
        table=seg_table,
        row=unique - tensors.table_row_offset[seg_table.long()],
        key=unique,
        grad_off=grad_off[order],
        scale=None if scale is None else scale[order],
    )


def lookup_block(values: torch.Tensor, num_bags: int) -> int:
    """Ids loaded per step of the pooling loop: about the mean bag length, 1..32."""
    mean = values.numel() / max(num_bags, 1)
    block = 1
    while block < mean and block < 32:
        block *= 2
    return block


def backward(
    plan: LookupPlan,
    flat: torch.Tensor,
    grad_out: torch.Tensor,
    tensors: PlanTensors,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    fused: FusedUpdate | None,
    step: int,
    num_lookups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Backward of the Triton path: sort the lookups into segments, then one launch of
    ``_segment_kernel``. With ``fused`` and ``num_lookups`` (the batch's lookups, known on the
    host) nothing waits for the device: the segments are padded to the lookups.

    Args:
        plan, flat: the forward's plan and packed tables.
        grad_out: [B, total_D] upstream gradient (contiguous).
        tensors: ``plan.tensors(...)`` for the forward's KJT key order.
        values, offsets, per_sample_weights, batch_size: the forward's batch.
        fused: the optimizer to apply to the touched rows, or None.
        step: the step being applied (seeds the stochastic rounding).
        num_lookups: the number of lookups, when the host knows it.

    Returns:
        ``(None, None)`` after applying ``fused`` in place; without it, the segments' sorted
        row keys [U] and reduced gradients [U, next_pow2(max_dim)] for dense table gradients.
    """
    segments = _segments(
        plan,
        tensors,
        values,
        offsets,
        per_sample_weights,
        batch_size,
        accumulate_dtype(grad_out.dtype),
        num_lookups,
        padded=fused is not None and num_lookups is not None,
    )
    if fused is not None and num_lookups is not None:
        block_l = 8  # lookups per distinct row are not known on the host
    else:
        block_l = lookup_block(segments.grad_off, segments.key.numel()) if num_lookups else 1
    max_dim = plan.layout.max_dim
    if fused is None:
        reduced = reduce_segments(segments, grad_out, tensors, max_dim, block_l=block_l)
        return segments.key, reduced
    update = SegmentUpdate(
        weights=flat,
        states=tuple(fused.states[name] for name in fused.optimizer.states),
        optimizer_code=fused.optimizer.code,
        scalars=fused.optimizer.scalars(step),
        seed=rounding_seed(step),
        stochastic=fused.optimizer.stochastic_rounding,
        keep=fused.keep,
    )
    reduce_segments(segments, grad_out, tensors, max_dim, update, block_l=block_l)
    return None, None
