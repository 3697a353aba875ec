"""Fused linear layer: matmul + bias + activation + dropout in one kernel (FusedMLP's layer).

For an input x [B, N_in], a weight W [N_out, N_in] (as ``nn.Linear``) and a bias b [N_out]:

    z = x @ W^T + b                 pre-activation                                   [B, N_out]
    a = act(z)                      act: relu | gelu (exact, erf) | silu | sigmoid | none
    y = a * keep / (1 - p)          dropout, in training with p > 0 only; keep ~ Bernoulli(1 - p)

and backward: dz = dy * keep / (1 - p) * act'(z),  db = sum_b dz,  dx = dz @ W,  dW = dz^T @ x.

Shapes: B batch, N_in input features (the matmul's K), N_out output features. The activations
(torch and Triton forms, and the derivatives) live in ``recsys.ops.mlp.activations``.

Backends (chosen in ``recsys.ops._triton``):

- ``triton`` (CUDA; CPU under TRITON_INTERPRET=1). Forward is one kernel: a tiled ``tl.dot``
  matmul whose epilogue adds the bias, applies the activation and dropout in registers and
  writes y. Dropout draws ``tl.rand(seed, b * N_out + n)``, a function of the seed and the
  element only (the tiling cannot change the mask), and stores the mask as bits, not floats:
  uint8 [B, ceil(N_out / 8)], bit j of byte c in row b is element (b, 8c + j), 1 = kept,
  padding bits 0. Saved for backward besides x and W: relu saves only y, which is > 0 exactly
  where the element was kept and z > 0 (and y is the next layer's input anyway, so it costs no
  memory); gelu / silu / sigmoid save z ([B, N_out] in the compute dtype) and, with dropout,
  the bitmask (B * N_out / 8 bytes, where torch eager keeps a bool mask of B * N_out bytes);
  none saves the bitmask. Backward is one kernel that turns dy into dz (unpacking the bitmask)
  and sums dz over row blocks for the bias gradient, then dx and dW are two torch matmuls
  (cuBLAS), as OneFlow's FusedMLP does.
- ``torch``: ``F.linear`` + the activation + ``F.dropout`` (torch's RNG and mask): exactly what
  a user would write, so the CPU training path runs at plain-torch speed.

Dtypes: fp32, fp16, bf16 on both backends, fp64 on ``torch`` (``auto`` sends fp64 there). The
Triton matmul accumulates in fp32 (IEEE fp32 products for fp32 inputs, TF32 only when
``torch.backends.cuda.matmul.allow_tf32`` is on, as torch does); the epilogue computes in fp32
and writes the input dtype. Under ``torch.autocast("cuda")`` the Triton path casts x, W and b to
the autocast dtype first; gradients reach fp32 parameters through that cast.

Determinism: the Triton path is deterministic (the bias gradient is reduced per row block, then
over blocks in a fixed order; no atomics), and one seed gives one mask. The torch path is as
deterministic as torch's matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from recsys.ops._triton import (
    autocast_inputs,
    dot_in_fp32,
    dot_input_precision,
    resolve_backend,
    triton_interpreted,
)
from recsys.ops.mlp.activations import (
    ACTIVATIONS,
    SAVES_PRE_ACTIVATION,
    activate,
    activate_torch,
    activation_grad,
)

__all__ = [
    "ACTIVATIONS",
    "fused_linear",
    "fused_linear_reference",
    "fused_linear_with_mask",
    "unpack_dropout_mask",
]

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "relu",
    dropout: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch specification of :func:`fused_linear` (run in float64 by the tests).

    ``keep`` is the [B, N_out] dropout mask (True = kept); dropout is applied only when it is
    given, scaling kept elements by 1 / (1 - dropout).
    """
    z = x @ weight.t()  # [B, N_out]
    if bias is not None:
        z = z + bias
    a = activate_torch(z, activation)
    if keep is not None:
        a = a * keep.to(a.dtype) / (1.0 - dropout)
    return a


def unpack_dropout_mask(mask: torch.Tensor, num_columns: int) -> torch.Tensor:
    """The bool [B, N_out] keep mask held in the Triton forward's uint8 [B, ceil(N_out / 8)]
    bitmask (bit j of byte c is column 8c + j)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # [B, ceil(N_out / 8), 8]
    return bits.flatten(1)[:, :num_columns].bool()


# ------------------------------------------------------------------------------ kernels


@triton.jit(do_not_specialize=["seed"])
def _forward_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    pre_ptr,
    mask_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    seed,
    p,
    scale,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DROPOUT: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row blocks walk the column blocks together and share W in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the end wrap around, so the loads need no mask but K's; the stores
    # drop them.
    x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = weight_ptr + (cols % N).to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = ks < K - k
        x = tl.load(x_ptrs, mask=k_left[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=k_left[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_IN_FP32:  # exact: a product of two bf16 values fits in fp32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    in_rows = rows < M
    in_cols = cols < N
    inside = in_rows[:, None] & in_cols[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    element = rows.to(tl.int64)[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N]: b * N_out + n
    if SAVE_PRE:
        tl.store(pre_ptr + element, acc.to(pre_ptr.dtype.element_ty), mask=inside)
    y = activate(acc, ACTIVATION)
    if DROPOUT:
        keep = (tl.rand(seed, element) >= p) & inside
        y = tl.where(keep, y * scale, 0.0)
        # Byte c of the tile holds columns 8c..8c+7 (BLOCK_N is a multiple of 8).
        bits = keep.to(tl.int32) << (tl.arange(0, BLOCK_N) % 8)[None, :]
        packed = tl.sum(tl.reshape(bits, (BLOCK_M, BLOCK_N // 8, 8)), axis=2)  # [BM, BN / 8]
        num_bytes = tl.cdiv(N, 8)
        byte_cols = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
        tl.store(
            mask_ptr + rows.to(tl.int64)[:, None] * num_bytes + byte_cols[None, :],
            packed.to(tl.uint8),
            mask=in_rows[:, None] & (byte_cols < num_bytes)[None, :],
        )
    tl.store(out_ptr + element, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_kernel(
    grad_out_ptr,
    saved_ptr,
    mask_ptr,
    grad_pre_ptr,
    bias_partial_ptr,
    M,
    N,
    rows_per_program,
    stride_gm,
    stride_gn,
    scale,
    ACTIVATION: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program: BLOCK_N columns of rows_per_program rows (a multiple of BLOCK_M).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    num_bytes = tl.cdiv(N, 8)
    bias_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = pid_m * rows_per_program
    for first in range(start, tl.minimum(start + rows_per_program, M), BLOCK_M):
        rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        inside = (rows < M)[:, None] & in_cols[None, :]
        element = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N]
        g = tl.load(
            grad_out_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
            mask=inside,
            other=0.0,
        ).to(tl.float32)
        if ACTIVATION == "relu":
            # saved is y: > 0 exactly where the element was kept and z > 0.
            y = tl.load(saved_ptr + element, mask=inside, other=0.0)
            g = tl.where(y > 0, g * scale, 0.0)
        else:
            if ACTIVATION != "none":
                z = tl.load(saved_ptr + element, mask=inside, other=0.0).to(tl.float32)
                g = g * activation_grad(z, ACTIVATION)
            if DROPOUT:
                byte = tl.load(
                    mask_ptr + rows[:, None] * num_bytes + cols[None, :] // 8, mask=inside, other=0
                )
                keep = (byte.to(tl.int32) >> (cols % 8)[None, :]) & 1
                g = tl.where(keep != 0, g * scale, 0.0)
        tl.store(grad_pre_ptr + element, g.to(grad_pre_ptr.dtype.element_ty), mask=inside)
        if HAS_BIAS:
            bias_sum += tl.sum(g, axis=0)
    if HAS_BIAS:
        tl.store(bias_partial_ptr + pid_m * N + cols, bias_sum, mask=in_cols)


# BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps. tl.dot needs each side >= 16.
# (128, 128, 32, 4, 4) went: 128 accumulators a thread on 4 warps, where ptxas for sm_80 fell back
# to 32 registers and 2.5 KB (relu) to 7 KB (gelu + dropout) of stack, in up to 33 s;
# (128, 128, 64, 3, 8) covers that tile.
_TENSOR_CORE_TILES = (  # bf16 / fp16, and fp32 as TF32
    (128, 256, 64, 3, 8),
    (128, 128, 64, 3, 8),
    (64, 128, 64, 4, 4),
    (128, 64, 32, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 32, 32, 4, 4),
    (64, 32, 32, 5, 2),
    (128, 16, 64, 4, 4),  # narrow outputs, such as the logit layer
)
# IEEE fp32 has no tensor-core path: tl.dot is FMAs on operands held in registers, and the tiles
# above need more than 255 registers a thread. On sm_90 they spilled (up to 18 KB of stack a
# thread) and took ptxas 4-20 s each, so autotuning a layer took minutes on an H100. These compile
# in about 2 s (at most 10) and do not spill without dropout; with it, at most 80 B
# (benchmarks/results/kernels.csv).
_FMA_TILES = (
    (128, 64, 16, 2, 8),
    (64, 128, 16, 2, 8),
    (64, 64, 32, 2, 4),
    (64, 64, 16, 3, 4),
    (32, 64, 32, 2, 4),
    (64, 32, 16, 3, 2),
)


def _matmul_configs(tiles: tuple[tuple[int, int, int, int, int], ...]) -> list[triton.Config]:
    """The autotuner's configs for ``tiles`` (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)."""
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for m, n, k, stages, warps in tiles
    ]


_forward_kernel_tuned = triton.autotune(
    configs=_matmul_configs(_TENSOR_CORE_TILES), key=["M", "N", "K"]
)(_forward_kernel)
_forward_kernel_fma = triton.autotune(configs=_matmul_configs(_FMA_TILES), key=["M", "N", "K"])(
    _forward_kernel
)
# The interpreter runs one fixed tile: tuning would only multiply its (slow) runs.
_INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}

_BACKWARD_BLOCK_M = 32
_BACKWARD_ROWS_PER_PROGRAM = 256  # partial bias sums: one fp32 row of N_out per 256 rows


# ------------------------------------------------------------------------------ launchers


def _check_triton_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"x dtype {x.dtype} is not supported by backend='triton'; expected one of "
            f"{', '.join(map(str, TRITON_DTYPES))} (use backend='torch' for others)"
        )
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} differs from x dtype {x.dtype}")
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")


def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    dropout: float,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel: (y [B, N_out], z [B, N_out] when the backward needs it,
    bitmask uint8 [B, ceil(N_out / 8)] when dropout > 0)."""
    _check_triton_inputs(x, weight, bias)
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    pre = torch.empty_like(out) if activation in SAVES_PRE_ACTIVATION else None
    mask = (
        torch.empty(M, triton.cdiv(N, 8), dtype=torch.uint8, device=x.device)
        if dropout > 0
        else None
    )
    if M == 0 or N == 0:
        return out, pre, mask
    args = (
        x,
        weight,
        bias if bias is not None else out,  # not read without a bias
        out,
        pre if pre is not None else out,  # not written unless SAVE_PRE
        mask if mask is not None else out,  # not written without dropout
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        seed,
        dropout,
        1.0 / (1.0 - dropout),
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        DROPOUT=dropout > 0,
        SAVE_PRE=pre is not None,
        INPUT_PRECISION=dot_input_precision(x.dtype),
        DOT_IN_FP32=dot_in_fp32(x.dtype),
    )
    if triton_interpreted():
        tile = _INTERPRETER_TILE
        grid = (triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"]),)
        _forward_kernel[grid](*args, **flags, **tile)
    else:

        def grid(meta: dict) -> tuple[int]:
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        fma = x.dtype == torch.float32 and flags["INPUT_PRECISION"] == "ieee"
        tuned = _forward_kernel_fma if fma else _forward_kernel_tuned
        tuned[grid](*args, **flags)
    return out, pre, mask


def _backward(
    grad_out: torch.Tensor,
    saved: torch.Tensor | None,
    mask: torch.Tensor | None,
    activation: str,
    dropout: float,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dz [B, N_out] in grad_out's dtype, and the bias gradient [N_out] in fp32 (or None)."""
    M, N = grad_out.shape
    if activation == "none" and mask is None:
        return grad_out, grad_out.sum(0, dtype=torch.float32) if bias_grad else None
    grad_pre = torch.empty(M, N, dtype=grad_out.dtype, device=grad_out.device)
    num_row_blocks = triton.cdiv(M, _BACKWARD_ROWS_PER_PROGRAM)
    partial = (
        torch.empty(num_row_blocks, N, dtype=torch.float32, device=grad_out.device)
        if bias_grad
        else None
    )
    if M > 0 and N > 0:
        block_n = min(128, max(16, triton.next_power_of_2(N)))
        grid = (triton.cdiv(N, block_n), num_row_blocks)
        _backward_kernel[grid](
            grad_out,
            saved if saved is not None else grad_out,  # not read for "none"
            mask if mask is not None else grad_out,  # not read without dropout
            grad_pre,
            partial if partial is not None else grad_pre,  # not written without a bias
            M,
            N,
            _BACKWARD_ROWS_PER_PROGRAM,
            grad_out.stride(0),
            grad_out.stride(1),
            1.0 / (1.0 - dropout),
            ACTIVATION=activation,
            DROPOUT=mask is not None,
            HAS_BIAS=partial is not None,
            BLOCK_M=_BACKWARD_BLOCK_M,
            BLOCK_N=block_n,
        )
    if partial is None:
        return grad_pre, None
    return grad_pre, partial.sum(0) if M > 0 else partial.new_zeros(N)


# ------------------------------------------------------------------------------ autograd


class _FusedLinear(torch.autograd.Function):
    """Triton forward and backward; saves x, W, and y (relu) or z (gelu / silu / sigmoid) and
    the dropout bitmask."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str,
        dropout: float,
        seed: int,
    ) -> torch.Tensor:
        out, pre, mask = _forward(x, weight, bias, activation, dropout, seed)
        saved = out if activation == "relu" else pre
        ctx.save_for_backward(x, weight, saved, mask)
        ctx.activation, ctx.dropout, ctx.has_bias = activation, dropout, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, saved, mask = ctx.saved_tensors
        needs_bias = ctx.has_bias and ctx.needs_input_grad[2]
        grad_pre, grad_bias = _backward(
            grad_out, saved, mask, ctx.activation, ctx.dropout, needs_bias
        )  # [B, N_out], [N_out]
        grad_x = grad_pre @ weight if ctx.needs_input_grad[0] else None  # [B, N_in]
        grad_weight = grad_pre.t() @ x if ctx.needs_input_grad[1] else None  # [N_out, N_in]
        if grad_bias is not None:
            grad_bias = grad_bias.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None


# ------------------------------------------------------------------------------ public API


def _validate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    dropout: float,
    seed: int | None,
) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"x must be [B, N_in] and weight [N_out, N_in], got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x has {x.shape[1]} features but weight {tuple(weight.shape)} expects "
            f"{weight.shape[1]} (weight is [N_out, N_in], as nn.Linear)"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(
            f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},) (one per output)"
        )


def _draw_seed() -> int:
    """A dropout seed from torch's default CPU generator (so torch.manual_seed fixes it)."""
    return int(torch.randint(2**31 - 1, ()).item())


def fused_linear_with_mask(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "relu",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton forward alone (no autograd), returning its dropout bitmask too.

    For tests and debugging: :func:`fused_linear` with ``backend="triton"``, ``training=True``
    and the same ``seed`` computes the same y and keeps the same elements.

    Args:
        x: [B, N_in].
        weight: [N_out, N_in].
        bias: [N_out] or None.
        activation: one of :data:`ACTIVATIONS`.
        dropout: drop probability p in [0, 1).
        seed: dropout seed.

    Returns:
        y [B, N_out] and the uint8 [B, ceil(N_out / 8)] bitmask (None when dropout is 0); see
        :func:`unpack_dropout_mask`.

    Example::

        y, mask = fused_linear_with_mask(x, w, b, dropout=0.1, seed=7)
        keep = unpack_dropout_mask(mask, w.shape[0])  # bool [B, N_out]
    """
    _validate(x, weight, bias, activation, dropout, seed)
    resolve_backend("triton", x.device, op="fused_linear", has_triton=True)
    with torch.no_grad():
        out, _, mask = _forward(x, weight, bias, activation, dropout, seed)
    return out, mask


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "relu",
    dropout: float = 0.0,
    training: bool = True,
    seed: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``dropout(act(x @ weight^T + bias))``, fused into one kernel on the Triton backend.

    Args:
        x: [B, N_in] input.
        weight: [N_out, N_in] (``nn.Linear.weight``).
        bias: [N_out] (``nn.Linear.bias``) or None.
        activation: ``"relu"``, ``"gelu"`` (exact), ``"silu"``, ``"sigmoid"`` or ``"none"``.
        dropout: drop probability p in [0, 1), applied after the activation; kept elements are
            scaled by 1 / (1 - p).
        training: dropout runs only when True (and p > 0).
        seed: the Triton path's dropout seed; None draws one from torch's default generator,
            so ``torch.manual_seed`` makes runs repeat. The torch path uses torch's RNG and
            ignores it.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``); ``auto``
            runs fp64 on ``torch``.

    Returns:
        [B, N_out] in x's dtype (the autocast dtype under CUDA autocast).

    Example::

        layer = torch.nn.Linear(13, 512)
        y = fused_linear(torch.randn(8, 13), layer.weight, layer.bias, activation="gelu")
    """
    _validate(x, weight, bias, activation, dropout, seed)
    p = dropout if training else 0.0
    resolved = resolve_backend(
        backend,
        x.device,
        op="fused_linear",
        has_triton=True,
        triton_unsupported="" if x.dtype in TRITON_DTYPES else f"dtype {x.dtype}",
    )
    if resolved == "torch":
        out = activate_torch(F.linear(x, weight, bias), activation)  # [B, N_out]
        return F.dropout(out, p, training=True) if p > 0 else out
    if p > 0 and seed is None:
        seed = _draw_seed()
    seed = 0 if seed is None else seed
    x, weight, bias = autocast_inputs(x, weight, bias)
    with torch.autocast("cuda", enabled=False):
        return _FusedLinear.apply(x, weight, bias, activation, p, seed)
