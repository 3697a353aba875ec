"""Building blocks of recommendation models; every model in recsys.models is made of these.

Shape letters: B batch, F sparse features, D embedding dim, N_in / N_out layer widths.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid,
}


class MLP(nn.Module):
    """Stack of Linear + activation layers.

    Args:
        in_features: N_in.
        layer_sizes: output width of each layer.
        activation: ``"relu"``, ``"gelu"``, ``"silu"`` or ``"sigmoid"``.
        final_activation: apply the activation after the last layer too (False gives logits).

    Example::

        MLP(13, [512, 256, 64])(torch.randn(8, 13)).shape  # [8, 64]
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        activation: str = "relu",
        final_activation: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
        if not layer_sizes:
            raise ValueError("MLP needs at least one layer size")
        layers: list[nn.Module] = []
        sizes = [in_features, *layer_sizes]
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(n_in, n_out))
            if final_activation or i < len(layer_sizes) - 1:
                layers.append(ACTIVATIONS[activation]())
        self.layers = nn.Sequential(*layers)
        self.out_features = sizes[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # [B, N_in] -> [B, N_out]


class DotInteraction(nn.Module):
    """DLRM feature interaction: pairwise dot products of the dense vector and the embeddings.

    T = [x; e_1; ...; e_F] is [B, F+1, D]; the output is [x | <T_i, T_j> for i < j], i.e.
    [B, D + (F+1)F/2], pairs in row-major upper-triangle order (as torchrec's InteractionArch).

    Args:
        num_sparse_features: F.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.num_sparse_features = num_sparse_features
        rows, cols = torch.triu_indices(num_sparse_features + 1, num_sparse_features + 1, 1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def output_size(self, embedding_dim: int) -> int:
        num_vectors = self.num_sparse_features + 1
        return embedding_dim + num_vectors * (num_vectors - 1) // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F+1, D]
        gram = torch.bmm(combined, combined.transpose(1, 2))  # [B, F+1, F+1]
        pairs = gram[:, self.pair_rows, self.pair_cols]  # [B, (F+1)F/2]
        return torch.cat([dense, pairs], dim=1)
