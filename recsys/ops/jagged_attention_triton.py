"""Triton kernels of HSTU jagged attention (the math: ``recsys.ops.jagged_attention``).

Forward: one program per (query tile of ``BLOCK_M`` rows, sequence x head) loads its queries
once and loops over key tiles of ``BLOCK_N`` rows up to the causal bound (the tile's last
query, or the contextual prefix's end if later), accumulating ``silu(s) v`` in fp32 registers.
Backward: ``_grad_kv_kernel`` (one program per key tile) loops over the query tiles that can
see its keys and accumulates dk and dv; ``_grad_q_kernel`` (one program per query tile) loops
over key tiles for dq. Both recompute s and the mask; nothing of size [N, N] reaches memory
and no atomics are used, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recsys.ops._triton import dot_in_fp32, dot_input_precision

__all__ = ["BLOCK_M", "BLOCK_N", "KV_BLOCK_M", "JaggedAttentionFunction"]

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # key rows per loop step
KV_BLOCK_M = 16  # query rows per step of the key-side backward


@triton.jit
def _visible(i, j, n, history, contextual_len, max_attn_len, HAS_WINDOW: tl.constexpr):
    inside = (i < n) & (j < n)
    causal = tl.where(i < history, j <= i, (j < history) | (j == i))
    if HAS_WINDOW:
        causal = causal & (i - j < max_attn_len)
    return inside & ((j < contextual_len) | causal)


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    offsets_ptr,
    targets_ptr,
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
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (query tile, sequence x head); keys loop up to the causal bound.
    m0 = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    n = (tl.load(offsets_ptr + seq + 1) - start).to(tl.int32)
    if m0 >= n:
        return
    history = n
    if HAS_TARGETS:
        history = n - tl.load(targets_ptr + seq).to(tl.int32)
    rows = m0 + tl.arange(0, BLOCK_M)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dqk[None, :],
        mask=(rows < n)[:, None] & (dqk < D_QK)[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    end = tl.minimum(n, tl.maximum(m0 + BLOCK_M, contextual_len))
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        key_mask = cols < n
        k = tl.load(
            k_ptr + (start + cols)[:, None] * stride_kt + head * stride_kh + dqk[None, :],
            mask=key_mask[:, None] & (dqk < D_QK)[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + (start + cols)[:, None] * stride_vt + head * stride_vh + dv[None, :],
            mask=key_mask[:, None] & (dv < D_V)[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * alpha
        mask = _visible(
            rows[:, None], cols[None, :], n, history, contextual_len, max_attn_len, HAS_WINDOW
        )
        weights = tl.where(mask, s * tl.sigmoid(s), 0.0)
        acc = tl.dot(weights.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
    tl.store(
        out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dv[None, :],
        (acc * inv_n).to(out_ptr.dtype.element_ty),
        mask=(rows < n)[:, None] & (dv < D_V)[None, :],
    )


@triton.jit
def _grad_scores(
    q,
    k,
    v,
    g,
    rows,
    cols,
    n,
    history,
    alpha,
    inv_n,
    contextual_len,
    max_attn_len,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """(weights / N, ds) of one [queries, keys] tile, masked."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * alpha
    mask = _visible(
        rows[:, None], cols[None, :], n, history, contextual_len, max_attn_len, HAS_WINDOW
    )
    sig = tl.sigmoid(s)
    weights = tl.where(mask, s * sig * inv_n, 0.0)
    grad_weights = tl.dot(g, tl.trans(v), input_precision=INPUT_PRECISION) * inv_n
    ds = tl.where(mask, grad_weights * sig * (1.0 + s * (1.0 - sig)) * alpha, 0.0)
    return weights, ds


@triton.jit
def _grad_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    offsets_ptr,
    targets_ptr,
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
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (key tile, sequence x head): dk, dv summed over the query tiles that
    # can see the keys (from the tile's first key on, from 0 for contextual keys).
    n0 = tl.program_id(0) * BLOCK_N
    seq = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    n = (tl.load(offsets_ptr + seq + 1) - start).to(tl.int32)
    if n0 >= n:
        return
    history = n
    if HAS_TARGETS:
        history = n - tl.load(targets_ptr + seq).to(tl.int32)
    cols = n0 + tl.arange(0, BLOCK_N)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    key_mask = cols < n
    k = tl.load(
        k_ptr + (start + cols)[:, None] * stride_kt + head * stride_kh + dqk[None, :],
        mask=key_mask[:, None] & (dqk < D_QK)[None, :],
        other=0.0,
    )
    v = tl.load(
        v_ptr + (start + cols)[:, None] * stride_vt + head * stride_vh + dv[None, :],
        mask=key_mask[:, None] & (dv < D_V)[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dvv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    first = (n0 // BLOCK_M) * BLOCK_M
    if n0 < contextual_len:
        first = 0
    for m0 in range(first, n, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < n
        q = tl.load(
            q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dqk[None, :],
            mask=row_mask[:, None] & (dqk < D_QK)[None, :],
            other=0.0,
        )
        g = tl.load(
            g_ptr + (start + rows)[:, None] * stride_gt + head * stride_gh + dv[None, :],
            mask=row_mask[:, None] & (dv < D_V)[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            q = q.to(tl.float32)
            g = g.to(tl.float32)
        weights, ds = _grad_scores(
            q,
            k,
            v,
            g,
            rows,
            cols,
            n,
            history,
            alpha,
            inv_n,
            contextual_len,
            max_attn_len,
            HAS_WINDOW,
            INPUT_PRECISION,
        )
        dvv = tl.dot(tl.trans(weights.to(g.dtype)), g, dvv, input_precision=INPUT_PRECISION)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=INPUT_PRECISION)
    tl.store(
        dk_ptr + (start + cols)[:, None] * stride_kt + head * stride_kh + dqk[None, :],
        dk.to(dk_ptr.dtype.element_ty),
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
    dq_ptr,
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
    D_QK,
    D_V,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (query tile, sequence x head): dq summed over the visible key tiles.
    m0 = tl.program_id(0) * BLOCK_M
    seq = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    n = (tl.load(offsets_ptr + seq + 1) - start).to(tl.int32)
    if m0 >= n:
        return
    history = n
    if HAS_TARGETS:
        history = n - tl.load(targets_ptr + seq).to(tl.int32)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < n
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dqk[None, :],
        mask=row_mask[:, None] & (dqk < D_QK)[None, :],
        other=0.0,
    )
    g = tl.load(
        g_ptr + (start + rows)[:, None] * stride_gt + head * stride_gh + dv[None, :],
        mask=row_mask[:, None] & (dv < D_V)[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        g = g.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    end = tl.minimum(n, tl.maximum(m0 + BLOCK_M, contextual_len))
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        key_mask = cols < n
        k = tl.load(
            k_ptr + (start + cols)[:, None] * stride_kt + head * stride_kh + dqk[None, :],
            mask=key_mask[:, None] & (dqk < D_QK)[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + (start + cols)[:, None] * stride_vt + head * stride_vh + dv[None, :],
            mask=key_mask[:, None] & (dv < D_V)[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        _, ds = _grad_scores(
            q,
            k,
            v,
            g,
            rows,
            cols,
            n,
            history,
            alpha,
            inv_n,
            contextual_len,
            max_attn_len,
            HAS_WINDOW,
            INPUT_PRECISION,
        )
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    tl.store(
        dq_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dqk[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (dqk < D_QK)[None, :],
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
) -> dict:
    heads = q.shape[1]
    return dict(
        grid=(triton.cdiv(max(max_seq_len, 1), BLOCK_M), (offsets.numel() - 1) * heads),
        heads=heads,
        D_QK=q.shape[2],
        D_V=v.shape[2],
        HAS_TARGETS=num_targets is not None,
        HAS_WINDOW=max_attn_len > 0,
        INPUT_PRECISION=dot_input_precision(q.dtype),
        DOT_IN_FP32=dot_in_fp32(q.dtype, widened=(torch.bfloat16, torch.float16)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_DQK=max(16, triton.next_power_of_2(q.shape[2])),
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[2])),
    )


class JaggedAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, offsets, max_seq_len, alpha, num_targets, contextual_len,
    max_attn_len)``: the Triton forward and backward of ``recsys.ops.jagged_attention``."""

    @staticmethod
    def forward(
        ctx, q, k, v, offsets, max_seq_len, alpha, num_targets, contextual_len, max_attn_len
    ):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        options = _launch_options(
            q, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len
        )
        grid, heads = options.pop("grid"), options.pop("heads")
        targets = num_targets if num_targets is not None else offsets
        inv_n = 1.0 / max(max_seq_len, 1)
        if q.shape[0]:
            _forward_kernel[grid](
                q,
                k,
                v,
                offsets,
                targets,
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
                **options,
            )
        ctx.save_for_backward(q, k, v, offsets, num_targets)
        ctx.settings = (max_seq_len, alpha, contextual_len, max_attn_len, inv_n)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, offsets, num_targets = ctx.saved_tensors
        max_seq_len, alpha, contextual_len, max_attn_len, inv_n = ctx.settings
        grad = grad.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        options = _launch_options(
            q, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len
        )
        grid, heads = options.pop("grid"), options.pop("heads")
        key_grid = (triton.cdiv(max(max_seq_len, 1), BLOCK_N), grid[1])
        # The key-side kernel holds k, v, dk, dv and, per query step, q, g and two score
        # tiles: it steps 16 queries at a time on 8 warps (32 on 4 warps spilled 36-56 B on
        # sm_80 / sm_90 in fp32, 32 on 8 warps 8 B on sm_80).
        kv_options = options | {"BLOCK_M": KV_BLOCK_M}
        targets = num_targets if num_targets is not None else offsets
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
        if q.shape[0]:
            _grad_kv_kernel[key_grid](
                q,
                k,
                v,
                grad,
                offsets,
                targets,
                dk,
                dv,
                heads,
                *strides,
                alpha,
                inv_n,
                contextual_len,
                max_attn_len,
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
                dq,
                heads,
                *strides,
                alpha,
                inv_n,
                contextual_len,
                max_attn_len,
                **options,
                num_warps=8,
            )
        return dq, dk, dv, None, None, None, None, None, None
