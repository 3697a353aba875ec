"""PNN (Qu et al., 2016, "Product-based Neural Networks for User Response Prediction",
https://arxiv.org/abs/1611.00144): a product layer over the feature embeddings, then an MLP.

The dense features join the products as one more field: the bottom MLP maps them to a D-dim
vector e_0 (as in DLRM), so the product layer sees F+1 fields. Its output is the linear signal
z (the F+1 embeddings, flattened) and the quadratic signal p, concatenated (see
:class:`~recsys.models.layers.ProductLayer`); the top MLP's first layer is the paper's
relu(W_z z + W_p p + b). Without dense features (``dense_in_features=0``; forward still takes
dense [B, 0]) there is no bottom MLP (``dense_arch_layer_sizes`` is unused) and the product
layer sees the F embeddings alone (F for F+1 below).

Data flow, F sparse features of dim D, T tasks::

    dense [B, N_dense] -> dense_arch -> e_0 [B, D] ---------------+
    sparse KJT -> sparse_arch -> [B, F*D] -> e_1..e_F [B, F, D] --+-> [B, F+1, D]
    -> inter_arch (product) -> [z | p] [B, W] -> over_arch -> logits [B, T]

    W = (F+1)*D + P, P = (F+1)F/2 inner products ("inner"), D(D+1)/2 outer-product entries
    ("outer", the upper triangle of s s^T with s = sum of the F+1 embeddings), or both ("both").
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import FieldModel, num_tasks_of, top_mlp
from recsys.models.layers import ProductLayer


class PNN(FieldModel):
    """PNN over an EmbeddingBagCollection whose tables all have the same dimension D.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D.
        dense_in_features: number of dense features N_dense; 0 for none (see the module
            docstring).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (the dense vector is
            one more field of the products); unused without dense features.
        over_arch_layer_sizes: top MLP sizes; the last is the number of tasks T.
        activation: activation of the MLPs' hidden layers (``"relu"``, ``"gelu"``, ``"silu"``).
        dropout: dropout after each activated MLP layer, in training only.
        product: ``"inner"`` (IPNN), ``"outer"`` (OPNN) or ``"both"`` (PNN*).

    Example::

        model = PNN(ebc, dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                    over_arch_layer_sizes=[128, 64, 1], product="inner")
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
        product: str = "inner",
    ) -> None:
        num_tasks_of(over_arch_layer_sizes)  # checks that there is one
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector is one more field of the products",
            activation=activation,
            dropout=dropout,
        )
        self.inter_arch = ProductLayer(self.num_fields, self.embedding_dim, product=product)
        over_in_features = self.inter_arch.out_features
        self.over_arch = top_mlp(over_in_features, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        fields = self.fields(dense_features, sparse_features)  # [B, F(+1), D]
        products = self.inter_arch(fields)  # [B, W]
        return self.over_arch(products)  # [B, T]
