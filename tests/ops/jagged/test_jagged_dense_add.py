"""Jagged + dense per-position add: the torch path and the Triton kernels (interpreted) against
the float64 reference, forward and backward (x and the table), positions from the start or
the end, empty / 1 / tile-1 / tile / tile+1 sequences, a table shorter than a sequence."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.jagged.dense_add import BLOCK_R, jagged_dense_add, jagged_dense_add_reference

LENGTHS = [0, 1, BLOCK_R - 1, BLOCK_R, BLOCK_R + 1, 2 * BLOCK_R + 3, 0, 5]
TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float64: (0, 0)}


def _case(width=12, positions=2 * BLOCK_R + 3, dtype=torch.float32, seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), width, generator=g).to(dtype)
    dense = torch.randn(positions, width, generator=g).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return x, offsets, dense


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("from_end", [False, True])
@pytest.mark.parametrize(
    ("width", "positions", "dtype"),
    [
        (12, 2 * BLOCK_R + 3, torch.float32),  # every position reached by some sequence
        (200, 20, torch.float32),  # two D tiles; the longer sequences pass the table
        (8, 2 * BLOCK_R + 3, torch.bfloat16),
    ],
)
def test_matches_the_reference_forward_and_backward(backend, from_end, width, positions, dtype):
    x, offsets, dense = _case(width, positions, dtype)
    x.requires_grad_(), dense.requires_grad_()
    x64, dense64 = (t.detach().double().requires_grad_() for t in (x, dense))
    scale = 2.5
    want = jagged_dense_add_reference(x64, offsets, dense64, scale=scale, from_end=from_end)
    got = jagged_dense_add(x, offsets, dense, scale=scale, from_end=from_end, backend=backend)
    atol, rtol = TOLERANCE[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    grad = torch.randn(want.shape, dtype=torch.float64)
    want.backward(grad)
    got.backward(grad.to(dtype))
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol, rtol=rtol)
    # the table's gradient sums one row per sequence reaching the position
    torch.testing.assert_close(dense.grad.double(), dense64.grad, atol=4 * atol, rtol=rtol)
    assert dense64.grad.abs().sum() > 0


def test_the_triton_table_gradient_is_deterministic():
    x, offsets, dense = _case()
    grads = []
    for _ in range(2):
        table = dense.clone().requires_grad_()
        jagged_dense_add(x, offsets, table, from_end=True, backend="triton").sum().backward()
        grads.append(table.grad)
    assert torch.equal(*grads)


def test_mixed_dtypes_promote():
    x, offsets, dense = _case(dtype=torch.bfloat16)
    for backend in ("torch", "triton"):
        got = jagged_dense_add(x, offsets, dense.float(), backend=backend)
        assert got.dtype == torch.float32
    want = jagged_dense_add_reference(x, offsets, dense.float())
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


def test_gradcheck_on_a_small_case():
    x, offsets, dense = _case(width=3, positions=4, dtype=torch.float64, lengths=[2, 0, 5, 1])
    x.requires_grad_(), dense.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, t: jagged_dense_add(a, offsets, t, scale=0.5, from_end=True, backend="torch"),
        (x, dense),
    )


def test_bad_inputs_are_named():
    x, offsets, dense = _case()
    with pytest.raises(ValueError, match="expected x \\[T, D\\] and dense \\[N, D\\]"):
        jagged_dense_add(x, offsets, dense[:, :3])
    with pytest.raises(ValueError, match="offsets run from 0 to 89: expected 0 .. the 88 rows"):
        jagged_dense_add(x[:-1], offsets, dense)
    with pytest.raises(ValueError, match="Triton kernels take .*float64"):
        jagged_dense_add(x.double(), offsets, dense.double(), backend="triton")
