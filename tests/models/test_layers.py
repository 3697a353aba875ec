import pytest
import torch

from recsys.models.layers import DotInteraction, FactorizationMachine
from recsys.ops.interaction.dot import dot_interaction_reference


def pairwise_fm(embeddings):
    """sum over feature pairs f < g of v_f * v_g, elementwise over D: the FM term by definition."""
    F = embeddings.shape[1]
    return sum(embeddings[:, f] * embeddings[:, g] for f in range(F) for g in range(f + 1, F))


@pytest.mark.parametrize("num_features", [1, 2, 27])
@pytest.mark.parametrize("reduce_sum", [False, True])
def test_factorization_machine_matches_pairwise_definition(num_features, reduce_sum):
    embeddings = torch.randn(5, num_features, 16, dtype=torch.float64, requires_grad=True)
    out = FactorizationMachine(reduce_sum=reduce_sum)(embeddings)
    expected = pairwise_fm(embeddings) if num_features > 1 else torch.zeros(5, 16).double()
    if reduce_sum:
        expected = expected.sum(1, keepdim=True)
    assert out.shape == ((5, 1) if reduce_sum else (5, 16))
    torch.testing.assert_close(out, expected)
    assert torch.autograd.gradcheck(FactorizationMachine(reduce_sum=reduce_sum), (embeddings,))


def test_factorization_machine_low_precision_computes_in_fp32():
    embeddings = torch.randn(64, 27, 16) * 8
    out = FactorizationMachine(reduce_sum=False)(embeddings.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = pairwise_fm(embeddings.bfloat16().double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max())


def test_factorization_machine_needs_explicit_shape_and_3d_input():
    with pytest.raises(TypeError):
        FactorizationMachine()
    with pytest.raises(ValueError, match=r"embeddings \[B, F, D\], got shape \(4, 16\)"):
        FactorizationMachine(reduce_sum=True)(torch.randn(4, 16))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dot_interaction_layer(backend):
    layer = DotInteraction(26, self_interaction=True, output_padding=8, backend=backend)
    dense, sparse = torch.randn(3, 16), torch.randn(3, 26, 16)
    out = layer(dense, sparse)
    assert out.shape == (3, layer.output_size(16)) and out.shape[1] % 8 == 0
    expected = dot_interaction_reference(
        dense.double(), sparse.double(), self_interaction=True, output_padding=8
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sparse has 25 features, this layer was built for 26"):
        layer(dense, sparse[:, 1:])
    with pytest.raises(ValueError, match="pair_order='upper'"):
        DotInteraction(26, pair_order="upper")
