"""DCN cross layers (full rank, low rank, vector) against their float64 references: forward and
every gradient, awkward sizes, option combinations, bad inputs, determinism.

Every test of an op runs both backends: ``torch`` and ``triton`` (under the interpreter on CPU).
"""

from types import SimpleNamespace

import pytest
import torch

from recsys.ops._triton import HAS_TRITON
from recsys.ops.interaction import cross as cross_interaction
from recsys.ops.interaction.cross import (
    cross_layer,
    cross_layer_low_rank,
    cross_layer_low_rank_reference,
    cross_layer_reference,
    cross_layer_vector,
    cross_layer_vector_reference,
)

FORMS = ["full", "low_rank", "vector"]
BACKENDS = ["torch", "triton"]
OPS = {
    "full": (cross_layer, cross_layer_reference),
    "low_rank": (cross_layer_low_rank, cross_layer_low_rank_reference),
    "vector": (cross_layer_vector, cross_layer_vector_reference),
}
# Largest error allowed, relative to the largest magnitude of the float64 result. The observed
# errors are about 30x smaller; a wrong term gives errors of order 1.
TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 3e-2,
}


def make_inputs(form, batch_size, dim, rank=3, dtype=torch.float32, device="cpu"):
    """[x0, xl, *parameters] of ``form``; weights scaled like xavier init so values stay O(1)."""
    x0 = torch.randn(batch_size, dim, device=device)
    xl = torch.randn(batch_size, dim, device=device)
    bias = torch.randn(dim, device=device)
    if form == "full":
        params = [torch.randn(dim, dim, device=device) / dim**0.5, bias]
    elif form == "low_rank":
        u_weight = torch.randn(dim, rank, device=device) / rank**0.5
        v_weight = torch.randn(rank, dim, device=device) / dim**0.5
        params = [u_weight, v_weight, bias]
    else:
        params = [torch.randn(dim, device=device) / dim**0.5, bias]
    return [t.to(dtype) for t in (x0, xl, *params)]


def forward_and_grads(form, inputs, backend, upstream=None):
    """The op's output and the gradients of every input that requires grad (None elsewhere)."""
    op = OPS[form][0]
    out = op(*inputs, backend=backend)
    upstream = torch.randn_like(out) if upstream is None else upstream
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, upstream))
    return out, [next(grads) if t.requires_grad else None for t in inputs], upstream


def reference_and_grads(form, inputs, upstream):
    """The float64 reference's output and gradients w.r.t. every input."""
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    out = OPS[form][1](*leaves)
    return out, list(torch.autograd.grad(out, leaves, upstream.double()))


def assert_close_to_reference(actual, expected, dtype):
    expected = expected.detach()
    tolerance = TOLERANCE[dtype]
    scale = max(float(expected.abs().max()), 1.0) if expected.numel() else 1.0
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance * scale)


def check_against_reference(form, inputs, backend, dtype):
    for t in inputs:
        t.requires_grad_(True)
    out, grads, upstream = forward_and_grads(form, inputs, backend)
    ref_out, ref_grads = reference_and_grads(form, inputs, upstream)
    assert out.shape == inputs[0].shape
    assert_close_to_reference(out, ref_out, dtype)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close_to_reference(grad, ref_grad, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dim", [1, 16, 100, 128])
@pytest.mark.parametrize("batch_size", [1, 7, 33])
def test_forward_and_gradients_match_float64_reference(form, backend, dim, batch_size):
    inputs = make_inputs(form, batch_size, dim, rank=min(dim, 3))
    check_against_reference(form, inputs, backend, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [1, 16, 33])
def test_low_rank_ranks(rank, backend):
    # rank 33 takes two K steps of the Triton matmul (BLOCK_K = 32).
    inputs = make_inputs("low_rank", 9, 100, rank=rank)
    check_against_reference("low_rank", inputs, backend, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [16, 100])
def test_half_precision_matches_float64_reference(form, backend, dtype, dim):
    inputs = make_inputs(form, 33, dim, rank=5, dtype=dtype)
    check_against_reference(form, inputs, backend, dtype)


@pytest.mark.parametrize("form", FORMS)
def test_triton_float64_is_exact_to_rounding(form):
    inputs = make_inputs(form, 7, 100, rank=5, dtype=torch.float64)
    check_against_reference(form, inputs, "triton", torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_many_rows_per_program(form, backend):
    # 1000 rows: several row blocks per program, so the bias / vector-weight gradients are
    # summed over a loop inside each program and then over several programs.
    inputs = make_inputs(form, 1000, 16, rank=4)
    check_against_reference(form, inputs, backend, torch.float32)


@pytest.mark.parametrize("dim", [100, 130])
def test_vector_rows_wider_than_one_tile(dim, monkeypatch):
    monkeypatch.setattr(cross_interaction, "VECTOR_MAX_BLOCK_D", 32)
    inputs = make_inputs("vector", 300, dim)  # several row blocks per program
    check_against_reference("vector", inputs, "triton", torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_first_layer_x0_is_xl(form, backend):
    # Layer 0 gets the same tensor twice; autograd must add both gradients.
    _, _, *params = make_inputs(form, 7, 24, rank=4)
    x = torch.randn(7, 24, requires_grad=True)
    params = [p.requires_grad_(True) for p in params]
    out = OPS[form][0](x, x, *params, backend=backend)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *params], upstream)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, *params)]
    ref = OPS[form][1](leaves[0], leaves[0], *leaves[1:])
    ref_grads = torch.autograd.grad(ref, leaves, upstream.double())
    assert_close_to_reference(out, ref, torch.float32)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert_close_to_reference(grad, ref_grad, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("trainable", ["inputs", "parameters", "x0"])
def test_only_some_inputs_require_grad(form, backend, trainable):
    inputs = make_inputs(form, 11, 20, rank=4)
    chosen = {"inputs": inputs[:2], "parameters": inputs[2:], "x0": inputs[:1]}[trainable]
    for t in chosen:
        t.requires_grad_(True)
    out, grads, upstream = forward_and_grads(form, inputs, backend)
    ref_out, ref_grads = reference_and_grads(form, inputs, upstream)
    assert_close_to_reference(out, ref_out, torch.float32)
    for t, grad, ref_grad in zip(inputs, grads, ref_grads, strict=True):
        assert (grad is None) == (not t.requires_grad)
        if grad is not None:
            assert_close_to_reference(grad, ref_grad, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_strided_inputs(form, backend):
    # x0 and xl are column slices of one wider tensor; the 2-D weights are transposed views.
    x = torch.randn(9, 60)
    _, _, *params = make_inputs(form, 9, 20, rank=4)
    params = [p.t().contiguous().t() if p.dim() == 2 else p for p in params]
    inputs = [x[:, :20], x[:, 30:50], *params]
    check_against_reference(form, inputs, backend, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_empty_batch(form, backend):
    inputs = [t.requires_grad_(True) for t in make_inputs(form, 0, 12, rank=2)]
    out = OPS[form][0](*inputs, backend=backend)
    assert out.shape == (0, 12)
    grads = torch.autograd.grad(out, inputs[2:], torch.ones_like(out))
    for grad, param in zip(grads, inputs[2:], strict=True):
        assert grad.shape == param.shape and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("form", FORMS)
def test_reference_gradcheck(form):
    inputs = make_inputs(form, 4, 5, rank=2, dtype=torch.float64)
    assert torch.autograd.gradcheck(OPS[form][1], [t.requires_grad_(True) for t in inputs])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", FORMS)
def test_deterministic(form, backend):
    inputs = make_inputs(form, 300, 40, rank=4)
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        upstream = torch.linspace(-1, 1, 300 * 40).view(300, 40)
        out, grads, _ = forward_and_grads(form, leaves, backend, upstream)
        results.append([out, *grads])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_torch_backend_follows_cpu_autocast():
    # Plain torch semantics: the matmul runs in bf16, the fp32 elementwise part promotes.
    x0, xl, weight, bias = make_inputs("full", 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cross_layer(x0, xl, weight, bias, backend="torch")
        expected = x0 * torch.nn.functional.linear(xl, weight, bias) + xl
    assert torch.equal(out, expected)
    assert not torch.equal(out, cross_layer(x0, xl, weight, bias, backend="torch"))


def with_changes(inputs, **changes):
    names = ["x0", "xl", "p0", "p1", "p2"][: len(inputs)]
    return [changes.get(name, t) for name, t in zip(names, inputs, strict=True)]


BAD_INPUTS = [
    ("full", lambda x: with_changes(x, x0=x[0][0]), r"x0 must be a \[B, D\] tensor"),
    ("full", lambda x: with_changes(x, xl=x[1][:, :5]), r"xl has shape \(4, 5\), expected"),
    (
        "full",
        lambda x: with_changes(x, p0=x[2][:5]),
        r"weight has shape \(5, 6\), expected \[D, D\]",
    ),
    ("full", lambda x: with_changes(x, p1=x[3][:5]), r"bias has shape \(5,\), expected \[D\]"),
    ("low_rank", lambda x: with_changes(x, p0=x[2][:, 0]), r"u_weight must be a \[D, r\] tensor"),
    ("low_rank", lambda x: with_changes(x, p1=x[3][:1]), r"v_weight has shape \(1, 6\).*\(2, 6\)"),
    ("low_rank", lambda x: with_changes(x, p2=x[4][:1]), r"bias has shape \(1,\)"),
    (
        "vector",
        lambda x: with_changes(x, p0=x[2][None]),
        r"weight has shape \(1, 6\), expected \[D\]",
    ),
    ("vector", lambda x: with_changes(x, p1=x[3].to("meta")), r"bias is on meta, expected x0's"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("form", "mutate", "message"), BAD_INPUTS)
def test_bad_input_is_a_clear_error(form, mutate, message, backend):
    inputs = make_inputs(form, 4, 6, rank=2)
    with pytest.raises(ValueError, match=message):
        OPS[form][0](*mutate(inputs), backend=backend)


@pytest.mark.parametrize("form", FORMS)
def test_triton_dtype_errors(form):
    inputs = make_inputs(form, 4, 6, rank=2)
    mixed = with_changes(inputs, p1=inputs[3].double())
    with pytest.raises(ValueError, match="has dtype torch.float64, expected x0's dtype"):
        OPS[form][0](*mixed, backend="triton")
    integer = [t.long() for t in inputs]
    with pytest.raises(ValueError, match="x0 has dtype torch.int64; the Triton path supports"):
        OPS[form][0](*integer, backend="triton")


def test_backend_selection(monkeypatch):
    inputs = make_inputs("full", 4, 6)
    with pytest.raises(ValueError, match="backend='cuda' for cross_layer"):
        cross_layer(*inputs, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        cross_layer_vector(*make_inputs("vector", 4, 6), backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("form", "batch_size", "dim"),
    [("full", 2000, 513), ("low_rank", 2000, 1000), ("vector", 2000, 1000), ("vector", 64, 5000)],
)
def test_large_shapes(form, batch_size, dim, backend):
    # vector at D = 5000 walks rows wider than VECTOR_MAX_BLOCK_D in tiles.
    inputs = make_inputs(form, batch_size, dim, rank=64)
    check_against_reference(form, inputs, backend, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch_size", "dim"), [(1, 1), (4097, 100), (2048, 512), (33, 5000)])
def test_gpu_compiled_kernels(form, dtype, batch_size, dim):
    # fp32 at 1e-5 also checks that the matmul is IEEE fp32, not TF32 (errors near 1e-3).
    assert not torch.backends.cuda.matmul.allow_tf32
    inputs = make_inputs(form, batch_size, dim, rank=16, dtype=dtype, device="cuda")
    check_against_reference(form, inputs, "triton", dtype)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    upstream = torch.randn(batch_size, dim, device="cuda", dtype=dtype)
    first = forward_and_grads(form, leaves, "triton", upstream)
    second = forward_and_grads(form, leaves, "triton", upstream)
    for a, b in zip([first[0], *first[1]], [second[0], *second[1]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_autocast_computes_in_bf16(form):
    inputs = [t.requires_grad_(True) for t in make_inputs(form, 1000, 100, rank=8, device="cuda")]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = OPS[form][0](*inputs, backend="triton")
    assert out.dtype == torch.bfloat16
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, upstream)
    # The reference sees what autocast computes from: the inputs rounded to bf16.
    rounded = [t.detach().bfloat16() for t in inputs]
    ref_out, ref_grads = reference_and_grads(form, rounded, upstream)
    assert_close_to_reference(out, ref_out, torch.bfloat16)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.float32
        assert_close_to_reference(grad.bfloat16(), ref_grad, torch.bfloat16)


def test_auto_runs_the_torch_path_on_cuda(monkeypatch):
    """The cross layers' Triton kernels measured slower than torch eager on an H100
    (benchmarks/results/interaction.csv): "auto" keeps the torch path there; "triton" asks."""
    monkeypatch.delenv("RECSYS_BACKEND", raising=False)
    on_cuda = SimpleNamespace(device=torch.device("cuda"))  # only the device is read
    for op in ("cross_layer", "cross_layer_low_rank", "cross_layer_vector"):
        assert cross_interaction._backend("auto", on_cuda, op) == "torch"
        if HAS_TRITON:
            assert cross_interaction._backend("triton", on_cuda, op) == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_autocast_auto_returns_the_autocast_dtype(form):
    """ "auto" runs the torch path on CUDA with the Triton path's dtypes: bf16 under autocast."""
    inputs = [t.requires_grad_(True) for t in make_inputs(form, 64, 32, rank=8, device="cuda")]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = OPS[form][0](*inputs, backend="auto")
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), inputs)
    assert all(g.dtype == torch.float32 for g in grads)
