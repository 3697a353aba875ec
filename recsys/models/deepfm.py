"""DeepFM (Guo et al., 2017, https://arxiv.org/abs/1703.04247): a first-order term, a
factorization machine and a deep MLP over the same embeddings, their logits summed.

Data flow, F sparse features of dim D, N_dense dense features, T tasks::

    dense [B, N_dense] -> dense_arch -> [B, D] ------------------+
    sparse KJT -> sparse_arch -> [B, F*D] -> [B, F, D] ----------+-> fields [B, F+1, D]
    linear_arch(dense, sparse)                                  -> [B, T]  first order
    fields -> inter_arch (FM, sum over pairs and D)             -> [B, 1]  second order
    fields -> [B, (F+1)*D] -> over_arch                         -> [B, T]  deep
    logits = first order + second order + deep                  -> [B, T]

Dense features: the paper's data has them bucketized into categories, so every field is an
embedding. Here the bottom MLP projects them to one more D-dim field (as DLRM and TorchRec's
DeepFM do), so the FM models dense x sparse pairs as it does sparse x sparse ones, which it
could not if the dense features only fed the first-order and deep parts; they also enter the
first-order term as they are. Without dense features (``dense_in_features=0``; forward
still takes dense [B, 0]) there is no bottom MLP (``dense_arch_layer_sizes`` is unused), the
fields are the F embeddings alone and the first-order term has no dense part.

Multi-task: the first-order dense term, the bias and the deep MLP have T outputs; the FM term
has no weights of its own and is added to every task (so are the sparse first-order weights
when their tables have dimension 1, see :class:`~recsys.models.layers.LinearArch`).
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import FieldModel, num_tasks_of, top_mlp
from recsys.models.layers import FactorizationMachine


class DeepFM(FieldModel):
    """DeepFM over an EmbeddingBagCollection whose tables all have the same dimension D.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D, shared by the FM and
            the deep part.
        linear_embedding_bag_collection: dimension-1 twins of its tables (see
            ``recsys.models.linear_table_configs``), the first-order weights; dimension-T
            tables give each task its own.
        dense_in_features: number of dense features N_dense; 0 for none (see the module
            docstring).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (unused without dense
            features).
        over_arch_layer_sizes: deep MLP sizes; the last is the number of tasks T.
        activation: activation of the MLPs' hidden layers (``"relu"``, ``"gelu"``, ``"silu"``).
        dropout: dropout after each hidden MLP layer, in training only.

    Example::

        tables = table_configs(spec.sparse_names, spec.cardinalities, embedding_dim=16)
        model = DeepFM(EmbeddingBagCollection(tables),
                       EmbeddingBagCollection(linear_table_configs(tables)),
                       dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                       over_arch_layer_sizes=[128, 64, 1])
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        linear_embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
    ) -> None:
        num_tasks = num_tasks_of(over_arch_layer_sizes)
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector is one more FM field",
            activation=activation,
            dropout=dropout,
            linear_embedding_bag_collection=linear_embedding_bag_collection,
            num_tasks=num_tasks,
        )
        self.inter_arch = FactorizationMachine(reduce_sum=True)
        deep_in_features = self.num_fields * self.embedding_dim
        self.over_arch = top_mlp(deep_in_features, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        fields = self.fields(dense_features, sparse_features)  # [B, F(+1), D]
        first_order = self.linear_arch(dense_features, sparse_features)  # [B, T]
        second_order = self.inter_arch(fields)  # [B, 1]
        deep = self.over_arch(fields.flatten(1))  # [B, T]
        return first_order + second_order + deep  # [B, T]
