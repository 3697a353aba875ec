"""Building blocks of recommendation models; every model in recsys.models is made of these.

Shape letters: B batch, F sparse features, D embedding dim, N_in / N_out layer widths.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.ops._triton import BACKENDS
from recsys.ops.interaction.cross import cross_layer, cross_layer_low_rank, cross_layer_vector
from recsys.ops.interaction.dot import PAIR_ORDERS, PairOrder, dot_interaction, output_width
from recsys.ops.mlp.fused_linear import ACTIVATIONS, fused_linear


class FusedMLP(nn.Module):
    """Stack of Linear + activation (+ dropout) layers, each one fused kernel on CUDA
    (``recsys.ops.mlp.fused_linear.fused_linear``); plain torch ops on CPU.

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
    padding], [B, W] with W = :meth:`output_size`. Runs ``recsys.ops.interaction.dot`` (Triton
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


PRODUCTS = ("inner", "outer", "both")


class ProductLayer(nn.Module):
    """PNN product layer (Qu et al., 2016): the linear signal z (the F embeddings, flattened)
    and the quadratic signal p of the feature pairs, concatenated: ``[z | p]`` [B, W].

    - ``"inner"`` (IPNN): <e_i, e_j> for each pair i < j, F(F-1)/2 values, by
      ``recsys.ops.interaction.dot`` (TorchRec's pair order; Triton on CUDA).
    - ``"outer"`` (OPNN with the paper's superposition): p = s s^T with s = sum_f e_f [B, D].
      p is symmetric, so only its upper triangle with the diagonal is kept, D(D+1)/2 values:
      the next linear layer's weights over them are the paper's W_p (a weight on p[i, j] and
      one on p[j, i] act as their sum), so dropping the lower triangle loses nothing.
    - ``"both"`` (PNN*): ``[z | inner | outer]``.

    The paper's first hidden layer, relu(W_z z + W_p p + b), is the next MLP's first layer
    applied to this output.

    Args:
        num_features: F.
        embedding_dim: D.
        product: ``"inner"``, ``"outer"`` or ``"both"``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``, for the inner products.

    Example::

        layer = ProductLayer(27, 16, product="both")
        layer(torch.randn(4, 27, 16)).shape  # [4, 27*16 + 351 + 136] = [4, 919]
    """

    def __init__(
        self, num_features: int, embedding_dim: int, product: str = "inner", backend: str = "auto"
    ) -> None:
        super().__init__()
        if product not in PRODUCTS:
            raise ValueError(f"product {product!r}; expected one of {', '.join(PRODUCTS)}")
        if num_features < 1 or embedding_dim < 1:
            raise ValueError(
                f"num_features and embedding_dim must be >= 1, got {num_features} and "
                f"{embedding_dim}"
            )
        self.num_features = num_features
        self.embedding_dim = embedding_dim
        self.product = product
        self.backend = backend
        rows, cols = torch.triu_indices(embedding_dim, embedding_dim)
        self.register_buffer("outer_rows", rows, persistent=False)
        self.register_buffer("outer_cols", cols, persistent=False)
        self.out_features = num_features * embedding_dim
        if product in ("inner", "both"):
            self.out_features += num_features * (num_features - 1) // 2
        if product in ("outer", "both"):
            self.out_features += embedding_dim * (embedding_dim + 1) // 2

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 3 or embeddings.shape[1:] != (self.num_features, self.embedding_dim):
            raise ValueError(
                f"ProductLayer built for embeddings [B, {self.num_features}, "
                f"{self.embedding_dim}], got shape {tuple(embeddings.shape)}"
            )
        parts = [embeddings.flatten(1)]  # z [B, F*D]
        if self.product in ("inner", "both"):
            # dot_interaction returns [e_0 | pairs of e_0..e_{F-1}]; e_0 is already in z.
            with_first = dot_interaction(
                embeddings[:, 0], embeddings[:, 1:], backend=self.backend
            )  # [B, D + F(F-1)/2]
            parts.append(with_first[:, self.embedding_dim :])  # [B, F(F-1)/2]
        if self.product in ("outer", "both"):
            summed = embeddings.sum(dim=1)  # s [B, D]
            parts.append(summed[:, self.outer_rows] * summed[:, self.outer_cols])  # [B, D(D+1)/2]
        return torch.cat(parts, dim=1)  # [B, W]


class MixtureOfExperts(nn.Module):
    """Multi-gate mixture of experts (MMoE, Ma et al., 2018): K expert MLPs shared by T tasks
    and, per task, a softmax gate over the experts that mixes their outputs::

        experts   x [B, N_in] -> expert_k(x) [B, E] for each k, stacked [B, K, E]
        gates     g_t = softmax(W_t x + b_t) [B, K] for each task t, stacked [B, T, K]
        output    out[:, t] = sum_k g_t[:, k] * expert_k(x)                 [B, T, E]

    Each expert is a :class:`FusedMLP` (activated last layer too). The T gates are one
    ``nn.Linear(N_in, T*K)`` (``gates.weight`` rows t*K..(t+1)*K-1 are task t's gate). With
    ``num_tasks=1`` this is a plain (one-gate) mixture of experts.

    Args:
        in_features: N_in.
        expert_layer_sizes: each expert's MLP sizes; the last is E.
        num_experts: K.
        num_tasks: T.
        activation: activation of the experts' layers.
        dropout: dropout after each expert layer, in training only.

    Example::

        moe = MixtureOfExperts(429, [64, 32], num_experts=4, num_tasks=2)
        moe(torch.randn(8, 429)).shape  # [8, 2, 32]
    """

    def __init__(
        self,
        in_features: int,
        expert_layer_sizes: Sequence[int],
        num_experts: int,
        num_tasks: int,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if not expert_layer_sizes:
            raise ValueError("expert_layer_sizes must name at least one layer, got []")
        self.num_experts = num_experts
        self.num_tasks = num_tasks
        self.experts = nn.ModuleList(
            FusedMLP(in_features, expert_layer_sizes, activation=activation, dropout=dropout)
            for _ in range(num_experts)
        )
        self.gates = nn.Linear(in_features, num_tasks * num_experts)
        self.out_features = expert_layer_sizes[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One FusedMLP per expert: on 2 CPU cores a batched matmul over stacked expert weights
        # measured no faster, and the loop keeps each expert's fused GPU kernels.
        experts = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, K, E]
        gate_logits = self.gates(x).view(-1, self.num_tasks, self.num_experts)  # [B, T, K]
        return torch.bmm(gate_logits.softmax(dim=-1), experts)  # [B, T, E]


class LinearArch(nn.Module):
    """First-order ("linear", "wide") term: one learned weight per id, summed over the
    features, plus a linear function of the dense features and a bias:

        logit_t = sum_f w_f,t[ids of f] + sum_n u_{t,n} x_n + b_t      -> [B, T]

    The per-id weights live in a second :class:`EmbeddingBagCollection` of dimension-1 tables
    (``recsys.models.linear_table_configs``), so they are looked up, sharded and updated by
    the fused optimizers exactly like every other table. Dimension-1 tables give every task
    the same sparse weights; tables of dimension T give each task its own.

    With dense features, ``dense_arch`` = ``nn.Linear(N_dense, T)`` holds u and b; with none
    (N_dense = 0) ``dense_arch`` is None and b is ``bias`` [T], initialized to zero (as
    ``nn.Linear`` initializes a bias without inputs).

    Args:
        embedding_bag_collection: the weight tables, all of dimension 1 or all of dimension T.
            They may cover any of the input's features (the input KJT may hold more).
        dense_in_features: N_dense (0: none).
        num_tasks: T.

    Example::

        linear = LinearArch(EmbeddingBagCollection(linear_table_configs(tables)), 13, 1)
        linear(dense_features, sparse_features).shape  # [B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        num_tasks: int,
    ) -> None:
        super().__init__()
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if dense_in_features < 0:
            raise ValueError(f"dense_in_features must be >= 0 (0: none), got {dense_in_features}")
        dims = sorted({c.embedding_dim for c in embedding_bag_collection.embedding_bag_configs()})
        if dims not in ([1], [num_tasks]):
            raise ValueError(
                f"the linear tables must all have embedding_dim 1 (or num_tasks = {num_tasks}), "
                f"got {dims}"
            )
        self.weights_per_id = dims[0]
        self.sparse_arch = embedding_bag_collection
        self.dense_arch = nn.Linear(dense_in_features, num_tasks) if dense_in_features else None
        self.bias = None if dense_in_features else nn.Parameter(torch.zeros(num_tasks))

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        B = dense_features.shape[0]
        weights = self.sparse_arch(sparse_features).values()  # [B, F * (1 or T)]
        sparse_logits = weights.view(B, -1, self.weights_per_id).sum(dim=1)  # [B, 1 or T]
        if self.dense_arch is None:
            return self.bias + sparse_logits  # [B, T]
        return self.dense_arch(dense_features) + sparse_logits  # [B, T]


class CIN(nn.Module):
    """Compressed interaction network (xDeepFM, Lian et al., 2018): explicit vector-wise
    interactions of degree 2, 3, ... between F embeddings of dim D.

    Layer k maps X^{k-1} [B, H_{k-1}, D] (X^0 = the embeddings, H_0 = F) to X^k [B, H_k, D]:

        X^k_{h,*} = sum_{i < H_{k-1}, j < F} W^{k,h}_{ij} (X^{k-1}_{i,*} o X^0_{j,*})

    (o elementwise), the paper's formula: no bias, no activation. Each layer's output maps are
    summed over D and all of them concatenated: [B, :attr:`output_size`].

    ``split_half=True`` (the authors' released code and DeepCTR; not in the paper's equations):
    every layer but the last sends half of its H_k maps to the output and only the other half
    on to the next layer, which halves the next layer's cost; hidden sizes must be even. False:
    every map goes to both, as in the paper's equations.

    Each layer is one GEMM, [B*D, H_{k-1}*F] x [H_{k-1}*F, H_k], with ``kernels.<k>`` as
    [H_k, H_{k-1}*F] (column i*F + j holds W^{k,h}_{ij}). The outer products are materialized,
    B*D*H_{k-1}*F values per layer (and kept for backward), so memory traffic, not arithmetic,
    bounds its speed; the first layer, with F*F products, costs the most. Deterministic.

    Args:
        num_fields: F.
        layer_sizes: H_1, ..., H_K.
        split_half: see above.

    Example::

        cin = CIN(27, [64, 64])
        cin(torch.randn(8, 27, 16)).shape  # [8, 96] = [8, cin.output_size]
    """

    def __init__(
        self, num_fields: int, layer_sizes: Sequence[int], split_half: bool = True
    ) -> None:
        super().__init__()
        if num_fields < 1:
            raise ValueError(f"num_fields must be >= 1, got {num_fields}")
        if not layer_sizes or any(size < 1 for size in layer_sizes):
            raise ValueError(f"layer_sizes must be one or more sizes >= 1, got {list(layer_sizes)}")
        if split_half and any(size % 2 for size in layer_sizes[:-1]):
            raise ValueError(
                f"layer_sizes = {list(layer_sizes)}: with split_half every size but the last must "
                "be even"
            )
        self.num_fields = num_fields
        self.split_half = split_half
        self.kernels = nn.ParameterList()
        num_maps, output_size = num_fields, 0  # maps fed to the next layer, pooled outputs
        for k, size in enumerate(layer_sizes):
            kernel = torch.empty(size, num_maps * num_fields)
            self.kernels.append(nn.Parameter(nn.init.xavier_uniform_(kernel)))
            last = k == len(layer_sizes) - 1
            num_maps = size // 2 if split_half and not last else size
            output_size += size - num_maps if split_half and not last else size
        self.output_size = output_size

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 3 or embeddings.shape[1] != self.num_fields:
            raise ValueError(
                f"CIN takes embeddings [B, F={self.num_fields}, D], got shape "
                f"{tuple(embeddings.shape)}"
            )
        B, F, D = embeddings.shape
        # Maps kept last ([B, D, H]) so that every layer is a single GEMM over B*D rows.
        x0 = embeddings.transpose(1, 2)  # [B, D, F]
        x = x0  # [B, D, H_0]
        pooled = []
        last = len(self.kernels) - 1
        for k, kernel in enumerate(self.kernels):
            z = (x.unsqueeze(3) * x0.unsqueeze(2)).reshape(B, D, -1)  # [B, D, H_{k-1} * F]
            x = nn.functional.linear(z, kernel)  # [B, D, H_k]
            if self.split_half and k < last:
                x, out = x.chunk(2, dim=2)  # [B, D, H_k / 2] each: next layer, output
            else:
                out = x
            pooled.append(out.sum(dim=1))  # [B, H_k or H_k / 2]
        return torch.cat(pooled, dim=1)  # [B, output_size]


def _check_cross_sizes(in_features: int, num_layers: int) -> None:
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")


def _per_layer(num_layers: int, *shape: int, zeros: bool = False) -> nn.ParameterList:
    """One parameter of ``shape`` per cross layer, xavier-normal (kernels) or zero (biases),
    made one after the other: the order of the seeded init."""
    return nn.ParameterList(
        nn.Parameter(torch.zeros(*shape) if zeros else nn.init.xavier_normal_(torch.empty(*shape)))
        for _ in range(num_layers)
    )


class _KernelBiasCrossNet(nn.Module):
    """The two cross networks whose layer l holds ``kernels.<l>`` [D, K] and ``bias.<l>``
    [D, 1] (torchrec's names and shapes): :class:`CrossNet` (K = D) and
    :class:`VectorCrossNet` (K = 1). A subclass gives K and its cross layer,
    ``_layer(x0, x_l, kernel_l, bias_l [D]) -> x_{l+1}``."""

    def __init__(self, in_features: int, num_layers: int, kernel_width: int, backend: str) -> None:
        super().__init__()
        _check_cross_sizes(in_features, num_layers)
        self.backend = backend
        self.kernels = _per_layer(num_layers, in_features, kernel_width)
        self.bias = _per_layer(num_layers, in_features, 1, zeros=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # [B, D]
        for weight, bias in zip(self.kernels, self.bias, strict=True):
            x = self._layer(x0, x, weight, bias.view(-1))  # [B, D]
        return x


class CrossNet(_KernelBiasCrossNet):
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
        super().__init__(in_features, num_layers, in_features, backend)

    def _layer(
        self, x0: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return cross_layer(x0, x, weight, bias, backend=self.backend)


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
        self.W_kernels = _per_layer(num_layers, in_features, low_rank)
        self.V_kernels = _per_layer(num_layers, low_rank, in_features)
        self.bias = _per_layer(num_layers, in_features, zeros=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # [B, D]
        for u, v, bias in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x = cross_layer_low_rank(x0, x, u, v, bias, backend=self.backend)
        return x


class VectorCrossNet(_KernelBiasCrossNet):
    """DCN-v1 cross network: ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l`` per layer.

    Parameters are named and shaped as in ``torchrec.modules.crossnet.VectorCrossNet``
    (``kernels.<l>`` [D, 1], ``bias.<l>`` [D, 1]). Its arguments are :class:`CrossNet`'s
    (``in_features`` D, ``num_layers``, ``backend``).

    Example::

        VectorCrossNet(16, num_layers=3)(torch.randn(8, 16)).shape  # [8, 16]
    """

    def __init__(self, in_features: int, num_layers: int, backend: str = "auto") -> None:
        super().__init__(in_features, num_layers, 1, backend)

    def _layer(
        self, x0: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return cross_layer_vector(x0, x, weight.view(-1), bias, backend=self.backend)
