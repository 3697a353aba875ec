"""CrossNet, LowRankCrossNet and VectorCrossNet: shapes, gradients, and equality with torchrec's
modules of the same names after loading their state_dicts (both directions)."""

import pytest
import torch
from torchrec.modules import crossnet as torchrec_crossnet

from recsys.models.layers import CrossNet, LowRankCrossNet, VectorCrossNet

BACKENDS = ["torch", "triton"]
# (ours, torchrec's, extra constructor arguments)
MODULES = {
    "CrossNet": (CrossNet, torchrec_crossnet.CrossNet, {}),
    "LowRankCrossNet": (LowRankCrossNet, torchrec_crossnet.LowRankCrossNet, {"low_rank": 5}),
    "VectorCrossNet": (VectorCrossNet, torchrec_crossnet.VectorCrossNet, {}),
}


def assert_close_fp32(actual, expected):
    # Both sides are fp32 with different summation orders; errors scale with the largest value
    # (three layers of the vector form grow the values).
    scale = max(float(expected.detach().abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale)


def build_pair(name, in_features, num_layers, backend):
    ours, theirs, extra = MODULES[name]
    reference = theirs(in_features, num_layers, **extra)
    with torch.no_grad():  # torchrec initialises biases to zero; make them matter
        for param in reference.bias:
            param.normal_()
    module = ours(in_features, num_layers, backend=backend, **extra)
    module.load_state_dict(reference.state_dict())
    return module, reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize(("batch_size", "in_features"), [(1, 16), (9, 100)])
def test_matches_torchrec_after_loading_its_state_dict(name, backend, batch_size, in_features):
    module, reference = build_pair(name, in_features, 3, backend)
    x = torch.randn(batch_size, in_features, requires_grad=True)
    out = module(x)
    expected = reference(x)
    assert_close_fp32(out, expected)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *module.parameters()], upstream)
    expected_grads = torch.autograd.grad(expected, [x, *reference.parameters()], upstream)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert_close_fp32(grad, expected_grad)


@pytest.mark.parametrize("name", MODULES)
def test_parameters_named_and_shaped_like_torchrec(name):
    module, reference = build_pair(name, 12, 2, "torch")
    ours = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    theirs = {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    assert ours == theirs
    reference.load_state_dict(module.state_dict())  # and back, strictly


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODULES)
def test_shapes_and_every_parameter_gets_a_gradient(name, backend):
    ours, _, extra = MODULES[name]
    module = ours(24, 4, backend=backend, **extra)
    x = torch.randn(7, 24, requires_grad=True)
    out = module(x)
    assert out.shape == (7, 24)
    out.square().sum().backward()
    assert x.grad is not None and torch.count_nonzero(x.grad) > 0
    for param_name, param in module.named_parameters():
        assert param.grad is not None and torch.count_nonzero(param.grad) > 0, param_name


@pytest.mark.parametrize("name", MODULES)
def test_bad_sizes_are_clear_errors(name):
    ours, _, extra = MODULES[name]
    with pytest.raises(ValueError, match="in_features must be >= 1, got 0"):
        ours(0, 2, **extra)
    with pytest.raises(ValueError, match="num_layers must be >= 0, got -1"):
        ours(8, -1, **extra)
    with pytest.raises(ValueError, match="low_rank must be >= 1, got 0"):
        LowRankCrossNet(8, 2, low_rank=0)
