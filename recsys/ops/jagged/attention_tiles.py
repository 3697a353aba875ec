"""Tile helpers shared by the HSTU jagged attention kernels
(``recsys.ops.jagged.attention_triton``; the math: ``recsys.ops.jagged.attention``): the loads
of a tile's rows, the mask, the relative bias's table rows and values, the scores and the score
gradient of one [queries, keys] tile (each on query rows ``rows`` and key columns ``cols`` of
one sequence); and on the host, the bias arguments every kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "RelativeBiasTables",
    "bias_arguments",
    "bias_rows",
    "grad_scores",
    "load_rows",
    "load_times",
    "query_times",
    "relative_bias_tile",
    "score_tile",
    "sequence_rows",
    "visible_tile",
]


@triton.jit
def sequence_rows(offsets_ptr, targets_ptr, heads, HAS_TARGETS: tl.constexpr):
    """(head, first row, rows n, history rows) of the sequence x head of axis 1 of the grid."""
    seq = tl.program_id(1) // heads
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    n = (tl.load(offsets_ptr + seq + 1) - start).to(tl.int32)
    history = n
    if HAS_TARGETS:
        history = n - tl.load(targets_ptr + seq).to(tl.int32)
    return tl.program_id(1) % heads, start, n, history


@triton.jit
def load_rows(ptr, start, rows, n, stride_t, head_offset, dims, width):
    """[rows, dims] of one head of a jagged [T, H, D] tensor: rows ``start + rows`` (those
    below ``n``), columns ``dims`` below ``width``; zeros elsewhere."""
    return tl.load(
        ptr + (start + rows)[:, None] * stride_t + head_offset + dims[None, :],
        mask=(rows < n)[:, None] & (dims < width)[None, :],
        other=0.0,
    )


@triton.jit
def sequence_position(p, history, contextual_len):
    """u_p of ``recsys.ops.jagged.attention``: the prefix at c - 1, the targets at h."""
    return tl.minimum(tl.maximum(p, contextual_len - 1), history)


@triton.jit
def visible_tile(
    rows,
    cols,
    n,
    history,
    contextual_len,
    max_attn_len,
    min_full_attn_seq_len,
    HAS_WINDOW: tl.constexpr,
):
    """mask(i, j) of ``recsys.ops.jagged.attention`` on the [rows, cols] tile, written with
    per-row bounds (fewer registers than the [rows, cols] positions u; equal for c <= h): a
    prefix row sees the history; another row sees j <= i (history) or the history and itself
    (target), and with a window the keys j >= u_i - w, or all of them once the prefix's
    position c - 1 is within the window or the row is one of the last min_full_attn_seq_len."""
    i = rows[:, None]
    j = cols[None, :]
    seen = tl.where(i < history, j <= i, (j < history) | (j == i))
    if HAS_WINDOW:
        position = tl.minimum(rows, history)  # u_i outside the prefix
        lowest = position - max_attn_len
        full_from = tl.where(min_full_attn_seq_len > 0, history - min_full_attn_seq_len, n + 1)
        lowest = tl.where((lowest < contextual_len) | (position >= full_from), 0, lowest)
        seen = seen & (j >= lowest[:, None])
    seen = seen | ((i < contextual_len) & (j < history))  # causal rows of the prefix: j <= i
    return (i < n) & (j < n) & seen


@triton.jit
def bias_rows(
    u_rows,
    u_cols,
    t_rows,
    t_cols,
    num_positions,
    num_time_buckets,
    time_bucket_incr,
    time_bucket_div,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
):
    """The [queries, keys] rows of the position table (by the rows' and columns' positions
    u) and of the time table (0 where unused)."""
    position = 0
    bucket = 0
    if HAS_POSITION_BIAS:
        position = u_cols[None, :] - u_rows[:, None] + num_positions - 1
        position = tl.minimum(tl.maximum(position, 0), 2 * num_positions - 2)
    if HAS_TIME_BIAS:
        gap = tl.abs(t_rows[:, None] - t_cols[None, :])  # float64
        scaled = tl.log(tl.maximum(gap, 1e-6) / time_bucket_incr) / time_bucket_div
        bucket = tl.minimum(tl.maximum(scaled, 0.0), num_time_buckets).to(tl.int32)
    return position, bucket


@triton.jit
def relative_bias_tile(
    position_w_ptr,
    time_w_ptr,
    position,
    bucket,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
):
    """rab of one tile from its table rows (both in range, so the loads need no mask)."""
    bias = 0.0
    if HAS_POSITION_BIAS:
        bias = tl.load(position_w_ptr + position)
    if HAS_TIME_BIAS:
        bias = bias + tl.load(time_w_ptr + bucket)
    return bias


@triton.jit
def load_times(ts_ptr, start, rows, n, HAS_TIME_BIAS: tl.constexpr):
    times = 0.0
    if HAS_TIME_BIAS:
        times = tl.load(ts_ptr + start + rows, mask=rows < n, other=0.0)
    return times


@triton.jit
def score_tile(
    q,
    k,
    rows,
    cols,
    u_rows,
    u_cols,
    n,
    history,
    t_rows,
    t_cols,
    position_w_ptr,
    time_w_ptr,
    alpha,
    contextual_len,
    max_attn_len,
    min_full_attn_seq_len,
    num_positions,
    num_time_buckets,
    time_bucket_incr,
    time_bucket_div,
    HAS_WINDOW: tl.constexpr,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """(s, mask, position table rows, time table rows) of one [queries, keys] tile whose
    rows and columns sit at positions ``u_rows``, ``u_cols`` (:func:`sequence_position`):
    s = alpha q . k + rab, before the mask."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * alpha
    position = 0
    bucket = 0
    if HAS_POSITION_BIAS or HAS_TIME_BIAS:
        position, bucket = bias_rows(
            u_rows,
            u_cols,
            t_rows,
            t_cols,
            num_positions,
            num_time_buckets,
            time_bucket_incr,
            time_bucket_div,
            HAS_POSITION_BIAS,
            HAS_TIME_BIAS,
        )
        s = s + relative_bias_tile(
            position_w_ptr, time_w_ptr, position, bucket, HAS_POSITION_BIAS, HAS_TIME_BIAS
        )
    mask = visible_tile(
        rows,
        cols,
        n,
        history,
        contextual_len,
        max_attn_len,
        min_full_attn_seq_len,
        HAS_WINDOW,
    )
    return s, mask, position, bucket


@triton.jit
def query_times(ts_ptr, start, rows, n, HAS_TIME_BIAS: tl.constexpr, TIME_FROM_NEXT: tl.constexpr):
    """tau of the rows (``time_convention``): their own times, or the next rows' (a
    sequence's last row: its own)."""
    times = 0.0
    if HAS_TIME_BIAS:
        following = rows
        if TIME_FROM_NEXT:
            following = tl.minimum(rows + 1, n - 1)
        times = tl.load(ts_ptr + start + following, mask=rows < n, other=0.0)
    return times


@triton.jit
def grad_scores(s, mask, v, g, inv_n, INPUT_PRECISION: tl.constexpr):
    """(weights / N, dL/ds) of one [queries, keys] tile of scores s, masked (without alpha)."""
    sig = tl.sigmoid(s)
    weights = tl.where(mask, s * sig * inv_n, 0.0)
    grad_weights = tl.dot(g, tl.trans(v), input_precision=INPUT_PRECISION) * inv_n
    ds = tl.where(mask, grad_weights * sig * (1.0 + s * (1.0 - sig)), 0.0)
    return weights, ds


@dataclass(frozen=True)
class RelativeBiasTables:
    """The relative attention bias a launch adds to s (see ``recsys.ops.jagged.attention``):
    ``timestamps`` float64 [T] (None without the time bias), ``position_weights`` [2P - 1]
    and ``time_weights`` [num_time_buckets + 1] (either may be None), the bucketing's
    ``time_bucket_incr`` / ``time_bucket_div`` (float32 values) and whether a query's time is
    the next row's (``time_convention="next"``)."""

    timestamps: torch.Tensor | None
    position_weights: torch.Tensor | None
    time_weights: torch.Tensor | None
    time_bucket_incr: float
    time_bucket_div: float
    time_from_next: bool = False

    def settings(self) -> tuple:
        """What :meth:`from_saved` needs besides the tensors (which tables are present, the
        bucketing, the query's time): an autograd Function keeps tensors only through
        save_for_backward."""
        present = (self.timestamps, self.position_weights, self.time_weights)
        scalars = (self.time_bucket_incr, self.time_bucket_div, self.time_from_next)
        return (*(t is not None for t in present), *scalars)

    @classmethod
    def from_saved(cls, pointers: list[torch.Tensor], settings: tuple) -> RelativeBiasTables:
        """The tables back from :func:`bias_arguments`' pointer tensors and :meth:`settings`."""
        *present, incr, div, time_from_next = settings
        tensors = [t if kept else None for t, kept in zip(pointers, present, strict=True)]
        return cls(*tensors, incr, div, time_from_next)


def bias_arguments(bias: RelativeBiasTables, fallback: torch.Tensor) -> tuple[list, list]:
    """(pointer arguments, scalar arguments) of the kernels' relative bias; ``fallback`` stands
    in for an absent tensor (never read)."""
    positions, times = bias.position_weights, bias.time_weights
    pointers = [
        bias.timestamps if bias.timestamps is not None else fallback,
        positions if positions is not None else fallback,
        times if times is not None else fallback,
    ]
    scalars = [
        (positions.numel() + 1) // 2 if positions is not None else 1,
        times.numel() - 1 if times is not None else 0,
        bias.time_bucket_incr,
        bias.time_bucket_div,
    ]
    return pointers, scalars
