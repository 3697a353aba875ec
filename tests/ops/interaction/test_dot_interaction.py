import itertools

import pytest
import torch

from recsys.ops.interaction.dot import (
    dot_interaction,
    dot_interaction_reference,
    num_pairs,
    output_width,
    pair_indices,
)

BACKENDS = ("triton", "torch")


def assert_close(actual, expected):
    """fp32 tight; bf16 within a few units in the last place of the largest value (sums of
    bf16 products round once, or per partial sum in the CPU's bf16 bmm)."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual.double(), expected, rtol=2e-2, atol=1e-2 * scale)


def make_inputs(batch, num_features, dim, dtype=torch.float32, requires_grad=True):
    dense = torch.randn(batch, dim, dtype=dtype, requires_grad=requires_grad)
    sparse = torch.randn(batch, num_features, dim, dtype=dtype, requires_grad=requires_grad)
    return dense, sparse


def check_against_float64(dense, sparse, backend, **options):
    """Forward and both input gradients of ``backend`` vs the float64 reference."""
    out = dot_interaction(dense, sparse, backend=backend, **options)
    grad_out = torch.randn_like(out)
    grad_dense, grad_sparse = torch.autograd.grad(out, (dense, sparse), grad_out)

    dense64 = dense.detach().double().requires_grad_()
    sparse64 = sparse.detach().double().requires_grad_()
    expected = dot_interaction_reference(dense64, sparse64, **options)
    expected_dense, expected_sparse = torch.autograd.grad(
        expected, (dense64, sparse64), grad_out.double()
    )
    assert out.dtype == dense.dtype and out.shape == expected.shape
    assert_close(out, expected)
    assert_close(grad_dense, expected_dense)
    assert_close(grad_sparse, expected_sparse)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("batch", "num_features", "dim"),
    [(1, 1, 1), (7, 1, 16), (5, 27, 100), (3, 40, 128), (2, 27, 128), (4, 3, 129)],
)
def test_matches_float64_reference(backend, batch, num_features, dim):
    check_against_float64(*make_inputs(batch, num_features, dim), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("self_interaction", "output_padding", "pair_order"),
    list(itertools.product([False, True], [1, 8, 32], ["torchrec", "mlperf"])),
)
def test_every_option_combination(backend, self_interaction, output_padding, pair_order):
    out = check_against_float64(
        *make_inputs(3, 5, 16),
        backend,
        self_interaction=self_interaction,
        output_padding=output_padding,
        pair_order=pair_order,
    )
    assert out.shape[1] % output_padding == 0
    width = 16 + num_pairs(6, self_interaction)
    assert torch.count_nonzero(out[:, width:]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend):
    check_against_float64(*make_inputs(5, 27, 128, torch.bfloat16), backend, output_padding=8)


def test_output_layout():
    """The dense vector first, then each pair's dot product at its documented column."""
    dense, sparse = make_inputs(2, 3, 4, torch.float64, requires_grad=False)
    vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)
    for order in ("torchrec", "mlperf"):
        out = dot_interaction_reference(dense, sparse, output_padding=16, pair_order=order)
        assert out.shape == (2, 16)
        torch.testing.assert_close(out[:, :4], dense)
        for column, (i, j) in enumerate(zip(*pair_indices(4, pair_order=order), strict=True)):
            expected = (vectors[:, i] * vectors[:, j]).sum(1)
            torch.testing.assert_close(out[:, 4 + column], expected)
    rows, cols = pair_indices(4, pair_order="torchrec")
    # TorchRec's InteractionArch: the upper triangle row-major (j, i) for j < i.
    assert list(zip(cols.tolist(), rows.tolist(), strict=True)) == [
        (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)
    ]  # fmt: skip
    rows, cols = pair_indices(4, pair_order="mlperf")
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [
        (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)
    ]  # fmt: skip


def test_torchrec_order_matches_torchrec_interaction_arch():
    from torchrec.models.dlrm import InteractionArch

    dense, sparse = make_inputs(6, 5, 8, requires_grad=False)
    theirs = InteractionArch(num_sparse_features=5)(dense, sparse)
    for backend in BACKENDS:
        torch.testing.assert_close(dot_interaction(dense, sparse, backend=backend), theirs)


@pytest.mark.parametrize("self_interaction", [False, True])
def test_gradcheck_reference(self_interaction):
    dense, sparse = make_inputs(3, 4, 5, torch.float64)
    for order in ("torchrec", "mlperf"):
        assert torch.autograd.gradcheck(
            lambda d, s, order=order: dot_interaction_reference(
                d, s, self_interaction=self_interaction, output_padding=8, pair_order=order
            ),
            (dense, sparse),
        )


def test_float64_and_many_vectors_take_the_torch_path_under_auto():
    dense, sparse = make_inputs(2, 3, 4, torch.float64)
    check_against_float64(dense, sparse, "auto")
    with pytest.raises(ValueError, match="cannot serve dtype torch.float64"):
        dot_interaction(dense, sparse, backend="triton")
    dense, sparse = make_inputs(1, 128, 2, requires_grad=False)
    with pytest.raises(ValueError, match="129 vectors"):
        dot_interaction(dense, sparse, backend="triton")


def test_mixed_dtypes_are_promoted():
    dense = torch.randn(2, 8, dtype=torch.bfloat16)
    sparse = torch.randn(2, 3, 8)
    for backend in BACKENDS:
        assert dot_interaction(dense, sparse, backend=backend).dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_gradient(backend):
    dense_wide = torch.randn(4, 32, requires_grad=True)
    sparse_wide = torch.randn(4, 3, 32, requires_grad=True)
    dense, sparse = dense_wide[:, ::2], sparse_wide[:, :, 16:]  # strided views, D = 16
    out = dot_interaction(dense, sparse, backend=backend)
    grad_out = torch.randn(out.shape[1], 4).t()  # a non-contiguous upstream gradient
    grad_dense, grad_sparse = torch.autograd.grad(out, (dense_wide, sparse_wide), grad_out)

    dense64 = dense_wide.detach().double().requires_grad_()
    sparse64 = sparse_wide.detach().double().requires_grad_()
    expected = dot_interaction_reference(dense64[:, ::2], sparse64[:, :, 16:])
    expected_dense, expected_sparse = torch.autograd.grad(
        expected, (dense64, sparse64), grad_out.double()
    )
    assert_close(out, expected)
    assert_close(grad_dense, expected_dense)
    assert_close(grad_sparse, expected_sparse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend):
    dense, sparse = make_inputs(9, 27, 64)
    runs = []
    for _ in range(2):
        out = dot_interaction(dense, sparse, backend=backend, self_interaction=True)
        runs.append((out, *torch.autograd.grad(out, (dense, sparse), torch.ones_like(out))))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_empty_batch():
    dense, sparse = make_inputs(0, 3, 8)
    for backend in BACKENDS:
        out = dot_interaction(dense, sparse, backend=backend, output_padding=4)
        assert out.shape == (0, output_width(8, 4, output_padding=4))
        out.sum().backward()


def test_bad_inputs():
    dense, sparse = make_inputs(2, 3, 8, requires_grad=False)
    with pytest.raises(ValueError, match=r"dense must be \[B, D\], got shape \(2, 8, 1\)"):
        dot_interaction(dense.unsqueeze(2), sparse)
    with pytest.raises(ValueError, match=r"sparse must be \[B, F, D\]"):
        dot_interaction(dense, sparse[0])
    with pytest.raises(ValueError, match=r"expected \[2, F, 8\]"):
        dot_interaction(dense, sparse[:, :, :4])
    with pytest.raises(ValueError, match="output_padding must be >= 1, got 0"):
        dot_interaction(dense, sparse, output_padding=0)
    with pytest.raises(ValueError, match="output_padding must be an int"):
        dot_interaction(dense, sparse, output_padding=2.0)
    with pytest.raises(ValueError, match="pair_order='upper'; expected one of torchrec, mlperf"):
        dot_interaction(dense, sparse, pair_order="upper")
    with pytest.raises(ValueError, match="backend='cuda'"):
        dot_interaction(dense, sparse, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("self_interaction", [False, True])
def test_gpu_kernels_match_reference(dtype, self_interaction):
    dense, sparse = (t.detach().cuda().requires_grad_() for t in make_inputs(1023, 26, 128, dtype))
    check_against_float64(
        dense, sparse, "triton", self_interaction=self_interaction, output_padding=8
    )


@pytest.mark.gpu
def test_gpu_autocast_runs_in_bf16():
    dense, sparse = (t.detach().cuda().requires_grad_() for t in make_inputs(64, 26, 128))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dot_interaction(dense, sparse)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert dense.grad.dtype == torch.float32 and sparse.grad.dtype == torch.float32
    expected = dot_interaction_reference(dense.double(), sparse.double())
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-1)
