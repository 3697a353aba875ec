"""ProductLayer (PNN) and MixtureOfExperts (MMoE) against their definitions, in float64."""

import pytest
import torch

from recsys.models.layers import FusedMLP, MixtureOfExperts, ProductLayer


def inner_products(e):
    """<e_i, e_j> for i < j, in TorchRec's order (the upper triangle row-major)."""
    F = e.shape[1]
    return torch.stack(
        [(e[:, i] * e[:, j]).sum(-1) for i in range(F) for j in range(i + 1, F)], dim=1
    )


def outer_upper_triangle(e):
    """The paper's superposed outer product s s^T (s = sum_f e_f), upper triangle row-major."""
    s = e.sum(dim=1)
    p = s.unsqueeze(2) * s.unsqueeze(1)  # [B, D, D]
    D = e.shape[2]
    return torch.stack([p[:, i, j] for i in range(D) for j in range(i, D)], dim=1)


@pytest.mark.parametrize("product", ["inner", "outer", "both"])
@pytest.mark.parametrize(("num_features", "dim"), [(1, 3), (2, 1), (7, 5)])
def test_product_layer_matches_definition(product, num_features, dim):
    e = torch.randn(6, num_features, dim, dtype=torch.float64, requires_grad=True)
    layer = ProductLayer(num_features, dim, product=product)
    out = layer(e)
    parts = [e.flatten(1)]
    if product != "outer":
        parts.append(inner_products(e) if num_features > 1 else e.new_zeros(6, 0))
    if product != "inner":
        parts.append(outer_upper_triangle(e))
    expected = torch.cat(parts, dim=1)
    assert out.shape == (6, layer.out_features)
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(layer, (e,))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_product_layer_inner_backends_in_fp32(backend):
    e = torch.randn(3, 6, 4, requires_grad=True)
    out = ProductLayer(6, 4, product="inner", backend=backend)(e)
    torch.testing.assert_close(out[:, 24:], inner_products(e.detach()), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    e64 = e.detach().double().requires_grad_()
    torch.cat([e64.flatten(1), inner_products(e64)], dim=1).sum().backward()
    torch.testing.assert_close(e.grad, e64.grad.float(), rtol=1e-5, atol=1e-5)


def test_product_layer_sizes_and_errors():
    assert ProductLayer(27, 16, product="both")(torch.randn(4, 27, 16)).shape == (4, 919)
    with pytest.raises(ValueError, match="product 'kernel'; expected one of inner, outer, both"):
        ProductLayer(3, 4, product="kernel")
    with pytest.raises(ValueError, match="num_features and embedding_dim must be >= 1"):
        ProductLayer(0, 4)
    with pytest.raises(
        ValueError, match=r"built for embeddings \[B, 3, 4\], got shape \(2, 3, 5\)"
    ):
        ProductLayer(3, 4)(torch.randn(2, 3, 5))


@pytest.mark.parametrize(("num_experts", "num_tasks"), [(1, 1), (3, 2), (4, 3)])
def test_mixture_of_experts_matches_per_task_loop(num_experts, num_tasks):
    moe = MixtureOfExperts(11, [8, 5], num_experts=num_experts, num_tasks=num_tasks).double()
    x = torch.randn(7, 11, dtype=torch.float64)
    out = moe(x)
    assert out.shape == (7, num_tasks, 5)
    gate_logits = moe.gates(x)
    for t in range(num_tasks):
        gate = gate_logits[:, t * num_experts : (t + 1) * num_experts].softmax(dim=1)  # [B, K]
        expected = sum(gate[:, [k]] * moe.experts[k](x) for k in range(num_experts))
        torch.testing.assert_close(out[:, t], expected)


def test_mixture_of_identical_experts_is_that_expert():
    """Each gate sums to 1 over the experts."""
    moe = MixtureOfExperts(6, [4], num_experts=3, num_tasks=2, activation="gelu").double()
    for expert in moe.experts[1:]:
        expert.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(5, 6, dtype=torch.float64)
    expected = moe.experts[0](x)
    torch.testing.assert_close(moe(x), torch.stack([expected, expected], dim=1))


def test_mixture_of_experts_gradients_and_dropout():
    moe = MixtureOfExperts(6, [8, 4], num_experts=3, num_tasks=2, dropout=0.5)
    assert all(isinstance(e, FusedMLP) and e.dropout == 0.5 for e in moe.experts)
    x = torch.randn(32, 6)
    moe(x).square().sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
    assert not torch.equal(moe(x), moe(x))  # fresh dropout masks in training
    moe.eval()
    torch.testing.assert_close(moe(x), moe(x))


def test_mixture_of_experts_errors():
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        MixtureOfExperts(6, [4], num_experts=0, num_tasks=1)
    with pytest.raises(ValueError, match="num_tasks must be >= 1, got 0"):
        MixtureOfExperts(6, [4], num_experts=2, num_tasks=0)
    with pytest.raises(ValueError, match="expert_layer_sizes must name at least one layer"):
        MixtureOfExperts(6, [], num_experts=2, num_tasks=1)
