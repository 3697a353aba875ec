"""FusedMLP: parameters and init as nn.Linear, forward and gradients against a float64 chain of
fused_linear_reference layers, dropout placement and seeding, argument errors."""

import copy

import pytest
import torch
from torch import nn

from recsys.models import layers
from recsys.models.layers import FusedMLP
from recsys.ops.mlp.fused_linear import fused_linear_reference

BACKENDS = ["torch", "triton"]


def reference_forward(mlp: FusedMLP, x: torch.Tensor) -> torch.Tensor:
    """The module's math in float64, without dropout."""
    last = len(mlp.layers) - 1
    for i, layer in enumerate(mlp.layers):
        activated = mlp.final_activation or i < last
        x = fused_linear_reference(
            x, layer.weight, layer.bias, mlp.activation if activated else "none"
        )
    return x


def test_parameters_are_default_initialized_linear_layers():
    torch.manual_seed(3)
    mlp = FusedMLP(13, [8, 4])
    torch.manual_seed(3)
    expected = [nn.Linear(13, 8), nn.Linear(8, 4)]
    assert list(mlp.state_dict()) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    for layer, linear in zip(mlp.layers, expected, strict=True):
        assert torch.equal(layer.weight, linear.weight) and torch.equal(layer.bias, linear.bias)
    assert mlp.out_features == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("final_activation", [True, False])
def test_forward_and_gradients_match_float64_reference(backend, activation, final_activation):
    mlp = FusedMLP(13, [40, 17, 1], activation, final_activation=final_activation, backend=backend)
    reference = FusedMLP(13, [40, 17, 1], activation, final_activation=final_activation).double()
    reference.load_state_dict(mlp.state_dict())
    x = torch.randn(33, 13)
    out = mlp(x)
    expected = reference_forward(reference, x.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(mlp.parameters()), upstream)
    expected_grads = torch.autograd.grad(expected, list(reference.parameters()), upstream.double())
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-5)


def test_matches_plain_torch_mlp_with_the_same_weights():
    fused = FusedMLP(13, [16, 8, 1], "silu", final_activation=False)
    plain = nn.Sequential(
        nn.Linear(13, 16), nn.SiLU(), nn.Linear(16, 8), nn.SiLU(), nn.Linear(8, 1)
    )
    linears = [m for m in plain if isinstance(m, nn.Linear)]
    for linear, layer in zip(linears, fused.layers, strict=True):
        linear.load_state_dict(layer.state_dict())
    x = torch.randn(9, 13)
    torch.testing.assert_close(fused(x), plain(x))


def test_dropout_follows_each_activated_layer_in_training_only(monkeypatch):
    calls = []
    fused_linear = layers.fused_linear

    def recording(x, weight, bias, **kwargs):
        calls.append((kwargs["activation"], kwargs["dropout"], kwargs["training"]))
        return fused_linear(x, weight, bias, **kwargs)

    monkeypatch.setattr(layers, "fused_linear", recording)
    mlp = FusedMLP(5, [6, 7, 1], "gelu", dropout=0.2, final_activation=False)
    mlp(torch.randn(4, 5))
    assert calls == [("gelu", 0.2, True), ("gelu", 0.2, True), ("none", 0.0, True)]
    calls.clear()
    mlp.eval()(torch.randn(4, 5))
    assert [training for *_, training in calls] == [False] * 3
    calls.clear()
    FusedMLP(5, [6, 7], dropout=0.2)(torch.randn(4, 5))
    assert calls == [("relu", 0.2, True), ("relu", 0.2, True)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_seeded_by_torch_and_off_in_eval(backend):
    mlp = FusedMLP(13, [32, 16], "silu", dropout=0.5, backend=backend)
    x = torch.randn(20, 13)
    torch.manual_seed(1)
    first = mlp(x)
    torch.manual_seed(1)
    assert torch.equal(mlp(x), first)
    assert not torch.equal(mlp(x), first)
    assert (first == 0).float().mean() > 0.3  # silu is never exactly 0: these were dropped
    mlp.eval()
    expected = reference_forward(copy.deepcopy(mlp).double(), x.double())
    torch.testing.assert_close(mlp(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_kept():
    mlp = FusedMLP(13, [8, 3])
    assert mlp(torch.randn(2, 5, 13)).shape == (2, 5, 3)


def test_backends_agree():
    mlp = FusedMLP(29, [45, 64, 7], "gelu", final_activation=False)
    x = torch.randn(50, 29)
    triton = FusedMLP(29, [45, 64, 7], "gelu", final_activation=False, backend="triton")
    triton.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(triton(x), mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(activation="tanh"), "activation 'tanh'; expected one of relu, gelu, silu, sigmoid"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(dropout=-0.5), r"dropout must be in \[0, 1\), got -0.5"),
        (dict(layer_sizes=[]), "at least one layer size"),
        (dict(layer_sizes=[8, 0]), r"must be >= 1, got 13 and \[8, 0\]"),
        (dict(backend="cuda"), "backend 'cuda'; expected one of auto, triton, torch"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedMLP(**(dict(in_features=13, layer_sizes=[8, 4]) | kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_training_step(dtype):
    mlp = FusedMLP(479, [1024, 512, 1], final_activation=False).cuda()
    reference = FusedMLP(479, [1024, 512, 1], final_activation=False).double()
    reference.load_state_dict(mlp.state_dict())
    x = torch.randn(2048, 479, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out = mlp(x)
    assert out.dtype == dtype
    expected = reference_forward(reference, x.cpu().double())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=3e-2, atol=3e-2)
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mlp.parameters())
    mlp.dropout = 0.3
    with torch.autocast("cuda", dtype=dtype):
        assert (mlp(x) != out).any()
