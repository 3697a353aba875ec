"""A jagged tensor plus a dense per-position one: ``y = scale * x + dense[position]``.

Math. A jagged x [T, D] over B sequences (sequence b in rows ``offsets[b] .. offsets[b + 1]``,
n_b rows) and a dense table [N, D] indexed by position, shared by the sequences. Row c of
sequence b (c < n_b) is at position p = c, or p = n_b - 1 - c with ``from_end`` (positions
counted back from the sequence's last row; the sequence models take either, by their
``positions``):

    y[offsets[b] + c] = scale * x[offsets[b] + c] + dense[p]          (dense[p] = 0 for p >= N)

Backward: dx = scale * dy, and d dense[p] = sum over the sequences with a row at position p
of dy at that row (0 for a position no sequence reaches). This is the input layer of HSTU and
SASRec: item vectors scaled by sqrt(D) plus learned positions, jagged, no padding.

Shape letters: T rows, B sequences, D row width, N positions of the table.

Paths: :func:`jagged_dense_add_reference` one sequence at a time in float64 (the
specification); the torch path gathers ``dense`` by each row's position (index built without
reading the device) and adds; the Triton path fuses the scale, gather and add: forward one
program per (sequence, D tile) looping over its rows in tiles of ``BLOCK_R``; the table's
gradient one program per (position tile, D tile, chunk of sequences) looping over its
sequences in a fixed order into an fp32 partial sum, the chunks' partials then summed (no
atomics: deterministic on a device). Dtypes: x and dense fp32 / bf16 / fp16 (y in their
promoted dtype; fp64 runs on the torch path), fp32 arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from recsys.ops._triton import resolve_backend, split_rows

__all__ = ["jagged_dense_add", "jagged_dense_add_reference"]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_R = 16  # rows (forward) or positions (table gradient) per step
MAX_BLOCK_D = 128


def jagged_dense_add_reference(
    x: torch.Tensor,
    offsets: torch.Tensor,
    dense: torch.Tensor,
    *,
    scale: float = 1.0,
    from_end: bool = False,
) -> torch.Tensor:
    """The module docstring's y, one sequence at a time in float64 (returned as float64;
    differentiable in x and dense)."""
    _check(x, offsets, dense)
    out = []
    bounds = offsets.tolist()
    table = dense.double()
    for b in range(len(bounds) - 1):
        rows = x[bounds[b] : bounds[b + 1]].double()
        n = rows.shape[0]
        positions = torch.arange(n, device=x.device)
        if from_end:
            positions = n - 1 - positions
        added = torch.zeros_like(rows)
        reached = positions < table.shape[0]
        added[reached] = table[positions[reached]]
        out.append(scale * rows + added)
    return torch.cat([x[:0].double(), *out])


def _check(x: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> None:
    if x.dim() != 2 or dense.dim() != 2 or dense.shape[1] != x.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} and dense {tuple(dense.shape)}: expected x [T, D] and "
            "dense [N, D]"
        )
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets {tuple(offsets.shape)} {offsets.dtype}: expected int [B + 1]")


def _positions(offsets: torch.Tensor, total: int, from_end: bool) -> torch.Tensor:
    """[T] each row's position (no host read: ``total`` is host-known)."""
    offsets = offsets.long()
    lengths = offsets.diff()
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total
    )
    column = torch.arange(total, device=offsets.device) - offsets[seq]
    return lengths[seq] - 1 - column if from_end else column


def _torch_path(x, offsets, dense, scale: float, from_end: bool) -> torch.Tensor:
    position = _positions(offsets, x.shape[0], from_end)
    reached = position < dense.shape[0]
    gathered = dense[position.clamp(max=max(dense.shape[0] - 1, 0))]
    if dense.shape[0] == 0:
        gathered = dense.new_zeros(x.shape[0], x.shape[1])
    return scale * x + torch.where(reached[:, None], gathered, 0.0)


@triton.jit
def _forward_kernel(
    x_ptr,
    dense_ptr,
    out_ptr,
    offsets_ptr,
    num_positions,
    width,
    scale,
    FROM_END: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + seq).to(tl.int64)
    rows = tl.load(offsets_ptr + seq + 1).to(tl.int64) - start
    col_mask = cols < width
    for step in range(0, rows, BLOCK_R):
        c = step + tl.arange(0, BLOCK_R)
        inside = c < rows
        p = rows - 1 - c if FROM_END else c
        mask = inside[:, None] & col_mask[None, :]
        at = (start + c)[:, None] * width + cols[None, :]
        x = tl.load(x_ptr + at, mask=mask).to(tl.float32)
        table_mask = mask & (p < num_positions)[:, None]
        added = tl.load(dense_ptr + p[:, None] * width + cols[None, :], mask=table_mask, other=0.0)
        y = scale * x + added.to(tl.float32)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_dense_kernel(
    grad_ptr,
    partial_ptr,
    offsets_ptr,
    num_sequences,
    num_positions,
    width,
    seqs_per_program,
    FROM_END: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Partial table gradient [num_positions, width] of the sequences of chunk
    ``program_id(2)``, position tile ``program_id(0)``, column tile ``program_id(1)``."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chunk = tl.program_id(2)
    col_mask = cols < width
    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    first = chunk * seqs_per_program
    last = tl.minimum(first + seqs_per_program, num_sequences)
    for seq in range(first, last):  # a fixed order: deterministic sums
        start = tl.load(offsets_ptr + seq).to(tl.int64)
        rows = tl.load(offsets_ptr + seq + 1).to(tl.int64) - start
        c = rows - 1 - p if FROM_END else p.to(tl.int64)
        mask = ((p < rows) & (p < num_positions))[:, None] & col_mask[None, :]
        at = (start + c)[:, None] * width + cols[None, :]
        acc += tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
    store_mask = (p < num_positions)[:, None] & col_mask[None, :]
    out_at = (chunk.to(tl.int64) * num_positions + p[:, None]) * width + cols[None, :]
    tl.store(partial_ptr + out_at, acc, mask=store_mask)


def _block_d(width: int) -> int:
    return min(MAX_BLOCK_D, max(16, triton.next_power_of_2(width)))


def _grad_dense(
    grad: torch.Tensor, offsets: torch.Tensor, num_positions: int, from_end: bool
) -> torch.Tensor:
    """fp32 [N, D] the table's gradient: the sequences cut into chunks (``split_rows``: about
    4 programs per SM), one fp32 partial sum per chunk, summed here (deterministic on a
    device)."""
    batch, width = offsets.numel() - 1, grad.shape[1]
    if not (num_positions and width and batch):
        return grad.new_zeros(num_positions, width, dtype=torch.float32)
    block_d = _block_d(width)
    tiles = triton.cdiv(num_positions, BLOCK_R) * triton.cdiv(width, block_d)
    chunks, per_chunk = split_rows(batch, 1, tiles, grad.device)
    partial = grad.new_empty(chunks, num_positions, width, dtype=torch.float32)
    grid = (triton.cdiv(num_positions, BLOCK_R), triton.cdiv(width, block_d), chunks)
    _grad_dense_kernel[grid](
        grad,
        partial,
        offsets,
        batch,
        num_positions,
        width,
        per_chunk,
        FROM_END=from_end,
        BLOCK_P=BLOCK_R,
        BLOCK_D=block_d,
    )
    return partial.sum(0) if chunks > 1 else partial[0]


class JaggedDenseAddFunction(torch.autograd.Function):
    """``apply(x, offsets, dense, scale, from_end)``: the Triton forward and backward of
    :func:`jagged_dense_add`."""

    @staticmethod
    def forward(ctx, x, offsets, dense, scale, from_end):
        x, dense = x.contiguous(), dense.contiguous()
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, dense.dtype), device=x.device)
        batch, width = offsets.numel() - 1, x.shape[1]
        block_d = _block_d(width)
        if x.shape[0] and width:
            _forward_kernel[(batch, triton.cdiv(width, block_d))](
                x,
                dense,
                out,
                offsets,
                dense.shape[0],
                width,
                scale,
                FROM_END=from_end,
                BLOCK_R=BLOCK_R,
                BLOCK_D=block_d,
            )
        ctx.save_for_backward(offsets)
        ctx.settings = (scale, from_end, x.dtype, dense.dtype, dense.shape[0])
        return out

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        scale, from_end, x_dtype, dense_dtype, num_positions = ctx.settings
        grad = grad.contiguous()
        grad_x = (grad * scale).to(x_dtype) if ctx.needs_input_grad[0] else None
        grad_dense = None
        if ctx.needs_input_grad[2]:
            grad_dense = _grad_dense(grad, offsets, num_positions, from_end).to(dense_dtype)
        return grad_x, None, grad_dense, None, None


def jagged_dense_add(
    x: torch.Tensor,
    offsets: torch.Tensor,
    dense: torch.Tensor,
    *,
    scale: float = 1.0,
    from_end: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """``scale * x + dense[position]`` on jagged rows (the module docstring).

    Args:
        x: [T, D] jagged rows.
        offsets: int [B + 1] the sequences' row ranges (``offsets[0] = 0``).
        dense: [N, D] one row per position; a row past N gets nothing added.
        scale: multiplies x.
        from_end: positions counted back from each sequence's last row (0 there).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).
        validate: check on the host that the offsets fit x (a read of the device).

    Returns:
        y [T, D] in the promoted dtype of x and dense, differentiable in both.

    Raises:
        ValueError: shapes or offsets that do not fit (named), or a backend that cannot run.

    Example:
        >>> x = jagged_dense_add(items, offsets, positions.weight, scale=8.0, from_end=True)
    """
    _check(x, offsets, dense)
    if validate and (int(offsets[0]) != 0 or int(offsets[-1]) != x.shape[0]):
        raise ValueError(
            f"offsets run from {int(offsets[0])} to {int(offsets[-1])}: expected 0 .. the "
            f"{x.shape[0]} rows of x"
        )
    if validate and bool((offsets.diff() < 0).any()):
        raise ValueError(f"offsets decrease at sequence {int(offsets.diff().argmin())}")
    dtypes = {x.dtype, dense.dtype}
    unsupported = "" if dtypes <= set(TRITON_DTYPES) else f"dtypes {sorted(map(str, dtypes))}"
    chosen = resolve_backend(
        backend, x.device, op="jagged_dense_add", has_triton=True, triton_unsupported=unsupported
    )
    if chosen == "triton" and unsupported:
        raise ValueError(f"jagged_dense_add's Triton kernels take {TRITON_DTYPES}: {unsupported}")
    if chosen == "torch":
        return _torch_path(x, offsets, dense, scale, from_end)
    # No autocast cast: like torch's own elementwise ops, the add keeps its inputs' dtypes (a
    # residual stream started here stays fp32 under bf16 autocast).
    return JaggedDenseAddFunction.apply(x, offsets, dense, float(scale), from_end)
