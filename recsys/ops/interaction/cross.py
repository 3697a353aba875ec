"""DCN cross layers: the DCN-v2 full-rank and low-rank forms and the DCN-v1 vector form.

Math. With x0 the cross network's input and xl the current layer's input, both [B, D]:

    full rank (DCN-v2)   u = xl W^T + b               out = x0 * u + xl      W [D, D]
    low rank             u = (xl V^T) U^T + b         out = x0 * u + xl      U [D, r], V [r, D]
    vector (DCN-v1)      s = xl w                     out = x0 * s + b + xl  w [D], s [B]

where * is elementwise (s broadcast over columns) and b [D]. Backward, with g the upstream
gradient [B, D] and gu = g * x0:

    full rank   dx0 = g * u   dxl = g + gu W    dW = gu^T xl    db = sum_b gu
    low rank    h = xl V^T, dh = gu U [B, r]:   dxl = g + dh V,  dU = gu^T h,  dV = dh^T xl
    vector      ds = sum_d g * x0 [B]   dx0 = g * s   dxl = g + ds w^T
                dw = sum_b ds xl        db = sum_b g

Shape letters: B batch, D features (the width of the cross network), r the low rank.

Dtypes: x0, xl and the parameters share one dtype: fp32, bf16, fp16 or fp64. Under CUDA
autocast the Triton path casts them all to the autocast dtype. The Triton path accumulates in
fp32 (fp64 for fp64) and writes the input dtype; fp32 matmuls are exact fp32 (IEEE, not TF32)
unless ``torch.backends.cuda.matmul.allow_tf32`` is on, as for torch's own fp32 matmul.

Triton path.

- Full and low rank (in ``recsys.ops.interaction.cross_matrix``) share
  ``_matmul_epilogue_kernel``: a tiled matmul ``acc = inner @ weight^T`` (full rank: inner =
  xl, weight = W; low rank: inner = h = xl V^T [B, r] from a cuBLAS matmul, weight = U) whose
  epilogue, in registers, writes out = x0 * (acc + b) + xl and u = acc + b. Backward reads u
  instead of redoing the matmul: ``_grad_u_kernel`` writes gu = g * x0 and dx0 = g * u in one
  pass and sums gu over its rows for db; the matmuls (dxl via ``torch.addmm``, dW, and the
  chain through V) run on cuBLAS. Saved for backward: x0, xl, the weights, h [B, r] for low
  rank, and u [B, D] when x0 needs a gradient.
- Vector form (this file): ``_vector_forward_kernel`` takes a block of whole rows, computes s
  and the output in one read of the inputs (no [B, D] intermediate) and saves s [B].
  ``_vector_backward_kernel`` writes dx0 and dxl in one pass and sums dw, db over its rows.
  Rows wider than ``VECTOR_MAX_BLOCK_D`` are walked in tiles (two reads of a row).

Deterministic: no atomics. Each bias / vector-weight gradient is summed over a fixed set of
rows per program into a [P, D] fp32 buffer, then over P with ``sum(0)``; P depends only on B,
D and the device's SM count (``recsys.ops._triton.split_rows``), so two runs on one device are
bitwise equal.

Torch path (what ``backend="auto"`` runs on every device, or ``backend="torch"``): the plain
torch expressions (``F.linear`` for the matmuls); autograd does the backward. Under CUDA
autocast "auto" first casts every input to the autocast dtype, as the Triton path does (so
the layer returns bf16 either way); ``"torch"`` leaves the casts to torch's own autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from recsys.ops._triton import (
    accumulate_dtype,
    autocast_inputs,
    resolve_backend,
    split_rows,
    triton_dtype,
)
from recsys.ops.interaction.cross_matrix import ELEMENTWISE_TILE, CrossLayerFunction

__all__ = [
    "cross_layer",
    "cross_layer_low_rank",
    "cross_layer_low_rank_reference",
    "cross_layer_reference",
    "cross_layer_vector",
    "cross_layer_vector_reference",
]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Widest row the vector kernels hold in registers in one tile; wider rows are tiled.
VECTOR_MAX_BLOCK_D = 4096


# --------------------------------------------------------------------------- references


def cross_layer_reference(
    x0: torch.Tensor, xl: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Specification of :func:`cross_layer`: ``x0 * (xl @ weight.T + bias) + xl``."""
    return x0 * (xl @ weight.T + bias) + xl


def cross_layer_low_rank_reference(
    x0: torch.Tensor,
    xl: torch.Tensor,
    u_weight: torch.Tensor,
    v_weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Specification of :func:`cross_layer_low_rank`: ``x0 * (xl V^T U^T + bias) + xl``."""
    return x0 * ((xl @ v_weight.T) @ u_weight.T + bias) + xl


def cross_layer_vector_reference(
    x0: torch.Tensor, xl: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Specification of :func:`cross_layer_vector`: ``x0 * (xl @ weight) + bias + xl``."""
    return x0 * (xl @ weight).unsqueeze(1) + bias + xl


# --------------------------------------------------------------------------- kernels


@triton.jit
def _vector_forward_kernel(
    x0_ptr,
    xl_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    s_ptr,
    B,
    D,
    ONE_TILE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    cols = tl.arange(0, BLOCK_D)
    if ONE_TILE:  # the whole row in registers: one read of each input
        col_mask = cols < D
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * D + cols[None, :]
        xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(ACC)
        s = tl.sum(xl * w[None, :], axis=1)  # [BLOCK_B]
        x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
        b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(ACC)
        out = x0 * s[:, None] + b[None, :] + xl
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        s = tl.zeros([BLOCK_B], dtype=ACC)
        for d0 in range(0, D, BLOCK_D):
            col_mask = d0 + cols < D
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * D + d0 + cols[None, :]
            xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
            w = tl.load(weight_ptr + d0 + cols, mask=col_mask, other=0.0).to(ACC)
            s += tl.sum(xl * w[None, :], axis=1)
        for d0 in range(0, D, BLOCK_D):
            col_mask = d0 + cols < D
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * D + d0 + cols[None, :]
            xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
            x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
            b = tl.load(bias_ptr + d0 + cols, mask=col_mask, other=0.0).to(ACC)
            out = x0 * s[:, None] + b[None, :] + xl
            tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, s, mask=row_mask)


@triton.jit
def _vector_backward_kernel(
    grad_ptr,
    x0_ptr,
    xl_ptr,
    weight_ptr,
    s_ptr,
    grad_x0_ptr,
    grad_xl_ptr,
    weight_partial_ptr,
    bias_partial_ptr,
    B,
    D,
    rows_per_program,
    ONE_TILE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program p owns rows [p * rows_per_program, (p + 1) * rows_per_program) and writes their
    # dw and db sums to row p of the partial buffers (fixed order, no atomics).
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, B)
    cols = tl.arange(0, BLOCK_D)
    partial = pid * D + cols
    if ONE_TILE:
        col_mask = cols < D
        w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(ACC)
        grad_weight = tl.zeros([BLOCK_D], dtype=ACC)
        grad_bias = tl.zeros([BLOCK_D], dtype=ACC)
        for start in range(first, last, BLOCK_B):
            rows = start + tl.arange(0, BLOCK_B)
            row_mask = rows < B
            mask = row_mask[:, None] & col_mask[None, :]
            offsets = rows[:, None] * D + cols[None, :]
            g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC)
            x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
            xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
            s = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
            grad_s = tl.sum(g * x0, axis=1)  # [BLOCK_B]
            grad_x0 = g * s[:, None]
            grad_xl = g + grad_s[:, None] * w[None, :]
            tl.store(grad_x0_ptr + offsets, grad_x0.to(grad_x0_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_xl_ptr + offsets, grad_xl.to(grad_xl_ptr.dtype.element_ty), mask=mask)
            grad_weight += tl.sum(grad_s[:, None] * xl, axis=0)
            grad_bias += tl.sum(g, axis=0)
        tl.store(weight_partial_ptr + partial, grad_weight, mask=col_mask)
        tl.store(bias_partial_ptr + partial, grad_bias, mask=col_mask)
    else:
        # The partial rows start at zero (the launcher allocates them so); each column tile
        # adds its rows' sums to this program's own row (no other program touches it), and a
        # barrier makes those stores visible to all the program's threads before they read
        # the row back for the next row block.
        for start in range(first, last, BLOCK_B):
            rows = start + tl.arange(0, BLOCK_B)
            row_mask = rows < B
            grad_s = tl.zeros([BLOCK_B], dtype=ACC)
            for d0 in range(0, D, BLOCK_D):
                mask = row_mask[:, None] & (d0 + cols < D)[None, :]
                offsets = rows[:, None] * D + d0 + cols[None, :]
                g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC)
                x0 = tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(ACC)
                grad_s += tl.sum(g * x0, axis=1)
            s = tl.load(s_ptr + rows, mask=row_mask, other=0.0)
            for d0 in range(0, D, BLOCK_D):
                col_mask = d0 + cols < D
                mask = row_mask[:, None] & col_mask[None, :]
                offsets = rows[:, None] * D + d0 + cols[None, :]
                g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(ACC)
                xl = tl.load(xl_ptr + offsets, mask=mask, other=0.0).to(ACC)
                w = tl.load(weight_ptr + d0 + cols, mask=col_mask, other=0.0).to(ACC)
                grad_x0 = g * s[:, None]
                grad_xl = g + grad_s[:, None] * w[None, :]
                tl.store(grad_x0_ptr + offsets, grad_x0.to(grad_x0_ptr.dtype.element_ty), mask=mask)
                tl.store(grad_xl_ptr + offsets, grad_xl.to(grad_xl_ptr.dtype.element_ty), mask=mask)
                grad_weight = tl.load(weight_partial_ptr + partial + d0, mask=col_mask)
                grad_bias = tl.load(bias_partial_ptr + partial + d0, mask=col_mask)
                grad_weight += tl.sum(grad_s[:, None] * xl, axis=0)
                grad_bias += tl.sum(g, axis=0)
                tl.store(weight_partial_ptr + partial + d0, grad_weight, mask=col_mask)
                tl.store(bias_partial_ptr + partial + d0, grad_bias, mask=col_mask)
                tl.debug_barrier()


# --------------------------------------------------------------------------- launchers


def _vector_blocks(D: int) -> tuple[int, int, bool, int]:
    """(BLOCK_B, BLOCK_D, ONE_TILE, num_warps) of the vector kernels: whole rows up to
    ``VECTOR_MAX_BLOCK_D`` wide, ``ELEMENTWISE_TILE`` elements per tile or one row, 8 elements
    per thread."""
    block_d = min(triton.next_power_of_2(D), VECTOR_MAX_BLOCK_D)
    block_b = max(1, ELEMENTWISE_TILE // block_d)
    return block_b, block_d, block_d >= D, max(8, block_b * block_d // 256)


def vector_forward(
    x0: torch.Tensor, xl: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``_vector_forward_kernel``: returns out [B, D] in x0's dtype and s = xl @ weight
    [B] in fp32 (fp64). All inputs contiguous."""
    B, D = x0.shape
    acc_dtype = accumulate_dtype(x0.dtype)
    out = torch.empty_like(x0)
    s = torch.empty(B, dtype=acc_dtype, device=x0.device)
    if B == 0:
        return out, s
    block_b, block_d, one_tile, num_warps = _vector_blocks(D)
    _vector_forward_kernel[(triton.cdiv(B, block_b),)](
        x0,
        xl,
        weight,
        bias,
        out,
        s,
        B,
        D,
        ONE_TILE=one_tile,
        ACC=triton_dtype(acc_dtype),
        BLOCK_B=block_b,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out, s


def vector_backward(
    grad: torch.Tensor, x0: torch.Tensor, xl: torch.Tensor, weight: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``_vector_backward_kernel``: returns dx0, dxl [B, D] in x0's dtype and dw, db
    [D] in fp32 (fp64). All inputs contiguous."""
    B, D = x0.shape
    acc_dtype = accumulate_dtype(x0.dtype)
    grad_x0 = torch.empty_like(x0)
    grad_xl = torch.empty_like(x0)
    block_b, block_d, one_tile, num_warps = _vector_blocks(D)
    num_programs, rows_per_program = split_rows(B, block_b, 1, x0.device)
    weight_partial = torch.zeros(num_programs, D, dtype=acc_dtype, device=x0.device)
    bias_partial = torch.zeros(num_programs, D, dtype=acc_dtype, device=x0.device)
    if B > 0:
        _vector_backward_kernel[(num_programs,)](
            grad,
            x0,
            xl,
            weight,
            s,
            grad_x0,
            grad_xl,
            weight_partial,
            bias_partial,
            B,
            D,
            rows_per_program,
            ONE_TILE=one_tile,
            ACC=triton_dtype(acc_dtype),
            BLOCK_B=block_b,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return grad_x0, grad_xl, weight_partial.sum(0), bias_partial.sum(0)


# --------------------------------------------------------------------------- autograd


class _VectorCrossLayer(torch.autograd.Function):
    """DCN-v1 layer; saves s [B] (fp32) so backward needs no reduction over xl."""

    @staticmethod
    def forward(ctx, x0, xl, weight, bias):
        out, s = vector_forward(x0, xl, weight, bias)
        ctx.save_for_backward(x0, xl, weight, s)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x0, xl, weight, s = ctx.saved_tensors
        grad_x0, grad_xl, grad_weight, grad_bias = vector_backward(
            grad_out.contiguous(), x0, xl, weight, s
        )
        need_x0, need_xl, need_weight, need_bias = ctx.needs_input_grad
        return (
            grad_x0 if need_x0 else None,
            grad_xl if need_xl else None,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(weight.dtype) if need_bias else None,
        )


# --------------------------------------------------------------------------- public API


def _check_inputs(
    x0: torch.Tensor,
    xl: torch.Tensor,
    params: dict[str, tuple[torch.Tensor, tuple[str, ...]]],
    rank: int = 0,
) -> None:
    """Raise ValueError unless x0 and xl are [B, D] and each parameter has the shape its
    letters give (D from x0, r = ``rank``), all on x0's device."""
    if x0.dim() != 2 or x0.shape[1] == 0:
        raise ValueError(f"x0 must be a [B, D] tensor with D >= 1, got shape {tuple(x0.shape)}")
    if xl.shape != x0.shape:
        raise ValueError(
            f"xl has shape {tuple(xl.shape)}, expected x0's shape [B, D] = {tuple(x0.shape)}"
        )
    sizes = {"D": x0.shape[1], "r": rank}
    for name, (tensor, letters) in params.items():
        expected = tuple(sizes[letter] for letter in letters)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected [{', '.join(letters)}] = "
                f"{expected}"
            )
    for name, tensor in [("xl", xl), *((name, t) for name, (t, _) in params.items())]:
        if tensor.device != x0.device:
            raise ValueError(f"{name} is on {tensor.device}, expected x0's device {x0.device}")


def _triton_inputs(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The Triton path's inputs: cast to the CUDA autocast dtype when autocast is on, checked
    to share one supported dtype, contiguous."""
    tensors = dict(zip(tensors, autocast_inputs(*tensors.values()), strict=True))
    dtype = tensors["x0"].dtype
    if dtype not in TRITON_DTYPES:
        supported = ", ".join(map(str, TRITON_DTYPES))
        raise ValueError(f"x0 has dtype {dtype}; the Triton path supports {supported}")
    for name, tensor in tensors.items():
        if tensor.dtype != dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected x0's dtype {dtype}")
    return [t.contiguous() for t in tensors.values()]


def _needs_u(x0: torch.Tensor) -> bool:
    """Whether backward will ask for dx0 = g * u, so forward must keep u [B, D]."""
    return torch.is_grad_enabled() and x0.requires_grad


def _backend(backend: str, x0: torch.Tensor, op: str) -> str:
    """The cross layers' backend: "auto" is the torch path on every device (the Triton kernels
    measured slower than torch eager on an H100: ``recsys.ops._triton``)."""
    return resolve_backend(backend, x0.device, op=op, has_triton=True, auto_triton=False)


def _torch_inputs(backend: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path's inputs: for ``"auto"``, cast to the CUDA autocast dtype when autocast
    is on, so the layer computes and returns what the Triton path would (bf16 in, bf16 out;
    otherwise the fp32 x0 would lift the product back to fp32); ``"torch"`` leaves them to
    torch's own autocast."""
    return autocast_inputs(*tensors) if backend == "auto" else tensors


def cross_layer(
    x0: torch.Tensor,
    xl: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One full-rank DCN-v2 cross layer: ``x0 * (xl @ weight.T + bias) + xl``.

    Args:
        x0: [B, D] input of the cross network.
        xl: [B, D] input of this layer (x0 for the first layer).
        weight: [D, D] W.
        bias: [D] b.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Returns:
        [B, D] x_{l+1}, in the inputs' dtype (the autocast dtype under CUDA autocast).

    Example::

        x = torch.randn(8, 16)
        cross_layer(x, x, torch.randn(16, 16), torch.zeros(16))  # [8, 16]
    """
    _check_inputs(x0, xl, {"weight": (weight, ("D", "D")), "bias": (bias, ("D",))})
    if _backend(backend, x0, "cross_layer") == "torch":
        x0, xl, weight, bias = _torch_inputs(backend, x0, xl, weight, bias)
        return x0 * F.linear(xl, weight, bias) + xl
    args = _triton_inputs({"x0": x0, "xl": xl, "weight": weight, "bias": bias})
    with torch.autocast("cuda", enabled=False):
        return CrossLayerFunction.apply(*args, None, _needs_u(x0))


def cross_layer_low_rank(
    x0: torch.Tensor,
    xl: torch.Tensor,
    u_weight: torch.Tensor,
    v_weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One low-rank DCN-v2 cross layer, W = U V: ``x0 * ((xl @ V.T) @ U.T + bias) + xl``.

    Args:
        x0: [B, D] input of the cross network.
        xl: [B, D] input of this layer (x0 for the first layer).
        u_weight: [D, r] U (torchrec's ``LowRankCrossNet.W_kernels``).
        v_weight: [r, D] V (torchrec's ``LowRankCrossNet.V_kernels``).
        bias: [D] b.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Returns:
        [B, D] x_{l+1}, in the inputs' dtype (the autocast dtype under CUDA autocast).

    Example::

        x = torch.randn(8, 16)
        cross_layer_low_rank(x, x, torch.randn(16, 4), torch.randn(4, 16), torch.zeros(16))
    """
    if u_weight.dim() != 2 or u_weight.shape[1] == 0:
        raise ValueError(
            f"u_weight must be a [D, r] tensor with r >= 1, got shape {tuple(u_weight.shape)}"
        )
    params = {
        "u_weight": (u_weight, ("D", "r")),
        "v_weight": (v_weight, ("r", "D")),
        "bias": (bias, ("D",)),
    }
    _check_inputs(x0, xl, params, rank=u_weight.shape[1])
    if _backend(backend, x0, "cross_layer_low_rank") == "torch":
        x0, xl, u_weight, v_weight, bias = _torch_inputs(backend, x0, xl, u_weight, v_weight, bias)
        return x0 * F.linear(F.linear(xl, v_weight), u_weight, bias) + xl
    # In CrossLayerFunction's argument order: U takes the full-rank weight's place, V comes last.
    args = _triton_inputs(
        {"x0": x0, "xl": xl, "u_weight": u_weight, "bias": bias, "v_weight": v_weight}
    )
    with torch.autocast("cuda", enabled=False):
        return CrossLayerFunction.apply(*args, _needs_u(x0))


def cross_layer_vector(
    x0: torch.Tensor,
    xl: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One DCN-v1 (vector) cross layer: ``x0 * (xl @ weight)[:, None] + bias + xl``.

    Args:
        x0: [B, D] input of the cross network.
        xl: [B, D] input of this layer (x0 for the first layer).
        weight: [D] w.
        bias: [D] b.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Returns:
        [B, D] x_{l+1}, in the inputs' dtype (the autocast dtype under CUDA autocast).

    Example::

        x = torch.randn(8, 16)
        cross_layer_vector(x, x, torch.randn(16), torch.zeros(16))  # [8, 16]
    """
    _check_inputs(x0, xl, {"weight": (weight, ("D",)), "bias": (bias, ("D",))})
    if _backend(backend, x0, "cross_layer_vector") == "torch":
        x0, xl, weight, bias = _torch_inputs(backend, x0, xl, weight, bias)
        return x0 * (xl @ weight).unsqueeze(1) + bias + xl
    args = _triton_inputs({"x0": x0, "xl": xl, "weight": weight, "bias": bias})
    with torch.autocast("cuda", enabled=False):
        return _VectorCrossLayer.apply(*args)
