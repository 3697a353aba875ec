"""fused_linear against its float64 reference: forward, every gradient, dropout and its bitmask,
awkward sizes, bad inputs.

Every test of the op runs both backends where both apply: ``torch`` and ``triton`` (under the
interpreter on CPU). The Triton path's dropout mask is read back with ``fused_linear_with_mask``
(same seed); the torch path's, which is torch's own, is read off its output's zeros.
"""

import pytest
import torch

from recsys.ops.mlp import fused_linear as fused_mlp
from recsys.ops.mlp.fused_linear import (
    ACTIVATIONS,
    fused_linear,
    fused_linear_reference,
    fused_linear_with_mask,
    unpack_dropout_mask,
)

BACKENDS = ["torch", "triton"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# Largest error allowed, relative to max(1, max |expected|); bf16 is one bf16 rounding of the
# output (the interpreter truncates instead of rounding) and of dz.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_inputs(batch=37, n_in=29, n_out=45, dtype=torch.float32, bias=True, device="cpu"):
    x = torch.randn(batch, n_in, device=device).to(dtype)
    weight = (torch.randn(n_out, n_in, device=device) / max(n_in, 1) ** 0.5).to(dtype)
    b = torch.randn(n_out, device=device).to(dtype) if bias else None
    return x, weight, b


def forward_and_grads(fn, x, weight, bias, grad_out=None, x_grad=True):
    """fn(x, weight, bias) and the gradients of <fn(...), grad_out> for every input that
    requires grad (x only when ``x_grad``)."""
    x = x.detach().clone().requires_grad_(x_grad)
    weight = weight.detach().clone().requires_grad_(True)
    bias = bias.detach().clone().requires_grad_(True) if bias is not None else None
    inputs = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
    out = fn(x, weight, bias)
    if grad_out is None:
        grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad_out) if out.numel() else ()
    return out, grads, grad_out


def reference(x, weight, bias, grad_out, activation, dropout=0.0, keep=None, x_grad=True):
    """The float64 reference's output and gradients, from the same (low-precision) inputs."""
    as64 = [t.double() if t is not None else None for t in (x, weight, bias)]

    def fn(x, weight, bias):
        return fused_linear_reference(x, weight, bias, activation, dropout, keep)

    out, grads, _ = forward_and_grads(fn, *as64, grad_out.double(), x_grad=x_grad)
    return out, grads


def assert_matches(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale)


def keep_mask(out, x, weight, bias, backend, activation, dropout, seed):
    """The [B, N_out] elements the call that gave ``out`` kept: the Triton bitmask for the same
    seed, or, on torch, the non-zeros (an element that relu zeroed is 0 either way)."""
    if backend == "torch":
        return out != 0
    y, mask = fused_linear_with_mask(
        x, weight, bias, activation=activation, dropout=dropout, seed=seed
    )
    assert torch.equal(y, out.detach()), "fused_linear_with_mask and fused_linear differ"
    return unpack_dropout_mask(mask, weight.shape[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_forward_and_gradients_match_float64_reference(backend, dtype, activation, bias, dropout):
    x, weight, b = make_inputs(dtype=dtype, bias=bias)

    def fn(x, weight, bias):
        return fused_linear(
            x, weight, bias, activation=activation, dropout=dropout, seed=11, backend=backend
        )

    out, grads, grad_out = forward_and_grads(fn, x, weight, b)
    assert out.dtype == dtype and out.shape == (37, 45)
    keep = None
    if dropout > 0:
        keep = keep_mask(out, x, weight, b, backend, activation, dropout, seed=11)
        if activation != "relu":
            assert abs(keep.float().mean().item() - (1 - dropout)) < 0.05
    expected, expected_grads = reference(x, weight, b, grad_out, activation, dropout, keep)
    assert_matches(out, expected, dtype)
    assert len(grads) == len(expected_grads) == (3 if bias else 2)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == dtype
        assert_matches(grad, expected_grad, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("batch", "n_in", "n_out"),
    [(1, 1, 1), (3, 7, 9), (300, 20, 40), (5, 100, 129), (0, 4, 5)],
)
def test_awkward_sizes(backend, batch, n_in, n_out):
    # 300 rows: the bias gradient adds partial sums of two row blocks; x without a gradient, as
    # a first layer's input.
    x, weight, b = make_inputs(batch, n_in, n_out)

    def fn(x, weight, bias):
        return fused_linear(x, weight, bias, activation="gelu", backend=backend)

    out, grads, grad_out = forward_and_grads(fn, x, weight, b, x_grad=False)
    assert out.shape == (batch, n_out)
    expected, expected_grads = reference(x, weight, b, grad_out, "gelu", x_grad=False)
    assert_matches(out, expected, torch.float32)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_matches(grad, expected_grad, torch.float32)


@pytest.mark.parametrize(("batch", "n_out"), [(1, 1), (9, 9), (70, 33)])
def test_bitmask_layout_and_rate(batch, n_out):
    """Bit j of byte c of row b is element (b, 8c + j); padding bits are 0; about 1 - p kept."""
    x, weight, b = make_inputs(batch, 24, n_out)
    out, mask = fused_linear_with_mask(x, weight, b, activation="sigmoid", dropout=0.4, seed=3)
    assert mask.dtype == torch.uint8 and mask.shape == (batch, (n_out + 7) // 8)
    keep = unpack_dropout_mask(mask, n_out)
    assert torch.equal(keep, out != 0)  # sigmoid is never 0: zeros are exactly the dropped
    padding = n_out % 8
    if padding:
        assert torch.count_nonzero(mask[:, -1] >> padding) == 0
    if batch * n_out > 1000:
        assert abs(keep.float().mean().item() - 0.6) < 0.05


def test_dropout_seed_fixes_the_mask():
    x, weight, b = make_inputs()
    _, first = fused_linear_with_mask(x, weight, b, dropout=0.5, seed=123)
    _, again = fused_linear_with_mask(x, weight, b, dropout=0.5, seed=123)
    _, other = fused_linear_with_mask(x, weight, b, dropout=0.5, seed=124)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    _, none = fused_linear_with_mask(x, weight, b, dropout=0.0, seed=123)
    assert none is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_manual_seed_makes_dropout_repeat(backend):
    x, weight, b = make_inputs()
    torch.manual_seed(5)
    first = fused_linear(x, weight, b, dropout=0.5, backend=backend)
    torch.manual_seed(5)
    again = fused_linear(x, weight, b, dropout=0.5, backend=backend)
    later = fused_linear(x, weight, b, dropout=0.5, backend=backend)
    assert torch.equal(first, again)
    assert not torch.equal(first, later)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_dropout_outside_training(backend):
    x, weight, b = make_inputs()
    out = fused_linear(
        x, weight, b, activation="silu", dropout=0.5, training=False, backend=backend
    )
    expected = fused_linear_reference(x.double(), weight.double(), b.double(), "silu")
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16(backend):
    x, weight, b = make_inputs(dtype=torch.float16)

    def fn(x, weight, bias):
        return fused_linear(x, weight, bias, backend=backend)

    out, grads, grad_out = forward_and_grads(fn, x, weight, b)
    expected, expected_grads = reference(x, weight, b, grad_out, "relu")
    assert out.dtype == torch.float16
    assert_matches(out, expected, torch.float16)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_matches(grad, expected_grad, torch.float16)


def test_torch_backend_is_plain_torch():
    x, weight, b = make_inputs()
    out = fused_linear(x, weight, b, activation="gelu", backend="torch")
    assert torch.equal(out, torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, b)))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_reference_gradcheck(activation, dropout):
    x, weight, b = (t.double().requires_grad_(True) for t in make_inputs(4, 3, 5))
    keep = torch.rand(4, 5) >= dropout if dropout else None

    def fn(x, weight, bias):
        return fused_linear_reference(x, weight, bias, activation, dropout, keep)

    assert torch.autograd.gradcheck(fn, (x, weight, b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend):
    x, weight, b = make_inputs(batch=300)
    dropout = 0.3 if backend == "triton" else 0.0
    grad_out = torch.randn(300, 45)
    results = []
    for _ in range(2):

        def fn(x, weight, bias):
            return fused_linear(
                x, weight, bias, activation="silu", dropout=dropout, seed=9, backend=backend
            )

        results.append(forward_and_grads(fn, x, weight, b, grad_out))
    (out, grads, _), (out_again, grads_again, _) = results
    assert torch.equal(out, out_again)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_again, strict=True))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(activation="tanh"), "activation 'tanh'; expected one of relu, gelu, silu"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
        (dict(seed=-1), r"seed must be in \[0, 2\*\*63\)"),
        (dict(x=torch.randn(37)), r"x must be \[B, N_in\]"),
        (dict(x=torch.randn(37, 30)), "x has 30 features but weight .45, 29. expects 29"),
        (dict(bias=torch.randn(44)), r"bias has shape \(44,\), expected \(45,\)"),
        (dict(x=torch.ones(37, 29, dtype=torch.int64)), "must be floating point"),
        (dict(backend="cuda"), "backend='cuda'"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_a_clear_error(change, message, backend):
    x, weight, b = make_inputs()
    kwargs = dict(x=x, weight=weight, bias=b, backend=backend) | change
    with pytest.raises(ValueError, match=message):
        fused_linear(**kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(weight_dtype=torch.bfloat16), "weight dtype torch.bfloat16 differs from x dtype"),
        (dict(dtype=torch.float64), "float64 is not supported by backend='triton'"),
    ],
)
def test_bad_triton_input_is_a_clear_error(change, message):
    x, weight, b = make_inputs(dtype=change.get("dtype", torch.float32))
    weight = weight.to(change.get("weight_dtype", weight.dtype))
    with pytest.raises(ValueError, match=message):
        fused_linear(x, weight, b, backend="triton")


def test_backend_selection(monkeypatch):
    def no_triton(*args):
        raise AssertionError("the Triton kernels ran")

    monkeypatch.setattr(fused_mlp, "_forward", no_triton)
    x, weight, b = make_inputs()
    fused_linear(x, weight, b)  # auto on CPU: torch
    monkeypatch.setenv("RECSYS_BACKEND", "triton")
    with pytest.raises(AssertionError, match="the Triton kernels ran"):
        fused_linear(x, weight, b)
    fused_linear(x.double(), weight.double(), b.double())  # auto sends fp64 to torch
    monkeypatch.delenv("RECSYS_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        fused_linear(x, weight, b, backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_dlrm_sized_layer_triton(dtype, activation):
    x, weight, b = make_inputs(600, 479, 200, dtype=dtype)

    def fn(x, weight, bias):
        return fused_linear(
            x, weight, bias, activation=activation, dropout=0.1, seed=2, backend="triton"
        )

    out, grads, grad_out = forward_and_grads(fn, x, weight, b)
    keep = keep_mask(out, x, weight, b, "triton", activation, 0.1, seed=2)
    expected, expected_grads = reference(x, weight, b, grad_out, activation, 0.1, keep)
    assert_matches(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_matches(grad, expected_grad, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_cuda_kernels_match_float64_reference(dtype, activation, dropout):
    # fp32 at 1e-5 also checks that the matmul is IEEE fp32, not TF32 (~1e-3).
    x, weight, b = make_inputs(1000, 479, 333, dtype=dtype, device="cuda")

    def fn(x, weight, bias):
        return fused_linear(
            x, weight, bias, activation=activation, dropout=dropout, seed=4, backend="triton"
        )

    out, grads, grad_out = forward_and_grads(fn, x, weight, b)
    keep = None
    if dropout:
        keep = keep_mask(out, x, weight, b, "triton", activation, dropout, seed=4)
        assert abs(keep.float().mean().item() - (1 - dropout)) < 0.01
    expected, expected_grads = reference(x, weight, b, grad_out, activation, dropout, keep)
    assert_matches(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_matches(grad, expected_grad, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_cuda_autocast_computes_in_autocast_dtype(dtype, activation):
    x, weight, b = make_inputs(1000, 479, 333, device="cuda")

    def fn(x, weight, bias):
        with torch.autocast("cuda", dtype=dtype):
            return fused_linear(x, weight, bias, activation=activation, backend="triton")

    out, grads, grad_out = forward_and_grads(fn, x, weight, b)
    assert out.dtype == dtype
    assert [g.dtype for g in grads] == [torch.float32] * 3
    rounded = [t.to(dtype) for t in (x, weight, b)]
    expected, expected_grads = reference(*rounded, grad_out.to(dtype), activation)
    assert_matches(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_matches(grad, expected_grad, dtype)
