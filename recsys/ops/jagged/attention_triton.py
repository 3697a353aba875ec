"""Triton kernels of HSTU jagged attention (the math: ``recsys.ops.jagged.attention``).

Forward: one program per (query tile of ``BLOCK_M`` rows, sequence x head) loads its queries
once and loops over key tiles of ``BLOCK_N`` rows up to the causal bound (the tile's last
query, or the history's end for a tile holding contextual prefix rows), accumulating
``silu(s) v`` in fp32 registers. Backward: ``_grad_kv_kernel`` (one program per key tile)
loops over the query tiles that can see its keys (from its own on, and those of the prefix's
rows) and accumulates dk and dv; ``_grad_q_kernel`` (one program per query tile) loops
over key tiles for dq. Both recompute s, the mask and the relative bias; nothing of size
[N, N] reaches memory. dq, dk, dv use no atomics and are deterministic; the gradients of the
bias tables are summed with ``tl.atomic_add`` from the query-side kernel (every visible
(i, j) pair is visited there exactly once), so they vary run to run in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recsys.ops._triton import dot_in_fp32, dot_input_precision
from recsys.ops.jagged.attention_tiles import (
    RelativeBiasTables,
    bias_arguments,
    grad_scores,
    load_rows,
    load_times,
    query_times,
    score_tile,
    sequence_position,
    sequence_rows,
)

__all__ = ["BLOCK_M", "BLOCK_N", "KV_BLOCK_M", "JaggedAttentionFunction"]

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # key rows per loop step
KV_BLOCK_M = 16  # query rows per step of the key-side backward


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    offsets_ptr,
    targets_ptr,
    ts_ptr,
    position_w_ptr,
    time_w_ptr,
    out_ptr,
    heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    alpha,
    inv_n,
    contextual_len,
    max_attn_len,
    min_full_attn_seq_len,
    num_positions,
    num_time_buckets,
    time_bucket_incr,
    time_bucket_div,
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
    TIME_FROM_NEXT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (query tile, sequence x head); keys loop up to the causal bound.
    m0 = tl.program_id(0) * BLOCK_M
    head, start, n, history = sequence_rows(offsets_ptr, targets_ptr, heads, HAS_TARGETS)
    if m0 >= n:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    t_rows = query_times(ts_ptr, start, rows, n, HAS_TIME_BIAS, TIME_FROM_NEXT)
    u_rows = sequence_position(rows, history, contextual_len)
    q = load_rows(q_ptr, start, rows, n, stride_qt, head * stride_qh, dqk, D_QK)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    end = tl.minimum(n, m0 + BLOCK_M)
    if m0 < contextual_len:
        end = tl.maximum(end, history)  # the prefix's rows see the whole history
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = load_rows(k_ptr, start, cols, n, stride_kt, head * stride_kh, dqk, D_QK)
        v = load_rows(v_ptr, start, cols, n, stride_vt, head * stride_vh, dv, D_V)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        t_cols = load_times(ts_ptr, start, cols, n, HAS_TIME_BIAS)
        u_cols = sequence_position(cols, history, contextual_len)
        s, mask, _, _ = score_tile(
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
            HAS_WINDOW,
            HAS_POSITION_BIAS,
            HAS_TIME_BIAS,
            INPUT_PRECISION,
        )
        weights = tl.where(mask, s * tl.sigmoid(s), 0.0)
        acc = tl.dot(weights.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    tl.store(
        out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dv[None, :],
        (acc * inv_n).to(out_ptr.dtype.element_ty),
        mask=(rows < n)[:, None] & (dv < D_V)[None, :],
    )


@triton.jit
def _grad_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    offsets_ptr,
    targets_ptr,
    ts_ptr,
    position_w_ptr,
    time_w_ptr,
    dk_ptr,
    dv_ptr,
    heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    alpha,
    inv_n,
    contextual_len,
    max_attn_len,
    min_full_attn_seq_len,
    num_positions,
    num_time_buckets,
    time_bucket_incr,
    time_bucket_div,
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
    TIME_FROM_NEXT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (key tile, sequence x head): dk, dv summed over the query tiles that
    # can see the keys.
    n0 = tl.program_id(0) * BLOCK_N
    head, start, n, history = sequence_rows(offsets_ptr, targets_ptr, heads, HAS_TARGETS)
    if n0 >= n:
        return
    cols = n0 + tl.arange(0, BLOCK_N)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    key_mask = cols < n
    k = load_rows(k_ptr, start, cols, n, stride_kt, head * stride_kh, dqk, D_QK)
    v = load_rows(v_ptr, start, cols, n, stride_vt, head * stride_vh, dv, D_V)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    t_cols = load_times(ts_ptr, start, cols, n, HAS_TIME_BIAS)
    u_cols = sequence_position(cols, history, contextual_len)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dvv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # the query tiles from this one's on, after those of the prefix's rows before it (which
    # see every history key): one loop over both ranges, no branch in it
    first = (n0 // BLOCK_M) * BLOCK_M
    prefix_end = tl.where(n0 < history, tl.cdiv(contextual_len, BLOCK_M) * BLOCK_M, 0)
    prefix_end = tl.minimum(prefix_end, first)
    for step in range(0, prefix_end + n - first, BLOCK_M):
        m0 = tl.where(step < prefix_end, step, step - prefix_end + first)
        rows = m0 + tl.arange(0, BLOCK_M)
        q = load_rows(q_ptr, start, rows, n, stride_qt, head * stride_qh, dqk, D_QK)
        g = load_rows(g_ptr, start, rows, n, stride_gt, head * stride_gh, dv, D_V)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
            g = g.to(tl.float32)
        t_rows = query_times(ts_ptr, start, rows, n, HAS_TIME_BIAS, TIME_FROM_NEXT)
        u_rows = sequence_position(rows, history, contextual_len)
        s, mask, _, _ = score_tile(
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
            HAS_WINDOW,
            HAS_POSITION_BIAS,
            HAS_TIME_BIAS,
            INPUT_PRECISION,
        )
        weights, ds = grad_scores(s, mask, v, g, inv_n, INPUT_PRECISION)
        dvv = tl.dot(tl.trans(weights.to(g.dtype)), g, dvv, input_precision=INPUT_PRECISION)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=INPUT_PRECISION)
    tl.store(
        dk_ptr + (start + cols)[:, None] * stride_kt + head * stride_kh + dqk[None, :],
        (dk * alpha).to(dk_ptr.dtype.element_ty),
        mask=key_mask[:, None] & (dqk < D_QK)[None, :],
    )
    tl.store(
        dv_ptr + (start + cols)[:, None] * stride_vt + head * stride_vh + dv[None, :],
        dvv.to(dv_ptr.dtype.element_ty),
        mask=key_mask[:, None] & (dv < D_V)[None, :],
    )


@triton.jit
def _grad_q_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    offsets_ptr,
    targets_ptr,
    ts_ptr,
    position_w_ptr,
    time_w_ptr,
    dq_ptr,
    d_position_w_ptr,
    d_time_w_ptr,
    heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    alpha,
    inv_n,
    contextual_len,
    max_attn_len,
    min_full_attn_seq_len,
    num_positions,
    num_time_buckets,
    time_bucket_incr,
    time_bucket_div,
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_POSITION_BIAS: tl.constexpr,
    HAS_TIME_BIAS: tl.constexpr,
    TIME_FROM_NEXT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (query tile, sequence x head): dq summed over the visible key tiles.
    m0 = tl.program_id(0) * BLOCK_M
    head, start, n, history = sequence_rows(offsets_ptr, targets_ptr, heads, HAS_TARGETS)
    if m0 >= n:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_rows(q_ptr, start, rows, n, stride_qt, head * stride_qh, dqk, D_QK)
    g = load_rows(g_ptr, start, rows, n, stride_gt, head * stride_gh, dv, D_V)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        g = g.to(tl.float32)
    t_rows = query_times(ts_ptr, start, rows, n, HAS_TIME_BIAS, TIME_FROM_NEXT)
    u_rows = sequence_position(rows, history, contextual_len)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    end = tl.minimum(n, m0 + BLOCK_M)
    if m0 < contextual_len:
        end = tl.maximum(end, history)  # the prefix's rows see the whole history
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = load_rows(k_ptr, start, cols, n, stride_kt, head * stride_kh, dqk, D_QK)
        v = load_rows(v_ptr, start, cols, n, stride_vt, head * stride_vh, dv, D_V)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        t_cols = load_times(ts_ptr, start, cols, n, HAS_TIME_BIAS)
        u_cols = sequence_position(cols, history, contextual_len)
        s, mask, position, bucket = score_tile(
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
            HAS_WINDOW,
            HAS_POSITION_BIAS,
            HAS_TIME_BIAS,
            INPUT_PRECISION,
        )
        _, ds = grad_scores(s, mask, v, g, inv_n, INPUT_PRECISION)
        if HAS_POSITION_BIAS:
            tl.atomic_add(d_position_w_ptr + position, ds, mask=mask, sem="relaxed")
        if HAS_TIME_BIAS:
            tl.atomic_add(d_time_w_ptr + bucket, ds, mask=mask, sem="relaxed")
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    tl.store(
        dq_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dqk[None, :],
        (dq * alpha).to(dq_ptr.dtype.element_ty),
        mask=(rows < n)[:, None] & (dqk < D_QK)[None, :],
    )


# --------------------------------------------------------------------------- launchers


def _launch_options(
    q: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    num_targets,
    contextual_len: int,
    max_attn_len: int,
    bias: RelativeBiasTables,
) -> dict:
    heads = q.shape[1]
    return dict(
        grid=(triton.cdiv(max(max_seq_len, 1), BLOCK_M), (offsets.numel() - 1) * heads),
        heads=heads,
        D_QK=q.shape[2],
        D_V=v.shape[2],
        HAS_TARGETS=num_targets is not None,
        HAS_WINDOW=max_attn_len > 0,
        HAS_POSITION_BIAS=bias.position_weights is not None,
        HAS_TIME_BIAS=bias.time_weights is not None,
        TIME_FROM_NEXT=bias.time_weights is not None and bias.time_from_next,
        INPUT_PRECISION=dot_input_precision(q.dtype),
        DOT_IN_FP32=dot_in_fp32(q.dtype, widened=(torch.bfloat16, torch.float16)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=max(16, triton.next_power_of_2(q.shape[2])),
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[2])),
    )


class JaggedAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, offsets, max_seq_len, alpha, num_targets, contextual_len,
    max_attn_len, min_full_attn_seq_len, timestamps, position_weights, time_weights,
    time_bucket_incr, time_bucket_div, time_convention)``: the Triton forward and backward of
    ``recsys.ops.jagged.attention``.
    The bias tables are read as float32 and their gradients returned in their dtype."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        offsets,
        max_seq_len,
        alpha,
        num_targets,
        contextual_len,
        max_attn_len,
        min_full_attn_seq_len,
        timestamps,
        position_weights,
        time_weights,
        time_bucket_incr,
        time_bucket_div,
        time_convention,
    ):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bias = RelativeBiasTables(
            timestamps.contiguous().double() if timestamps is not None else None,
            position_weights.detach().float().contiguous()
            if position_weights is not None
            else None,
            time_weights.detach().float().contiguous() if time_weights is not None else None,
            time_bucket_incr,
            time_bucket_div,
            time_convention == "next",
        )
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        options = _launch_options(
            q, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len, bias
        )
        grid, heads = options.pop("grid"), options.pop("heads")
        targets = num_targets if num_targets is not None else offsets
        bias_pointers, bias_scalars = bias_arguments(bias, q)
        inv_n = 1.0 / max(max_seq_len, 1)
        if q.shape[0]:
            _forward_kernel[grid](
                q,
                k,
                v,
                offsets,
                targets,
                *bias_pointers,
                out,
                heads,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                out.stride(0),
                out.stride(1),
                alpha,
                inv_n,
                contextual_len,
                max_attn_len,
                min_full_attn_seq_len,
                *bias_scalars,
                **options,
            )
        ctx.save_for_backward(q, k, v, offsets, num_targets, *bias_pointers)
        ctx.bias_settings = bias.settings()  # its tensors go through save_for_backward
        ctx.table_dtypes = tuple(
            w.dtype if w is not None else None for w in (position_weights, time_weights)
        )
        masking = (contextual_len, max_attn_len, min_full_attn_seq_len)
        ctx.settings = (max_seq_len, alpha, masking, inv_n)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, offsets, num_targets, *bias_pointers = ctx.saved_tensors
        max_seq_len, alpha, masking, inv_n = ctx.settings
        contextual_len, max_attn_len, _ = masking
        bias = RelativeBiasTables.from_saved(bias_pointers, ctx.bias_settings)
        grad = grad.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # fp32 sums of the tables' gradients (atomics; zeros where a table is absent)
        d_positions, d_times = (
            torch.zeros(w.numel() if w is not None else 1, dtype=torch.float32, device=q.device)
            for w in (bias.position_weights, bias.time_weights)
        )
        options = _launch_options(
            q, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len, bias
        )
        grid, heads = options.pop("grid"), options.pop("heads")
        # The key-side kernel holds k, v, dk, dv and, per query step, q, g and two score
        # tiles: it steps 16 queries at a time on 8 warps (32 on 4 warps spilled 36-56 B on
        # sm_80 / sm_90 in fp32, 32 on 8 warps 8 B on sm_80).
        kv_options = options | {"BLOCK_M": KV_BLOCK_M}
        # With the time bias (a float64 gap per score) both kernels take 16 keys at a time:
        # 32 spilled 16 B (query side, sm_80) and 4-8 B (key side, sm_80 / sm_90) in exact fp32.
        q_options = options
        if options["HAS_TIME_BIAS"]:
            kv_options, q_options = kv_options | {"BLOCK_N": 16}, options | {"BLOCK_N": 16}
        key_grid = (triton.cdiv(max(max_seq_len, 1), kv_options["BLOCK_N"]), grid[1])
        targets = num_targets if num_targets is not None else offsets
        _, bias_scalars = bias_arguments(bias, q)
        strides = (
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            grad.stride(0),
            grad.stride(1),
        )
        settings = (alpha, inv_n, *masking, *bias_scalars)
        if q.shape[0]:
            _grad_kv_kernel[key_grid](
                q,
                k,
                v,
                grad,
                offsets,
                targets,
                *bias_pointers,
                dk,
                dv,
                heads,
                *strides,
                *settings,
                **kv_options,
                num_warps=8,
            )
            _grad_q_kernel[grid](
                q,
                k,
                v,
                grad,
                offsets,
                targets,
                *bias_pointers,
                dq,
                d_positions,
                d_times,
                heads,
                *strides,
                *settings,
                **q_options,
                num_warps=8,
            )
        position_dtype, time_dtype = ctx.table_dtypes
        d_position_weights = d_positions.to(position_dtype) if position_dtype else None
        d_time_weights = d_times.to(time_dtype) if time_dtype else None
        return (
            dq,
            dk,
            dv,
            *([None] * 8),
            d_position_weights,
            d_time_weights,
            None,
            None,
            None,
        )
