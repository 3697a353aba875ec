"""DLRM (Naumov et al., 2019, https://arxiv.org/abs/1906.00091) and DLRM-DCNv2 (MLPerf's DLRM:
the dot interaction replaced by a DCN-v2 cross network, Wang et al., 2021,
https://arxiv.org/abs/2008.13535). Constructors and forward mirror
``torchrec.models.dlrm.DLRM`` and ``torchrec.models.dlrm.DLRM_DCN``.

Data flow, F sparse features of dim D, T tasks::

    DLRM       dense [B, N_dense] -> dense_arch -> [B, D] ---------+
               sparse KJT -> sparse_arch -> [B, F*D] -> [B, F, D] -+-> inter_arch (dot)
               -> [B, D + F(F+1)/2] -> over_arch -> logits [B, T]
    DLRM_DCN   dense_arch [B, D] | sparse_arch [B, F*D] -> concat [B, (F+1)*D]
               -> inter_arch (cross network) -> [B, (F+1)*D] -> over_arch -> logits [B, T]

Without dense features (``dense_in_features=0``; forward still takes dense [B, 0]) there is
no bottom MLP and ``dense_arch_layer_sizes`` is unused: DLRM's dot interaction runs over the F
embeddings alone, the first taking the dense vector's place ([e_1 | <e_i, e_j> for i < j],
[B, D + F(F-1)/2]), and DLRM_DCN's cross network over [e_1, ..., e_F] ([B, F*D]).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import FieldModel, top_mlp
from recsys.models.layers import CrossNet, DotInteraction, LowRankCrossNet


class DLRM(FieldModel):
    """DLRM over an EmbeddingBagCollection whose tables all have the same dimension D.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D.
        dense_in_features: number of dense features N_dense; 0 for none (no bottom MLP, see
            the module docstring).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (unused without dense
            features).
        over_arch_layer_sizes: top MLP sizes; the last is the number of tasks T (1 for CTR).
        activation: activation of the MLPs' hidden layers (``"relu"``, ``"gelu"``, ``"silu"``).
        dropout: dropout after each activated MLP layer, in training only.

    Example::

        model = DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                     over_arch_layer_sizes=[64, 1])
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector joins the dot products",
            activation=activation,
            dropout=dropout,
        )
        # Without a dense vector the first embedding takes its place.
        self.inter_arch = DotInteraction(self.num_fields - 1)
        over_in_features = self.inter_arch.output_size(self.embedding_dim)
        self.over_arch = top_mlp(over_in_features, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        embedded_sparse = self.sparse_fields(sparse_features)  # [B, F, D]
        if self.dense_arch is None:
            first, others = embedded_sparse[:, 0], embedded_sparse[:, 1:]  # [B, D], [B, F-1, D]
            interaction = self.inter_arch(first, others)  # [B, D + F(F-1)/2]
        else:
            embedded_dense = self.dense_arch(dense_features)  # [B, D]
            interaction = self.inter_arch(embedded_dense, embedded_sparse)  # [B, D + (F+1)F/2]
        return self.over_arch(interaction)  # [B, T]


class DLRM_DCN(FieldModel):
    """DLRM-DCNv2 (MLPerf's DLRM): DLRM with a DCN-v2 cross network in place of the dot
    interaction, over an EmbeddingBagCollection whose tables all have the same dimension D.

    The cross network runs on [dense_emb, e_1, ..., e_F] flattened to [B, (F+1)*D]: a
    :class:`~recsys.models.layers.LowRankCrossNet` of rank ``dcn_low_rank_dim`` when it is > 0
    (torchrec's ``DLRM_DCN`` is always low rank; MLPerf uses 512), else a full-rank
    :class:`~recsys.models.layers.CrossNet`. With ``dcn_low_rank_dim > 0`` the parameters and
    their order match ``torchrec.models.dlrm.DLRM_DCN``'s.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D.
        dense_in_features: number of dense features N_dense; 0 for none (no bottom MLP: the
            cross network runs on the F embeddings, [B, F*D]).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (unused without dense
            features).
        over_arch_layer_sizes: top MLP sizes; the last is the number of tasks T.
        dcn_num_layers: number of cross layers (>= 0).
        dcn_low_rank_dim: rank r of each cross layer's weight U V, U [W, r] and V [r, W]
            (W = (F+1)*D, F*D without dense features); 0 for a full-rank W [W, W].
        activation: activation of the MLPs' hidden layers.
        dropout: dropout after each activated MLP layer, in training only.

    Example::

        model = DLRM_DCN(ebc, dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                         over_arch_layer_sizes=[64, 1], dcn_num_layers=3, dcn_low_rank_dim=64)
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        if dcn_num_layers < 0:
            raise ValueError(f"dcn_num_layers must be >= 0, got {dcn_num_layers}")
        if dcn_low_rank_dim < 0:
            raise ValueError(
                f"dcn_low_rank_dim must be >= 0 (0: full rank), got {dcn_low_rank_dim}"
            )
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector joins the cross network",
            activation=activation,
            dropout=dropout,
        )
        cross_width = self.num_fields * self.embedding_dim
        self.inter_arch: nn.Module
        if dcn_low_rank_dim > 0:
            self.inter_arch = LowRankCrossNet(cross_width, dcn_num_layers, dcn_low_rank_dim)
        else:
            self.inter_arch = CrossNet(cross_width, dcn_num_layers)
        self.over_arch = top_mlp(cross_width, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features).values()  # [B, F*D]
        if self.dense_arch is None:
            combined = pooled  # [B, F*D]
        else:
            embedded_dense = self.dense_arch(dense_features)  # [B, D]
            combined = torch.cat([embedded_dense, pooled], dim=1)  # [B, (F+1)*D]
        crossed = self.inter_arch(combined)  # [B, W]
        return self.over_arch(crossed)  # [B, T]
