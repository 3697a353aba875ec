"""Triton path of the DCN-v2 cross layer, full rank and low rank (the matrix forms).

Math (see ``recsys.ops.interaction.cross`` for the whole op). With x0, xl [B, D]:

    full rank   u = xl W^T + b           out = x0 * u + xl      W [D, D]
    low rank    u = (xl V^T) U^T + b     out = x0 * u + xl      U [D, r], V [r, D]

Backward, with g the upstream gradient [B, D] and gu = g * x0:

    full rank   dx0 = g * u   dxl = g + gu W    dW = gu^T xl    db = sum_b gu
    low rank    h = xl V^T, dh = gu U [B, r]:   dxl = g + dh V,  dU = gu^T h,  dV = dh^T xl

Both forms share ``_matmul_epilogue_kernel``: a tiled matmul ``acc = inner @ weight^T`` (full
rank: inner = xl, weight = W; low rank: inner = h = xl V^T [B, r] from a cuBLAS matmul, weight =
U) whose epilogue, in registers, writes out = x0 * (acc + b) + xl and u = acc + b. Backward
reads u instead of redoing the matmul: ``_grad_u_kernel`` writes gu = g * x0 and dx0 = g * u in
one pass and sums gu over its rows for db; the matmuls (dxl via ``torch.addmm``, dW, and the
chain through V) run on cuBLAS. Saved for backward: x0, xl, the weights, h [B, r] for low rank,
and u [B, D] when x0 needs a gradient.

Shape letters: B batch, D features (the width of the cross network), K the matmul's inner size
(D for full rank, r for low rank), r the low rank.

Dtypes: fp32, bf16, fp16 or fp64, one for every input; accumulation in fp32 (fp64 for fp64),
outputs in the input dtype, fp32 matmuls TF32 only when torch allows it
(``recsys.ops._triton.dot_input_precision``). Deterministic: db is summed per program into a
[P, D] buffer, then over P (``recsys.ops._triton.split_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recsys.ops._triton import (
    accumulate_dtype,
    dot_in_fp32,
    dot_input_precision,
    split_rows,
    triton_dtype,
)

__all__ = ["ELEMENTWISE_TILE", "CrossLayerFunction", "elementwise_backward", "matmul_epilogue"]

# Elements per tile of the elementwise-style kernels, 8 per thread with 8 warps: larger tiles
# spill registers on sm_90 (checked with ptxas -v; the pointers are 64-bit per element).
ELEMENTWISE_TILE = 2048


# --------------------------------------------------------------------------- kernels


@triton.jit
def _matmul_epilogue_kernel(
    inner_ptr,
    weight_ptr,
    bias_ptr,
    x0_ptr,
    xl_ptr,
    out_ptr,
    u_ptr,
    B,
    D,
    K,
    stride_inner_b,
    stride_inner_k,
    stride_weight_d,
    stride_weight_k,
    STORE_U: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per [BLOCK_B, BLOCK_D] output tile; the column tiles of one row block are
    # neighbours in launch order, so they share the row block's reads through L2.
    pid = tl.program_id(0)
    num_col_blocks = tl.cdiv(D, BLOCK_D)
    rows = (pid // num_col_blocks) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = (pid % num_col_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < B
    col_mask = cols < D
    rows = rows.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    inner_ptrs = inner_ptr + rows[:, None] * stride_inner_b + k[None, :] * stride_inner_k
    weight_ptrs = weight_ptr + cols[None, :].to(tl.int64) * stride_weight_d
    weight_ptrs += k[:, None] * stride_weight_k  # weight^T tile [BLOCK_K, BLOCK_D]
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + k < K
        a = tl.load(inner_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(weight_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        inner_ptrs += BLOCK_K * stride_inner_k
        weight_ptrs += BLOCK_K * stride_weight_k
    u = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
    xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
    if STORE_U:
        tl.store(u_ptr + offsets, u.to(u_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offsets, (x0 * u + xl).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_u_kernel(
    grad_ptr,
    x0_ptr,
    u_ptr,
    grad_u_ptr,
    grad_x0_ptr,
    bias_partial_ptr,
    B,
    D,
    rows_per_program,
    WRITE_GRAD_X0: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (p, j) owns rows [p * rows_per_program, (p + 1) * rows_per_program) of column
    # tile j and writes that slice's bias-gradient sum to bias_partial[p] (fixed order).
    pid_rows = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    first = pid_rows.to(tl.int64) * rows_per_program
    grad_bias = tl.zeros([BLOCK_D], dtype=ACC)
    for start in range(first, tl.minimum(first + rows_per_program, B), BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        mask = (rows < B)[:, None] & col_mask[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC)
        x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
        grad_u = g * x0
        tl.store(grad_u_ptr + offsets, grad_u.to(grad_u_ptr.dtype.element_ty), mask=mask)
        if WRITE_GRAD_X0:
            u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(ACC)
            tl.store(grad_x0_ptr + offsets, (g * u).to(grad_x0_ptr.dtype.element_ty), mask=mask)
        grad_bias += tl.sum(grad_u, axis=0)
    tl.store(bias_partial_ptr + pid_rows * D + cols, grad_bias, mask=col_mask)


# --------------------------------------------------------------------------- launchers


def matmul_epilogue(
    inner: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    x0: torch.Tensor,
    xl: torch.Tensor,
    store_u: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch ``_matmul_epilogue_kernel``: returns out = x0 * u + xl and u = inner @ weight^T +
    bias (None unless ``store_u``), both [B, D] in x0's dtype. inner [B, K] and weight [D, K]
    may be strided views; x0, xl and bias must be contiguous."""
    B, D = x0.shape
    K = inner.shape[1]
    out = torch.empty_like(x0)
    u = torch.empty_like(x0) if store_u else None
    if B == 0:
        return out, u
    # fp32 / fp64 operands (FMAs or TF32 from registers, not 16-bit tensor-core operands) take
    # 32-row tiles on 8 warps: 64 rows spilled up to 112 B a thread on sm_80 / sm_90.
    wide = x0.dtype in (torch.float32, torch.float64)
    block_b = 32 if wide else 64
    block_d = max(16, min(128, triton.next_power_of_2(D)))
    block_k = max(16, min(32, triton.next_power_of_2(K)))
    grid = (triton.cdiv(B, block_b) * triton.cdiv(D, block_d),)
    # 64 x 128 with 4 warps spills registers on sm_90; with 8 it does not.
    _matmul_epilogue_kernel[grid](
        inner,
        weight,
        bias,
        x0,
        xl,
        out,
        u if u is not None else out,
        B,
        D,
        K,
        inner.stride(0),
        inner.stride(1),
        weight.stride(0),
        weight.stride(1),
        STORE_U=store_u,
        INPUT_PRECISION=dot_input_precision(x0.dtype),
        DOT_IN_FP32=dot_in_fp32(x0.dtype),
        ACC=triton_dtype(accumulate_dtype(x0.dtype)),
        BLOCK_B=block_b,
        BLOCK_D=block_d,
        BLOCK_K=block_k,
        num_warps=8 if block_d == 128 or wide else 4,
    )
    return out, u


def elementwise_backward(
    grad: torch.Tensor, x0: torch.Tensor, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launch ``_grad_u_kernel``: returns gu = g * x0, dx0 = g * u (None when ``u`` is None),
    both [B, D] in x0's dtype, and db = sum_b gu [D] in fp32 (fp64)."""
    B, D = x0.shape
    acc_dtype = accumulate_dtype(x0.dtype)
    grad_u = torch.empty_like(x0)
    grad_x0 = torch.empty_like(x0) if u is not None else None
    block_d = max(16, min(128, triton.next_power_of_2(D)))
    block_b = ELEMENTWISE_TILE // block_d
    num_col_blocks = triton.cdiv(D, block_d)
    num_programs, rows_per_program = split_rows(B, block_b, num_col_blocks, x0.device)
    bias_partial = torch.zeros(num_programs, D, dtype=acc_dtype, device=x0.device)
    if B == 0:
        return grad_u, grad_x0, bias_partial.sum(0)
    _grad_u_kernel[(num_programs, num_col_blocks)](
        grad,
        x0,
        u if u is not None else grad,
        grad_u,
        grad_x0 if grad_x0 is not None else grad_u,
        bias_partial,
        B,
        D,
        rows_per_program,
        WRITE_GRAD_X0=u is not None,
        ACC=triton_dtype(acc_dtype),
        BLOCK_B=block_b,
        BLOCK_D=block_d,
        num_warps=8,
    )
    return grad_u, grad_x0, bias_partial.sum(0)


# --------------------------------------------------------------------------- autograd


class CrossLayerFunction(torch.autograd.Function):
    """Full rank (``v_weight`` None: weight = W) or low rank (weight = U, ``v_weight`` = V).

    ``apply(x0, xl, weight, bias, v_weight, store_u)``: contiguous inputs of one dtype;
    ``store_u`` keeps u [B, D] for dx0 (pass whether x0 will need a gradient).
    """

    @staticmethod
    def forward(ctx, x0, xl, weight, bias, v_weight, store_u):
        inner = xl if v_weight is None else torch.mm(xl, v_weight.t())  # [B, D] or [B, r]
        out, u = matmul_epilogue(inner, weight, bias, x0, xl, store_u)
        ctx.save_for_backward(x0, xl, weight, v_weight, inner, u)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x0, xl, weight, v_weight, inner, u = ctx.saved_tensors
        _, need_xl, need_weight, need_bias, need_v, _ = ctx.needs_input_grad
        grad_u, grad_x0, grad_bias = elementwise_backward(grad_out.contiguous(), x0, u)
        grad_xl = grad_weight = grad_v = None
        if need_weight:
            grad_weight = torch.mm(grad_u.t(), inner)  # [D, D] or U's [D, r]
        if v_weight is None:
            if need_xl:
                grad_xl = torch.addmm(grad_out, grad_u, weight)
        elif need_xl or need_v:
            grad_inner = torch.mm(grad_u, weight)  # [B, r]
            if need_v:
                grad_v = torch.mm(grad_inner.t(), xl)  # [r, D]
            if need_xl:
                grad_xl = torch.addmm(grad_out, grad_inner, v_weight)
        grad_bias = grad_bias.to(weight.dtype) if need_bias else None
        return grad_x0, grad_xl, grad_weight, grad_bias, grad_v, None
