"""DLRM dot interaction: pairwise dot products of the dense vector and the pooled embeddings.

Math. With dense x [B, D] and pooled embeddings e [B, F, D], stack T = [x; e_1; ...; e_F]
[B, N, D] (N = F + 1 vectors per sample) and take the Gram matrix G = T T^T [B, N, N]. G is
symmetric, so one triangle holds every pair: the strict lower triangle (i > j), or with
``self_interaction`` the diagonal too (i >= j). Each output row is

    out[b] = [x_b | G_b[pairs] | 0 ... 0]                                  [B, W]

with W = D + P rounded up to a multiple of ``output_padding`` (P = N(N-1)/2, or N(N+1)/2 with
the diagonal; zero columns pad W so that the next layer's matmul gets aligned rows, as in
OneFlow's FusedDotFeatureInteraction). Two orders of the pairs:

- ``"torchrec"`` (default): TorchRec's ``InteractionArch`` order, i.e. the upper triangle in
  row-major order, (0, 1), (0, 2), ..., (0, N-1), (1, 2), ...; a TorchRec DLRM's top MLP
  weights load unchanged;
- ``"mlperf"``: the lower triangle in row-major order, (1, 0), (2, 0), (2, 1), (3, 0), ..., as
  in NVIDIA's DLRM, the MLPerf reference and OneFlow.

Backward, with g the upstream gradient [B, W]: dT = (S + S^T) T where S [B, N, N] holds the
pair gradients at the pairs' positions (so the diagonal, when kept, counts twice), and the
first D columns of g add to dx.

Shape letters: B batch, F sparse features, N = F + 1 interacting vectors, D embedding dim,
P pairs, W output width.

Dtypes: fp32, bf16 and fp16 (inputs of two dtypes are promoted as ``torch.cat`` would; under
CUDA autocast both are cast to the autocast dtype). The Triton path accumulates dot products
in fp32 and writes the input dtype; fp32 dot products are exact fp32 (IEEE, not TF32) unless
``torch.backends.cuda.matmul.allow_tf32`` is on. float64 runs on the torch path.

Triton path: one program per sample for each direction. Forward loads T tile by tile along D
(BLOCK_N x BLOCK_D, N padded to a power of two >= 16 for ``tl.dot``), accumulates G in
registers and writes x, the kept triangle and the zero padding; backward rebuilds S + S^T in
registers from the output gradient and writes dT = (S + S^T) T, so no [B, N, N] tensor ever
reaches global memory in either direction. Deterministic: no atomics, fixed summation order.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
import triton
import triton.language as tl

from recsys.ops._triton import autocast_inputs, dot_in_fp32, dot_input_precision, resolve_backend

PairOrder = Literal["torchrec", "mlperf"]
PAIR_ORDERS = ("torchrec", "mlperf")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Under the interpreter the kernels feed tl.dot fp32 for both 16-bit dtypes (the backward then
# keeps the pair gradients in fp32 too).
_DOT_IN_FP32_DTYPES = (torch.bfloat16, torch.float16)
# Registers hold a BLOCK_N x BLOCK_N Gram tile; past this many vectors the torch path serves.
TRITON_MAX_VECTORS = 128


def num_pairs(num_vectors: int, self_interaction: bool = False) -> int:
    """P: how many dot products one sample keeps."""
    return num_vectors * (num_vectors + 1 if self_interaction else num_vectors - 1) // 2


def output_width(
    embedding_dim: int, num_vectors: int, self_interaction: bool = False, output_padding: int = 1
) -> int:
    """W: D + P rounded up to a multiple of ``output_padding``."""
    width = embedding_dim + num_pairs(num_vectors, self_interaction)
    return -(-width // output_padding) * output_padding


def _pair_indices_numpy(
    num_vectors: int, self_interaction: bool, pair_order: str
) -> tuple[np.ndarray, np.ndarray]:
    # numpy, not torch: a tensor first built while torch.export traces would be a fake one,
    # and the cache would hand it to every later eager call.
    offset = 0 if self_interaction else -1
    if pair_order == "mlperf":
        rows, cols = np.tril_indices(num_vectors, offset)
    else:
        # Upper triangle row-major, i.e. the lower triangle column-major.
        cols, rows = np.triu_indices(num_vectors, -offset)
    return rows, cols


# Eager calls reuse the indices of a size. Under torch.compile the plain function is called:
# Dynamo traces through any lru_cache, ignoring it, and warns every user that a cache it skips
# might hide state ("Silent incorrectness is only a *potential* risk"). This one hides none (a
# pure function of its three arguments), so calling the function itself gives the same graph
# (the indices become constants of it) without the warning.
_pair_indices_cached = functools.lru_cache(maxsize=64)(_pair_indices_numpy)


def pair_indices(
    num_vectors: int,
    self_interaction: bool = False,
    pair_order: PairOrder = "torchrec",
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) of each output pair, in output order, with i >= j (i > j without the diagonal).

    Example::

        pair_indices(4, pair_order="mlperf")  # ([1, 2, 2, 3, 3, 3], [0, 0, 1, 0, 1, 2])
        pair_indices(4)  # torchrec: ([1, 2, 3, 2, 3, 3], [0, 0, 0, 1, 1, 2])
    """
    if torch.compiler.is_compiling():
        rows, cols = _pair_indices_numpy(num_vectors, self_interaction, pair_order)
        return torch.as_tensor(rows, device=device), torch.as_tensor(cols, device=device)
    return _pair_indices_on(num_vectors, self_interaction, pair_order, torch.device(device))


@functools.lru_cache(maxsize=64)
def _pair_indices_on(
    num_vectors: int, self_interaction: bool, pair_order: PairOrder, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pair_indices` as device tensors, built once per (shape, device): an upload of a
    host array waits for the device, so a step must not make one. Read-only: the same tensors
    are handed to every caller."""
    rows, cols = _pair_indices_cached(num_vectors, self_interaction, pair_order)
    return torch.as_tensor(rows, device=device), torch.as_tensor(cols, device=device)


def dot_interaction_reference(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    self_interaction: bool = False,
    output_padding: int = 1,
    pair_order: PairOrder = "torchrec",
) -> torch.Tensor:
    """The specification, in plain PyTorch (any dtype, float64 included)."""
    B, D = dense.shape
    combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, N, D]
    N = combined.shape[1]
    gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, N, N]
    rows, cols = pair_indices(N, self_interaction, pair_order, dense.device)
    pairs = gram[:, rows, cols]  # [B, P]
    pad = output_width(D, N, self_interaction, output_padding) - D - pairs.shape[1]
    return torch.cat([dense, pairs, dense.new_zeros(B, pad)], dim=1)  # [B, W]


def _torch_forward(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    self_interaction: bool,
    output_padding: int,
    pair_order: str,
) -> torch.Tensor:
    """The torch path: the reference, with the pairs gathered from the flattened Gram matrix
    by one ``index_select`` (its backward is one ``index_add``)."""
    B, D = dense.shape
    combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, N, D]
    N = combined.shape[1]
    gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, N, N]
    rows, cols = pair_indices(N, self_interaction, pair_order, dense.device)
    pairs = gram.view(B, N * N).index_select(1, rows * N + cols)  # [B, P]
    pad = output_width(D, N, self_interaction, output_padding) - D - pairs.shape[1]
    parts = [dense, pairs] if pad == 0 else [dense, pairs, dense.new_zeros(B, pad)]
    return torch.cat(parts, dim=1)  # [B, W]


@triton.jit
def _pair_column(a, b, N, SELF: tl.constexpr, MLPERF: tl.constexpr):
    """Output column (after the D columns of x) of the pair of vectors a >= b."""
    if MLPERF:
        return a * (a + 1) // 2 + b if SELF else a * (a - 1) // 2 + b
    return b * N - b * (b - 1) // 2 + (a - b) if SELF else b * N - b * (b + 1) // 2 + (a - b - 1)


@triton.jit
def _load_vectors(
    dense_ptr, sparse_ptr, b, d, n, N, D, stride_dense_b, stride_sparse_b, stride_sparse_f
):
    """Tile [BLOCK_N, BLOCK_D] of T = [x; e] for sample b at dims d (zero outside N x D)."""
    dmask = d < D
    x = tl.load(dense_ptr + b * stride_dense_b + d, mask=dmask, other=0.0)  # [BLOCK_D]
    emask = ((n >= 1) & (n < N))[:, None] & dmask[None, :]
    e = tl.load(
        sparse_ptr + b * stride_sparse_b + (n[:, None] - 1) * stride_sparse_f + d[None, :],
        mask=emask,
        other=0.0,
    )
    return tl.where((n == 0)[:, None], x[None, :], e), x


@triton.jit
def _dot_forward_kernel(
    dense_ptr,
    sparse_ptr,
    out_ptr,
    N,
    D,
    P,
    W,
    stride_dense_b,
    stride_sparse_b,
    stride_sparse_f,
    stride_out_b,
    SELF: tl.constexpr,
    MLPERF: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    out_row = out_ptr + b * stride_out_b
    gram = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        t, x = _load_vectors(
            dense_ptr, sparse_ptr, b, d, n, N, D, stride_dense_b, stride_sparse_b, stride_sparse_f
        )
        tl.store(out_row + d, x, mask=d < D)
        if DOT_IN_FP32:
            t = t.to(tl.float32)
        gram = tl.dot(t, tl.trans(t), gram, input_precision=INPUT_PRECISION)
    i = n[:, None]
    j = n[None, :]
    keep = ((j <= i) if SELF else (j < i)) & (i < N)
    column = _pair_column(i, j, N, SELF, MLPERF)
    tl.store(out_row + D + column, gram.to(out_ptr.dtype.element_ty), mask=keep)
    pad = D + P + tl.arange(0, BLOCK_PAD)
    zeros = tl.zeros([BLOCK_PAD], dtype=out_ptr.dtype.element_ty)
    tl.store(out_row + pad, zeros, mask=pad < W)


@triton.jit
def _dot_backward_kernel(
    grad_out_ptr,
    dense_ptr,
    sparse_ptr,
    grad_dense_ptr,
    grad_sparse_ptr,
    N,
    D,
    stride_grad_out_b,
    stride_dense_b,
    stride_sparse_b,
    stride_sparse_f,
    stride_grad_dense_b,
    stride_grad_sparse_b,
    stride_grad_sparse_f,
    SELF: tl.constexpr,
    MLPERF: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    grad_row = grad_out_ptr + b * stride_grad_out_b
    i = n[:, None]
    j = n[None, :]
    hi = tl.maximum(i, j)
    lo = tl.minimum(i, j)
    kept = (hi < N) if SELF else (hi < N) & (i != j)
    column = _pair_column(hi, lo, N, SELF, MLPERF)
    # S + S^T: each pair's gradient at (i, j) and (j, i); a kept diagonal counts twice.
    sym = tl.load(grad_row + D + column, mask=kept, other=0.0).to(tl.float32)
    if SELF:
        sym = tl.where(i == j, 2.0 * sym, sym)
    if not DOT_IN_FP32:
        sym = sym.to(dense_ptr.dtype.element_ty)  # exact: a gradient in the output's dtype, or 2x
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dmask = d < D
        t, _ = _load_vectors(
            dense_ptr, sparse_ptr, b, d, n, N, D, stride_dense_b, stride_sparse_b, stride_sparse_f
        )
        if DOT_IN_FP32:
            t = t.to(tl.float32)
        grad_t = tl.dot(sym, t, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_D], fp32
        passthrough = tl.load(grad_row + d, mask=dmask, other=0.0).to(tl.float32)
        grad_x = tl.sum(tl.where((n == 0)[:, None], grad_t, 0.0), axis=0) + passthrough
        tl.store(
            grad_dense_ptr + b * stride_grad_dense_b + d,
            grad_x.to(grad_dense_ptr.dtype.element_ty),
            mask=dmask,
        )
        emask = ((n >= 1) & (n < N))[:, None] & dmask[None, :]
        tl.store(
            grad_sparse_ptr
            + b * stride_grad_sparse_b
            + (n[:, None] - 1) * stride_grad_sparse_f
            + d[None, :],
            grad_t.to(grad_sparse_ptr.dtype.element_ty),
            mask=emask,
        )


def _blocks(num_vectors: int, dim: int, fp32: bool) -> tuple[int, int, int]:
    """BLOCK_N, BLOCK_D and num_warps for N vectors of dim D (``tl.dot`` needs sides >= 16).
    fp32 takes narrower tiles on more warps past N = 16: an exact fp32 ``tl.dot`` is FMAs on
    operands held in registers, where the 16-bit tiles spilled 0.5-12 KB a thread on sm_80 /
    sm_90. The backward still spills for exact fp32 past N = 64 (benchmarks/results/kernels.csv
    says why)."""
    block_n = max(16, triton.next_power_of_2(num_vectors))
    if fp32 and block_n > 16:
        widest, num_warps = (32, 4) if block_n <= 32 else (16, 8)
    else:
        widest, num_warps = (64, 2) if block_n <= 32 else (32, 4)
    return block_n, max(16, min(triton.next_power_of_2(dim), widest)), num_warps


def _forward_triton(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    self_interaction: bool,
    output_padding: int,
    pair_order: str,
) -> torch.Tensor:
    B, D = dense.shape
    N = sparse.shape[1] + 1
    P = num_pairs(N, self_interaction)
    W = output_width(D, N, self_interaction, output_padding)
    out = torch.empty(B, W, dtype=dense.dtype, device=dense.device)
    if B == 0:
        return out
    block_n, block_d, num_warps = _blocks(N, D, dense.dtype == torch.float32)
    _dot_forward_kernel[(B,)](
        dense,
        sparse,
        out,
        N,
        D,
        P,
        W,
        dense.stride(0),
        sparse.stride(0),
        sparse.stride(1),
        out.stride(0),
        SELF=self_interaction,
        MLPERF=pair_order == "mlperf",
        INPUT_PRECISION=dot_input_precision(dense.dtype),
        DOT_IN_FP32=dot_in_fp32(dense.dtype, _DOT_IN_FP32_DTYPES),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_PAD=max(1, triton.next_power_of_2(W - D - P)),
        num_warps=num_warps,
    )
    return out


def _backward_triton(
    grad_out: torch.Tensor,
    dense: torch.Tensor,
    sparse: torch.Tensor,
    self_interaction: bool,
    pair_order: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, D = dense.shape
    N = sparse.shape[1] + 1
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    grad_dense = torch.empty_like(dense)
    grad_sparse = torch.empty_like(sparse)
    if B == 0:
        return grad_dense, grad_sparse
    block_n, block_d, num_warps = _blocks(N, D, dense.dtype == torch.float32)
    _dot_backward_kernel[(B,)](
        grad_out,
        dense,
        sparse,
        grad_dense,
        grad_sparse,
        N,
        D,
        grad_out.stride(0),
        dense.stride(0),
        sparse.stride(0),
        sparse.stride(1),
        grad_dense.stride(0),
        grad_sparse.stride(0),
        grad_sparse.stride(1),
        SELF=self_interaction,
        MLPERF=pair_order == "mlperf",
        INPUT_PRECISION=dot_input_precision(dense.dtype),
        DOT_IN_FP32=dot_in_fp32(dense.dtype, _DOT_IN_FP32_DTYPES),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return grad_dense, grad_sparse


class _DotInteraction(torch.autograd.Function):
    """Triton forward and backward; saves only the inputs."""

    @staticmethod
    def forward(
        ctx,
        dense: torch.Tensor,
        sparse: torch.Tensor,
        self_interaction: bool,
        output_padding: int,
        pair_order: str,
    ) -> torch.Tensor:
        ctx.save_for_backward(dense, sparse)
        ctx.self_interaction, ctx.pair_order = self_interaction, pair_order
        return _forward_triton(dense, sparse, self_interaction, output_padding, pair_order)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dense, sparse = ctx.saved_tensors
        grad_dense, grad_sparse = _backward_triton(
            grad_out, dense, sparse, ctx.self_interaction, ctx.pair_order
        )
        return grad_dense, grad_sparse, None, None, None


def _validate(
    dense: torch.Tensor, sparse: torch.Tensor, output_padding: int, pair_order: str
) -> None:
    if dense.dim() != 2:
        raise ValueError(f"dense must be [B, D], got shape {tuple(dense.shape)}")
    if sparse.dim() != 3:
        raise ValueError(f"sparse must be [B, F, D], got shape {tuple(sparse.shape)}")
    if sparse.shape[0] != dense.shape[0] or sparse.shape[2] != dense.shape[1]:
        raise ValueError(
            f"sparse {tuple(sparse.shape)} does not match dense {tuple(dense.shape)}: expected "
            f"[{dense.shape[0]}, F, {dense.shape[1]}]"
        )
    if sparse.device != dense.device:
        raise ValueError(f"dense is on {dense.device} but sparse is on {sparse.device}")
    if isinstance(output_padding, bool) or not isinstance(output_padding, int):
        raise ValueError(f"output_padding must be an int >= 1, got {output_padding!r}")
    if output_padding < 1:
        raise ValueError(f"output_padding must be >= 1, got {output_padding}")
    if pair_order not in PAIR_ORDERS:
        raise ValueError(f"pair_order={pair_order!r}; expected one of {', '.join(PAIR_ORDERS)}")


def dot_interaction(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    *,
    self_interaction: bool = False,
    output_padding: int = 1,
    pair_order: PairOrder = "torchrec",
    backend: str = "auto",
) -> torch.Tensor:
    """``[x | pairwise dot products of [x; e] | zero padding]`` per sample.

    Args:
        dense: x, [B, D] (the bottom MLP's output).
        sparse: e, [B, F, D] (the pooled embeddings).
        self_interaction: keep each vector's dot product with itself (the diagonal) too.
        output_padding: round the output width up to a multiple of this (1: no padding).
        pair_order: ``"torchrec"`` (TorchRec's InteractionArch order) or ``"mlperf"`` (lower
            triangle row-major, as NVIDIA's DLRM and OneFlow); see the module docstring.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``); ``auto``
            takes the torch path for float64 and for more than 128 vectors.

    Returns:
        [B, W], W = D + P rounded up to a multiple of ``output_padding`` (see
        :func:`output_width`), in the inputs' (promoted or autocast) dtype.

    Raises:
        ValueError: mismatched shapes or devices, a bad ``output_padding`` or ``pair_order``,
            or ``backend="triton"`` for a dtype or size it does not serve.

    Example::

        out = dot_interaction(torch.randn(4, 16), torch.randn(4, 26, 16))  # [4, 16 + 351]
    """
    _validate(dense, sparse, output_padding, pair_order)
    dense, sparse = autocast_inputs(dense, sparse)
    dtype = torch.promote_types(dense.dtype, sparse.dtype)  # the autocast dtype under autocast
    dense, sparse = dense.to(dtype), sparse.to(dtype)
    num_vectors = sparse.shape[1] + 1
    unsupported = ""
    if dtype not in TRITON_DTYPES:
        unsupported = f"dtype {dtype} (the Triton path takes fp32, bf16 and fp16)"
    elif num_vectors > TRITON_MAX_VECTORS:
        unsupported = f"{num_vectors} vectors (the Triton path takes at most {TRITON_MAX_VECTORS})"
    backend = resolve_backend(
        backend,
        dense.device,
        op="dot_interaction",
        has_triton=True,
        triton_unsupported=unsupported,
    )
    if backend == "torch":
        return _torch_forward(dense, sparse, self_interaction, output_padding, pair_order)
    if unsupported:
        raise ValueError(f"backend='triton' for dot_interaction cannot serve {unsupported}")
    dense = dense if dense.stride(-1) == 1 else dense.contiguous()
    sparse = sparse if sparse.stride(-1) == 1 else sparse.contiguous()
    with torch.autocast("cuda", enabled=False):
        return _DotInteraction.apply(dense, sparse, self_interaction, output_padding, pair_order)
