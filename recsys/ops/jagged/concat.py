"""Concatenation of two jagged tensors sequence by sequence, and its inverse split.

Math. Two jagged tensors over the same B sequences: a [Ta, *] with ``a_offsets`` [B + 1]
(sequence b in rows ``a_offsets[b] .. a_offsets[b + 1]``, n^a_b rows) and b [Tb, *] with
``b_offsets``. Their concatenation y [Ta + Tb, *] holds, for each sequence in turn, its rows of a
then its rows of b:

    y[o_b + c]        = a[a_offsets[b] + c]       c < n^a_b
    y[o_b + n^a_b + c] = b[b_offsets[b] + c]       c < n^b_b,   o_b = a_offsets[b] + b_offsets[b]

so y's offsets are ``a_offsets + b_offsets``. :func:`jagged_split` is the inverse (the rows of
each sequence of y cut after its first n^a_b), and each is the other's backward: the gradient
of a concatenation is the split of the output's gradient, and of a split the concatenation of
the parts' gradients. (HSTU ranking joins each user's history and candidates into one sequence
and takes the candidates' states back out this way.)

Shape letters: B sequences, Ta / Tb rows of the parts, * any trailing dims (W elements a row).

Paths: :func:`jagged_concat_reference` cuts and joins one sequence at a time (the
specification); the torch path gathers every output row from ``cat([a, b])`` by an index built
without reading the device; the Triton path runs one kernel that moves the rows of one part
to their place in the joined tensor or back: one program per (sequence, W tile), looping over
the sequence's rows in tiles of ``BLOCK_R`` (no host-known longest sequence needed). A copy:
any dtype, exact and deterministic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from recsys.ops._triton import resolve_backend

__all__ = ["jagged_concat", "jagged_concat_reference", "jagged_split", "jagged_split_reference"]

BLOCK_R = 16  # rows per loop step
MAX_BLOCK_W = 256  # row elements per program
_INT_DTYPES = (torch.int32, torch.int64)  # of the offsets


def jagged_concat_reference(
    a: torch.Tensor, a_offsets: torch.Tensor, b: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's y and its offsets, one sequence at a time."""
    _check(a, a_offsets, b, b_offsets)
    starts_a, starts_b = a_offsets.tolist(), b_offsets.tolist()
    parts = []
    for s in range(len(starts_a) - 1):
        parts += [a[starts_a[s] : starts_a[s + 1]], b[starts_b[s] : starts_b[s + 1]]]
    return torch.cat([a[:0], *parts]), a_offsets + b_offsets


def jagged_split_reference(
    x: torch.Tensor, a_offsets: torch.Tensor, b_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts (a, b) whose concatenation is ``x``, one sequence at a time."""
    joined = (a_offsets + b_offsets).tolist()
    lengths = a_offsets.diff().tolist()
    a_parts, b_parts = [x[:0]], [x[:0]]
    for s, n in enumerate(lengths):
        a_parts.append(x[joined[s] : joined[s] + n])
        b_parts.append(x[joined[s] + n : joined[s + 1]])
    return torch.cat(a_parts), torch.cat(b_parts)


@triton.jit
def _move_rows_kernel(
    part_ptr,
    joined_ptr,
    part_offsets_ptr,
    other_offsets_ptr,
    width,
    OTHER_FIRST: tl.constexpr,
    TO_JOINED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Rows of one part (a: ``OTHER_FIRST`` False, b: True) of sequence ``program_id(0)``
    to their rows of the joined tensor (``TO_JOINED``) or back; W-tile ``program_id(1)``."""
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    start = tl.load(part_offsets_ptr + seq).to(tl.int64)
    rows = tl.load(part_offsets_ptr + seq + 1).to(tl.int64) - start
    # the other part's rows before this one in the joined sequence: all of a's (OTHER_FIRST:
    # a_offsets[seq + 1], counting the earlier sequences' too) or the earlier sequences' of b
    joined_start = start + tl.load(other_offsets_ptr + seq + OTHER_FIRST).to(tl.int64)
    col_mask = cols < width
    for step in range(0, rows, BLOCK_R):
        r = step + tl.arange(0, BLOCK_R)
        mask = (r < rows)[:, None] & col_mask[None, :]
        part_at = (start + r)[:, None] * width + cols[None, :]
        joined_at = (joined_start + r)[:, None] * width + cols[None, :]
        if TO_JOINED:
            tl.store(joined_ptr + joined_at, tl.load(part_ptr + part_at, mask=mask), mask=mask)
        else:
            tl.store(part_ptr + part_at, tl.load(joined_ptr + joined_at, mask=mask), mask=mask)


def _move(part, joined, part_offsets, other_offsets, other_first: bool, to_joined: bool) -> None:
    width = math.prod(joined.shape[1:])
    batch = part_offsets.numel() - 1
    if batch == 0 or width == 0 or part.shape[0] == 0:
        return
    block_w = min(MAX_BLOCK_W, triton.next_power_of_2(width))
    grid = (batch, triton.cdiv(width, block_w))
    _move_rows_kernel[grid](
        part,
        joined,
        part_offsets,
        other_offsets,
        width,
        OTHER_FIRST=other_first,
        TO_JOINED=to_joined,
        BLOCK_R=BLOCK_R,
        BLOCK_W=block_w,
    )


def _concat_triton(a, a_offsets, b, b_offsets) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    out = a.new_empty(a.shape[0] + b.shape[0], *a.shape[1:])
    _move(a, out, a_offsets, b_offsets, other_first=False, to_joined=True)
    _move(b, out, b_offsets, a_offsets, other_first=True, to_joined=True)
    return out


def _split_triton(x, a_offsets, b_offsets, num_a: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    a = x.new_empty(num_a, *x.shape[1:])
    b = x.new_empty(x.shape[0] - num_a, *x.shape[1:])
    _move(a, x, a_offsets, b_offsets, other_first=False, to_joined=False)
    _move(b, x, b_offsets, a_offsets, other_first=True, to_joined=False)
    return a, b


class JaggedConcatFunction(torch.autograd.Function):
    """``apply(a, a_offsets, b, b_offsets)``: the Triton concatenation; backward splits."""

    @staticmethod
    def forward(ctx, a, a_offsets, b, b_offsets):
        ctx.save_for_backward(a_offsets, b_offsets)
        ctx.num_a = a.shape[0]
        return _concat_triton(a, a_offsets, b, b_offsets)

    @staticmethod
    def backward(ctx, grad):
        a_offsets, b_offsets = ctx.saved_tensors
        grad_a, grad_b = _split_triton(grad, a_offsets, b_offsets, ctx.num_a)
        return grad_a, None, grad_b, None


class JaggedSplitFunction(torch.autograd.Function):
    """``apply(x, a_offsets, b_offsets, num_a)``: the Triton split; backward concatenates."""

    @staticmethod
    def forward(ctx, x, a_offsets, b_offsets, num_a):
        ctx.save_for_backward(a_offsets, b_offsets)
        return _split_triton(x, a_offsets, b_offsets, num_a)

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        a_offsets, b_offsets = ctx.saved_tensors
        grad_x = _concat_triton(grad_a, a_offsets, grad_b, b_offsets)
        return grad_x, None, None, None


def _joined_index(
    a_offsets: torch.Tensor, b_offsets: torch.Tensor, num_a: int, total: int
) -> torch.Tensor:
    """[Ta + Tb] the row of ``cat([a, b])`` each row of the joined tensor holds (no host
    read: ``total`` is host-known)."""
    a_offsets, b_offsets = a_offsets.long(), b_offsets.long()
    a_lengths = a_offsets.diff()
    joined = a_offsets + b_offsets
    seq = torch.repeat_interleave(
        torch.arange(a_lengths.numel(), device=a_offsets.device), joined.diff(), output_size=total
    )
    column = torch.arange(total, device=a_offsets.device) - joined[seq]
    in_a = column < a_lengths[seq]
    return torch.where(
        in_a, a_offsets[seq] + column, num_a + b_offsets[seq] + column - a_lengths[seq]
    )


def _check(a, a_offsets, b, b_offsets) -> None:
    for name, offsets in (("a_offsets", a_offsets), ("b_offsets", b_offsets)):
        if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} {tuple(offsets.shape)} {offsets.dtype}: expected int [B + 1]")
    if a_offsets.shape != b_offsets.shape:
        raise ValueError(
            f"a_offsets [{a_offsets.numel()}] and b_offsets [{b_offsets.numel()}]: expected the "
            "same sequences (B + 1 each)"
        )
    if a.dim() < 1 or b.dim() < 1 or a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
        raise ValueError(
            f"a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype}: expected rows of "
            "one shape and dtype"
        )


def _check_rows(offsets: torch.Tensor, rows: int, name: str) -> None:
    """Host check (a read of the device) that ``offsets`` start at 0, never decrease and end
    at ``rows``."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != rows or bool((offsets.diff() < 0).any()):
        raise ValueError(
            f"{name} run from {int(offsets[0])} to {int(offsets[-1])}: expected 0 .. {rows}, "
            "never decreasing"
        )


def jagged_concat(
    a: torch.Tensor,
    a_offsets: torch.Tensor,
    b: torch.Tensor,
    b_offsets: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's rows of ``a`` then its rows of ``b`` (the module docstring).

    Args:
        a: [Ta, *]; b: [Tb, *], rows of the same shape and dtype.
        a_offsets / b_offsets: int [B + 1] each part's row ranges.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).
        validate: check on the host that the offsets fit the rows (a read of the device).

    Returns:
        (y [Ta + Tb, *], its offsets ``a_offsets + b_offsets``), differentiable in a and b.

    Raises:
        ValueError: shapes, dtypes or offsets that do not fit (named).

    Example:
        >>> y, offsets = jagged_concat(history, history_offsets, targets, target_offsets)
    """
    _check(a, a_offsets, b, b_offsets)
    if validate:
        _check_rows(a_offsets, a.shape[0], "a_offsets")
        _check_rows(b_offsets, b.shape[0], "b_offsets")
    chosen = resolve_backend(backend, a.device, op="jagged_concat", has_triton=True)
    if chosen == "torch":
        index = _joined_index(a_offsets, b_offsets, a.shape[0], a.shape[0] + b.shape[0])
        return torch.cat([a, b])[index], a_offsets + b_offsets
    return JaggedConcatFunction.apply(a, a_offsets, b, b_offsets), a_offsets + b_offsets


def jagged_split(
    x: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    num_a: int,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts (a, b) whose :func:`jagged_concat` is ``x``: of each sequence of ``x`` (row
    ranges ``a_offsets + b_offsets``), its first ``a_offsets[b + 1] - a_offsets[b]`` rows go
    to a, the rest to b.

    Args:
        x: [Ta + Tb, *] the joined rows.
        a_offsets / b_offsets: int [B + 1] the parts' row ranges.
        num_a: Ta, a's rows (host-known: ``a_offsets[-1]``).
        backend / validate: as :func:`jagged_concat`.

    Returns:
        (a [Ta, *], b [Tb, *]), differentiable in x.

    Raises:
        ValueError: shapes or offsets that do not fit (named).
    """
    if not 0 <= num_a <= x.shape[0]:
        raise ValueError(f"num_a={num_a}: expected 0 .. the {x.shape[0]} rows of x")
    _check(x[:num_a], a_offsets, x[num_a:], b_offsets)
    if validate:
        _check_rows(a_offsets, num_a, "a_offsets")
        _check_rows(b_offsets, x.shape[0] - num_a, "b_offsets")
    chosen = resolve_backend(backend, x.device, op="jagged_split", has_triton=True)
    if chosen == "torch":
        index = _joined_index(a_offsets, b_offsets, num_a, x.shape[0])
        parts = torch.empty_like(x).index_copy(0, index, x)  # cat([a, b]): undo the gather
        return parts[:num_a], parts[num_a:]
    return JaggedSplitFunction.apply(x, a_offsets, b_offsets, num_a)
