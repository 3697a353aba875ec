import pytest
import torch

from recsys.models.layers import CIN


def cin_layer_reference(x_prev, x0, weight):
    """The paper's formula, term by term:
    X^k_{h,*} = sum_{i,j} W^{k,h}_{ij} (X^{k-1}_{i,*} o X^0_{j,*}).

    x_prev [B, H, D], x0 [B, F, D], weight [H_k, H, F] -> [B, H_k, D].
    """
    num_out, num_prev, num_fields = weight.shape
    out = torch.zeros(x0.shape[0], num_out, x0.shape[2], dtype=x0.dtype)
    for h in range(num_out):
        for i in range(num_prev):
            for j in range(num_fields):
                out[:, h] += weight[h, i, j] * x_prev[:, i] * x0[:, j]
    return out


def cin_reference(cin, x0):
    """Layers of cin_layer_reference, split in halves as documented, sum-pooled over D."""
    x, pooled = x0, []
    for k, kernel in enumerate(cin.kernels):
        x = cin_layer_reference(x, x0, kernel.view(kernel.shape[0], x.shape[1], x0.shape[1]))
        if cin.split_half and k < len(cin.kernels) - 1:
            half = x.shape[1] // 2
            x, out = x[:, :half], x[:, half:]
        else:
            out = x
        pooled.append(out.sum(dim=2))
    return torch.cat(pooled, dim=1)


def test_one_layer_matches_the_paper_formula():
    cin = CIN(5, [7], split_half=False).double()
    x0 = torch.randn(4, 5, 3, dtype=torch.float64)
    (kernel,) = cin.kernels
    expected = cin_layer_reference(x0, x0, kernel.view(7, 5, 5)).sum(dim=2)  # [B, 7]
    torch.testing.assert_close(cin(x0), expected)


@pytest.mark.parametrize("split_half", [True, False])
@pytest.mark.parametrize(("num_fields", "layer_sizes"), [(1, [2]), (6, [4, 6, 3]), (11, [8, 5])])
def test_layers_match_reference(num_fields, layer_sizes, split_half):
    cin = CIN(num_fields, layer_sizes, split_half=split_half).double()
    x0 = torch.randn(3, num_fields, 5, dtype=torch.float64)
    out = cin(x0)
    halved = sum(size // 2 for size in layer_sizes[:-1]) + layer_sizes[-1]
    assert cin.output_size == (halved if split_half else sum(layer_sizes))
    assert out.shape == (3, cin.output_size)
    torch.testing.assert_close(out, cin_reference(cin, x0))


def test_float32_close_to_float64_and_gradients():
    cin = CIN(9, [6, 4])
    x0 = torch.randn(16, 9, 8, requires_grad=True)
    out = cin(x0)
    expected = cin_reference(cin.double(), x0.detach().double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    small = CIN(3, [2, 3]).double()
    assert torch.autograd.gradcheck(
        small, (torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True),)
    )


def test_bad_sizes_and_inputs():
    with pytest.raises(ValueError, match=r"with split_half every size but the last must be even"):
        CIN(4, [3, 4])
    CIN(4, [3, 4], split_half=False)
    CIN(4, [4, 3])
    with pytest.raises(ValueError, match=r"layer_sizes must be one or more sizes >= 1, got \[\]"):
        CIN(4, [])
    with pytest.raises(ValueError, match="num_fields must be >= 1, got 0"):
        CIN(0, [2])
    with pytest.raises(
        ValueError, match=r"CIN takes embeddings \[B, F=4, D\], got shape \(2, 5, 8\)"
    ):
        CIN(4, [2])(torch.randn(2, 5, 8))
