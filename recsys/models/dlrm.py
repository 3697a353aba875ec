"""DLRM (Naumov et al., 2019): bottom MLP on dense features, dot interaction with the pooled
embeddings, top MLP to the logits. Constructor and forward mirror ``torchrec.models.dlrm.DLRM``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.layers import DotInteraction, FusedMLP


class DLRM(nn.Module):
    """DLRM over an EmbeddingBagCollection whose tables all have the same dimension D.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D.
        dense_in_features: number of dense features N_dense.
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D.
        over_arch_layer_sizes: top MLP sizes; the last is the number of tasks T (1 for CTR).

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
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        dims = {c.embedding_dim for c in configs}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs all tables to have one embedding_dim, got {sorted(dims)}")
        (embedding_dim,) = dims
        if dense_arch_layer_sizes[-1] != embedding_dim:
            raise ValueError(
                f"dense_arch_layer_sizes[-1] = {dense_arch_layer_sizes[-1]} must equal the "
                f"embedding_dim {embedding_dim} (the dense vector joins the dot products)"
            )
        num_sparse = sum(len(c.feature_names) for c in configs)
        self.embedding_dim = embedding_dim
        self.sparse_arch = embedding_bag_collection
        self.dense_arch = FusedMLP(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = DotInteraction(num_sparse)
        self.over_arch = FusedMLP(
            self.inter_arch.output_size(embedding_dim),
            over_arch_layer_sizes,
            final_activation=False,
        )

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        B = dense_features.shape[0]
        embedded_dense = self.dense_arch(dense_features)  # [B, D]
        pooled = self.sparse_arch(sparse_features).values()  # [B, F*D]
        embedded_sparse = pooled.view(B, -1, self.embedding_dim)  # [B, F, D]
        interaction = self.inter_arch(embedded_dense, embedded_sparse)  # [B, D + (F+1)F/2]
        return self.over_arch(interaction)  # [B, T]
