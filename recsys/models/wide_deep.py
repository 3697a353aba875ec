"""Wide & Deep (Cheng et al., 2016, https://arxiv.org/abs/1606.07792): a linear model over the
raw sparse and dense features (wide) plus an MLP over the dense features and the embeddings
(deep), trained jointly; their logits summed.

Data flow, F sparse features of dims D_f, N_dense dense features, T tasks::

    wide_arch(dense, sparse)                                    -> [B, T]
        sum_f w_f[ids of f] (dimension-1 tables) + linear(dense) + bias
    sparse KJT -> sparse_arch -> [B, sum_f D_f] --+
    dense [B, N_dense] ---------------------------+-> [B, N_dense + sum_f D_f]
        -> over_arch (deep MLP)                                 -> [B, T]
    logits = wide + deep                                        -> [B, T]

The paper's wide part also takes hand-made cross-product features; give them to the wide
collection as extra features of the input KJT (it looks up only its own features). The paper
trains the wide part with FTRL + L1 and the deep part with AdaGrad; here the wide weights are
tables and take the run's embedding optimizer. The deep MLP concatenates the embeddings, so
the tables need not share one dimension.

Multi-task: the wide dense term, the bias and the deep MLP have T outputs; the wide sparse
weights are shared by the tasks when their tables have dimension 1 (see
:class:`~recsys.models.layers.LinearArch`).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import flat_width, num_tasks_of, top_mlp
from recsys.models.layers import LinearArch


class WideDeep(nn.Module):
    """Wide & Deep over an EmbeddingBagCollection (any table dimensions).

    Args:
        embedding_bag_collection: the sparse arch of the deep part.
        linear_embedding_bag_collection: the wide part's per-id weights: dimension-1 tables
            (see ``recsys.models.linear_table_configs``), or dimension-T ones for weights of
            each task's own (see :class:`~recsys.models.layers.LinearArch`).
        dense_in_features: number of dense features N_dense; 0 for none (the wide part has no
            dense term then, and the deep MLP reads the embeddings alone).
        over_arch_layer_sizes: deep MLP sizes; the last is the number of tasks T.
        activation: activation of the MLP's hidden layers (``"relu"``, ``"gelu"``, ``"silu"``).
        dropout: dropout after each hidden MLP layer, in training only.

    Example::

        tables = table_configs(spec.sparse_names, spec.cardinalities, embedding_dim=16)
        model = WideDeep(EmbeddingBagCollection(tables),
                         EmbeddingBagCollection(linear_table_configs(tables)),
                         dense_in_features=13, over_arch_layer_sizes=[256, 128, 1])
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        linear_embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        over_arch_layer_sizes: list[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        num_tasks = num_tasks_of(over_arch_layer_sizes)
        deep_in_features = flat_width(embedding_bag_collection, dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.wide_arch = LinearArch(linear_embedding_bag_collection, dense_in_features, num_tasks)
        self.over_arch = top_mlp(deep_in_features, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        wide = self.wide_arch(dense_features, sparse_features)  # [B, T]
        pooled = self.sparse_arch(sparse_features).values()  # [B, sum_f D_f]
        deep_input = torch.cat([dense_features, pooled], dim=1)  # [B, N_dense + sum_f D_f]
        deep = self.over_arch(deep_input)  # [B, T]
        return wide + deep  # [B, T]
