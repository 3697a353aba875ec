"""Building blocks of recommendation models; every model in recsys.models is made of these.

Shape letters: B batch, F sparse features, D embedding dim, N_in / N_out layer widths.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from recsys.ops._triton import BACKENDS
from recsys.ops.cross_interaction import cross_layer, cross_layer_low_rank, cross_layer_vector
from recsys.ops.dot_interaction import PAIR_ORDERS, PairOrder, dot_interaction, output_width
from recsys.ops.fused_mlp import ACTIVATIONS, fused_linear


class FusedMLP(nn.Module):
    """Stack of Linear + activation (+ dropout) layers, each one fused kernel on CUDA
    (``recsys.ops.fused_mlp.fused_linear``); plain torch ops on CPU.

    Parameters are ``nn.Linear`` layers with their default init in ``self.layers``, so the
    state_dict keys are ``layers.<i>.weight`` / ``layers.<i>.bias``.

    Args:
        in_features: N_in.
        layer_sizes: output width of each layer.
        activation: ``"relu"``, ``"gelu"``, ``"silu"``, ``"sigmoid"`` or ``"none"``.
        dropout: drop probability in [0, 1) after each activated layer, in training mode only.
            Dropout seeds come from torch's default generator, so ``torch.manual_seed`` makes
            runs repeat.
        final_activation: activation (and dropout) after the last layer too; False gives
            logits.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Example::

        FusedMLP(13, [512, 256, 64], dropout=0.1)(torch.randn(8, 13)).shape  # [8, 64]
    """

    def __init__(
        self,
        in_features: int,
        layer_sizes: Sequence[int],
        activation: str = "relu",
        dropout: float = 0.0,
        final_activation: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if not layer_sizes:
            raise ValueError("FusedMLP needs at least one layer size, got none")
        sizes = [in_features, *layer_sizes]
        if any(size < 1 for size in sizes):
            raise ValueError(
                f"in_features and layer_sizes must be >= 1, got {in_features} and "
                f"{list(layer_sizes)}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        self.layers = nn.ModuleList(
            nn.Linear(n_in, n_out) for n_in, n_out in itertools.pairwise(sizes)
        )
        self.activation = activation
        self.dropout = dropout
        self.final_activation = final_activation
        self.backend = backend
        self.out_features = sizes[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])  # [B, N_in]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            activated = self.final_activation or i < last
            x = fused_linear(
                x,
                layer.weight,
                layer.bias,
                activation=self.activation if activated else "none",
                dropout=self.dropout if activated else 0.0,
                training=self.training,
                backend=self.backend,
            )
        if len(leading) != 1:
            x = x.reshape(*leading, self.out_features)  # [..., N_out]
        return x


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


def _check_cross_sizes(in_features: int, num_layers: int) -> None:
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")


class CrossNet(nn.Module):
    """DCN-v2 cross network, full rank: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l`` per layer.

    Parameters are named and shaped as in ``torchrec.modules.crossnet.CrossNet``
    (``kernels.<l>`` [D, D], ``bias.<l>`` [D, 1]), so its state_dict loads unchanged.

    Args:
        in_features: D.
        num_layers: number of cross layers.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Example::

        CrossNet(16, num_layers=3)(torch.randn(8, 16)).shape  # [8, 16]
    """

    def __init__(self, in_features: int, num_layers: int, backend: str = "auto") -> None:
        super().__init__()
        _check_cross_sizes(in_features, num_layers)
        self.backend = backend
        self.kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, in_features)))
            for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(
            nn.Parameter(torch.zeros(in_features, 1)) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # [B, D]
        for weight, bias in zip(self.kernels, self.bias, strict=True):
            x = cross_layer(x0, x, weight, bias.view(-1), backend=self.backend)
        return x


class LowRankCrossNet(nn.Module):
    """DCN-v2 cross network with low-rank weights W_l = U_l V_l:
    ``x_{l+1} = x0 * (U_l V_l x_l + b_l) + x_l`` per layer.

    Parameters are named and shaped as in ``torchrec.modules.crossnet.LowRankCrossNet``
    (``W_kernels.<l>`` = U [D, r], ``V_kernels.<l>`` = V [r, D], ``bias.<l>`` [D]).

    Args:
        in_features: D.
        num_layers: number of cross layers.
        low_rank: r >= 1.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Example::

        LowRankCrossNet(16, num_layers=2, low_rank=4)(torch.randn(8, 16)).shape  # [8, 16]
    """

    def __init__(
        self, in_features: int, num_layers: int, low_rank: int = 1, backend: str = "auto"
    ) -> None:
        super().__init__()
        _check_cross_sizes(in_features, num_layers)
        if low_rank < 1:
            raise ValueError(f"low_rank must be >= 1, got {low_rank}")
        self.backend = backend
        self.W_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank)))
            for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features)))
            for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(
            nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # [B, D]
        for u, v, bias in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x = cross_layer_low_rank(x0, x, u, v, bias, backend=self.backend)
        return x


class VectorCrossNet(nn.Module):
    """DCN-v1 cross network: ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l`` per layer.

    Parameters are named and shaped as in ``torchrec.modules.crossnet.VectorCrossNet``
    (``kernels.<l>`` [D, 1], ``bias.<l>`` [D, 1]).

    Args:
        in_features: D.
        num_layers: number of cross layers.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).

    Example::

        VectorCrossNet(16, num_layers=3)(torch.randn(8, 16)).shape  # [8, 16]
    """

    def __init__(self, in_features: int, num_layers: int, backend: str = "auto") -> None:
        super().__init__()
        _check_cross_sizes(in_features, num_layers)
        self.backend = backend
        self.kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, 1)))
            for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(
            nn.Parameter(torch.zeros(in_features, 1)) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # [B, D]
        for weight, bias in zip(self.kernels, self.bias, strict=True):
            x = cross_layer_vector(x0, x, weight.view(-1), bias.view(-1), backend=self.backend)
        return x
