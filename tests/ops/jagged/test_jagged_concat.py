"""Jagged concat and split: the torch path and the Triton kernels (interpreted) against the
per-sequence reference, forward and backward, with empty, one-row, tile-1, tile and tile+1
sequences, several row shapes and dtypes, and int32 / int64 offsets."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.jagged.concat import (
    BLOCK_R,
    jagged_concat,
    jagged_concat_reference,
    jagged_split,
    jagged_split_reference,
)

# history lengths and candidate lengths per sequence: 0, 1, tile - 1, tile, tile + 1
A_LENGTHS = [0, 1, BLOCK_R - 1, BLOCK_R, BLOCK_R + 1, 3, 0]
B_LENGTHS = [2, 0, 1, BLOCK_R + 1, BLOCK_R, 0, 0]


def _offsets(lengths, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _parts(row_shape=(5,), dtype=torch.float32, seed=0, offsets_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(A_LENGTHS), *row_shape, generator=g).to(dtype)
    b = torch.randn(sum(B_LENGTHS), *row_shape, generator=g).to(dtype)
    return a, _offsets(A_LENGTHS, offsets_dtype), b, _offsets(B_LENGTHS, offsets_dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("row_shape", "dtype", "offsets_dtype"),
    [
        ((5,), torch.float32, torch.int64),
        ((2, 3), torch.bfloat16, torch.int32),
        ((300,), torch.float32, torch.int64),  # more than one W tile
        ((), torch.float64, torch.int64),
    ],
)
def test_concat_and_split_match_the_reference_forward_and_backward(
    backend, row_shape, dtype, offsets_dtype
):
    a, a_offsets, b, b_offsets = _parts(row_shape, dtype, offsets_dtype=offsets_dtype)
    a64, b64 = (t.double().requires_grad_() for t in (a, b))
    want, want_offsets = jagged_concat_reference(a64, a_offsets, b64, b_offsets)
    a.requires_grad_(), b.requires_grad_()
    got, got_offsets = jagged_concat(a, a_offsets, b, b_offsets, backend=backend)
    assert got.dtype == dtype and torch.equal(got_offsets, want_offsets)
    assert torch.equal(got.double(), want.detach())  # a copy: exact
    grad = torch.randn(want.shape).to(dtype).double()  # representable in dtype
    want.backward(grad)
    got.backward(grad.to(dtype))
    assert torch.equal(a.grad.double(), a64.grad) and torch.equal(b.grad.double(), b64.grad)

    x = got.detach().requires_grad_()
    got_a, got_b = jagged_split(x, a_offsets, b_offsets, a.shape[0], backend=backend)
    want_a, want_b = jagged_split_reference(want.detach(), a_offsets, b_offsets)
    assert torch.equal(got_a.double(), want_a) and torch.equal(got_b.double(), want_b)
    assert torch.equal(got_a, a.detach()) and torch.equal(got_b, b.detach())  # the inverse
    grad_a, grad_b = torch.randn_like(got_a), torch.randn_like(got_b)
    (got_a * grad_a).sum().add((got_b * grad_b).sum()).backward()
    assert torch.equal(x.grad, jagged_concat_reference(grad_a, a_offsets, grad_b, b_offsets)[0])


def test_split_backward_with_one_part_unused():
    a, a_offsets, b, b_offsets = _parts()
    x = jagged_concat(a, a_offsets, b, b_offsets, backend="triton")[0].requires_grad_()
    _, got_b = jagged_split(x, a_offsets, b_offsets, a.shape[0], backend="triton")
    got_b.sum().backward()
    want = jagged_concat_reference(torch.zeros_like(a), a_offsets, torch.ones_like(b), b_offsets)
    assert torch.equal(x.grad, want[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batches_and_parts(backend):
    none = torch.zeros(1, dtype=torch.int64)
    out, offsets = jagged_concat(torch.zeros(0, 4), none, torch.zeros(0, 4), none, backend=backend)
    assert out.shape == (0, 4) and offsets.tolist() == [0]
    a = torch.randn(3, 4)
    a_offsets, b_offsets = torch.tensor([0, 1, 3]), torch.tensor([0, 0, 0])
    out, _ = jagged_concat(a, a_offsets, torch.zeros(0, 4), b_offsets, backend=backend)
    assert torch.equal(out, a)
    got_a, got_b = jagged_split(out, a_offsets, b_offsets, 3, backend=backend)
    assert torch.equal(got_a, a) and got_b.shape == (0, 4)


def test_bad_inputs_are_named():
    a, a_offsets, b, b_offsets = _parts()
    with pytest.raises(ValueError, match="expected the same sequences"):
        jagged_concat(a, a_offsets, b, b_offsets[:-1])
    with pytest.raises(ValueError, match="expected rows of one shape and dtype"):
        jagged_concat(a, a_offsets, b.double(), b_offsets)
    with pytest.raises(ValueError, match="a_offsets run from 0 to 52: expected 0 .. 51"):
        jagged_concat(a[:-1], a_offsets, b, b_offsets)
    with pytest.raises(ValueError, match="b_offsets .* expected int \\[B \\+ 1\\]"):
        jagged_concat(a, a_offsets, b, b_offsets.float())
    with pytest.raises(ValueError, match="num_a=500: expected 0 .. the 88 rows of x"):
        jagged_split(torch.cat([a, b]), a_offsets, b_offsets, 500)
