"""Building blocks of recommendation models; every model in recsys.models is made of these.

Shape letters: B batch, F sparse features, D embedding dim, N_in / N_out layer widths.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from recsys.ops.dot_interaction import PAIR_ORDERS, PairOrder, dot_interaction, output_width

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

    T = [x; e_1; ...; e_F] is [B, F+1, D]; the output is [x | <T_i, T_j> for each pair | zero
    padding], [B, W] with W = :meth:`output_size`. Runs ``recsys.ops.dot_interaction`` (Triton
    on CUDA: no [B, F+1, F+1] tensor in memory, forward or backward).

    Args:
        num_sparse_features: F.
        self_interaction: keep each vector's dot product with itself too.
        output_padding: round the output width up to a multiple of this with zero columns.
        pair_order: ``"torchrec"`` (TorchRec's InteractionArch order, the default) or
            ``"mlperf"`` (lower triangle row-major, as NVIDIA's DLRM and OneFlow).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Example::

        inter = DotInteraction(26, output_padding=8)
        inter(torch.randn(4, 128), torch.randn(4, 26, 128)).shape  # [4, 480]
    """

    def __init__(
        self,
        num_sparse_features: int,
        self_interaction: bool = False,
        output_padding: int = 1,
        pair_order: PairOrder = "torchrec",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if output_padding < 1:
            raise ValueError(f"output_padding must be >= 1, got {output_padding}")
        if pair_order not in PAIR_ORDERS:
            raise ValueError(f"pair_order={pair_order!r}; expected one of {PAIR_ORDERS}")
        self.num_sparse_features = num_sparse_features
        self.self_interaction = self_interaction
        self.output_padding = output_padding
        self.pair_order = pair_order
        self.backend = backend

    def output_size(self, embedding_dim: int) -> int:
        return output_width(
            embedding_dim, self.num_sparse_features + 1, self.self_interaction, self.output_padding
        )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if sparse.shape[1] != self.num_sparse_features:
            raise ValueError(
                f"sparse has {sparse.shape[1]} features, this layer was built for "
                f"{self.num_sparse_features}"
            )
        return dot_interaction(
            dense,  # [B, D]
            sparse,  # [B, F, D]
            self_interaction=self.self_interaction,
            output_padding=self.output_padding,
            pair_order=self.pair_order,
            backend=self.backend,
        )  # [B, W]


class FactorizationMachine(nn.Module):
    """FM second-order term (Rendle, 2010) over F embeddings:
    0.5 * ((sum_f v_f)^2 - sum_f v_f^2), elementwise over D.

    Reference implementations disagree on the output's shape (DeepFM sums over D to one logit
    per sample, NFM keeps the [B, D] vector), so ``reduce_sum`` must be given.

    Args:
        reduce_sum: True returns [B, 1] (summed over D), False returns [B, D].

    Computed in fp32 for bf16 / fp16 inputs (the difference of two large sums cancels), and
    returned in the input's dtype.

    Example::

        FactorizationMachine(reduce_sum=True)(torch.randn(4, 26, 16)).shape  # [4, 1]
    """

    def __init__(self, *, reduce_sum: bool) -> None:
        super().__init__()
        self.reduce_sum = reduce_sum

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 3:
            raise ValueError(
                f"FactorizationMachine takes embeddings [B, F, D], got shape "
                f"{tuple(embeddings.shape)}"
            )
        v = embeddings if embeddings.dtype in (torch.float32, torch.float64) else embeddings.float()
        square_of_sum = v.sum(dim=1).square()  # [B, D]
        sum_of_squares = v.square().sum(dim=1)  # [B, D]
        interaction = 0.5 * (square_of_sum - sum_of_squares)  # [B, D]
        if self.reduce_sum:
            interaction = interaction.sum(dim=1, keepdim=True)  # [B, 1]
        return interaction.to(embeddings.dtype)
