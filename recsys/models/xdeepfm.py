"""xDeepFM (Lian et al., 2018, https://arxiv.org/abs/1803.05170): a first-order term, a
compressed interaction network (CIN, explicit vector-wise interactions of bounded degree) and
a deep MLP over the same embeddings, their logits summed.

Data flow, F sparse features of dim D, N_dense dense features, T tasks, CIN sizes H_k::

    dense [B, N_dense] -> dense_arch -> [B, D] ------------------+
    sparse KJT -> sparse_arch -> [B, F*D] -> [B, F, D] ----------+-> fields [B, F+1, D]
    linear_arch(dense, sparse)                                  -> [B, T]  linear
    fields -> inter_arch (CIN, maps sum-pooled over D)          -> [B, sum_k H_k (halved)]
           -> inter_head (one linear layer)                     -> [B, T]  CIN
    fields -> [B, (F+1)*D] -> over_arch                         -> [B, T]  deep
    logits = linear + CIN + deep                                -> [B, T]

Dense features become one more D-dim field through the bottom MLP, as in
:mod:`recsys.models.deepfm` (the paper bucketizes them into categories instead), so the CIN
crosses them with the sparse fields; they also enter the linear term as they are. Without
dense features (``dense_in_features=0``; forward still takes dense [B, 0]) there is no bottom
MLP (``dense_arch_layer_sizes`` is unused), the fields are the F embeddings alone and the
linear term has no dense part.

CIN split-half (``cin_split_half``, default True as in the authors' released code): every
CIN layer but the last sends half of its maps to the output and half to the next layer; see
:class:`~recsys.models.layers.CIN`. False follows the paper's equations, every map going to
both.

Multi-task: the linear term's dense part and bias, the CIN head and the deep MLP have T outputs;
the sparse linear weights are shared by the tasks when their tables have dimension 1 (see
:class:`~recsys.models.layers.LinearArch`).
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import FieldModel, num_tasks_of, top_mlp
from recsys.models.layers import CIN, FusedMLP


class XDeepFM(FieldModel):
    """xDeepFM over an EmbeddingBagCollection whose tables all have the same dimension D.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D, shared by the CIN and
            the deep part.
        linear_embedding_bag_collection: dimension-1 twins of its tables (see
            ``recsys.models.linear_table_configs``), the linear term's weights; dimension-T
            tables give each task its own.
        dense_in_features: number of dense features N_dense; 0 for none (see the module
            docstring).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (unused without dense
            features).
        cin_layer_sizes: feature maps H_k of each CIN layer (even but the last with
            ``cin_split_half``).
        over_arch_layer_sizes: deep MLP sizes; the last is the number of tasks T.
        activation: activation of the MLPs' hidden layers (``"relu"``, ``"gelu"``, ``"silu"``).
        dropout: dropout after each hidden MLP layer, in training only.
        cin_split_half: halve every CIN layer but the last between output and next layer.

    Example::

        tables = table_configs(spec.sparse_names, spec.cardinalities, embedding_dim=16)
        model = XDeepFM(EmbeddingBagCollection(tables),
                        EmbeddingBagCollection(linear_table_configs(tables)),
                        dense_in_features=13, dense_arch_layer_sizes=[64, 16],
                        cin_layer_sizes=[64, 64], over_arch_layer_sizes=[128, 64, 1])
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        linear_embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        cin_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        cin_split_half: bool = True,
    ) -> None:
        num_tasks = num_tasks_of(over_arch_layer_sizes)
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector is one more CIN field",
            activation=activation,
            dropout=dropout,
            linear_embedding_bag_collection=linear_embedding_bag_collection,
            num_tasks=num_tasks,
        )
        self.inter_arch = CIN(self.num_fields, cin_layer_sizes, split_half=cin_split_half)
        self.inter_head = FusedMLP(self.inter_arch.output_size, [num_tasks], final_activation=False)
        deep_in_features = self.num_fields * self.embedding_dim
        self.over_arch = top_mlp(deep_in_features, over_arch_layer_sizes, activation, dropout)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        fields = self.fields(dense_features, sparse_features)  # [B, F(+1), D]
        linear = self.linear_arch(dense_features, sparse_features)  # [B, T]
        cin = self.inter_head(self.inter_arch(fields))  # [B, T]
        deep = self.over_arch(fields.flatten(1))  # [B, T]
        return linear + cin + deep  # [B, T]
