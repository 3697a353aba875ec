"""MMoE (Ma et al., 2018, "Modeling Task Relationships in Multi-task Learning with Multi-gate
Mixture-of-Experts", https://doi.org/10.1145/3219819.3220007): experts shared by all tasks,
one softmax gate per task that mixes them, and one tower per task.

Data flow, N_dense dense features, F sparse features of dims D_f, K experts, T tasks::

    dense [B, N_dense] --------------------------------+
    sparse KJT -> sparse_arch -> pooled [B, sum_f D_f] -+-> x [B, N_in]
    -> moe_arch: K expert MLPs [B, K, E], T gates [B, T, K] -> mixed [B, T, E]
    -> tower_arch[t](mixed[:, t]) [B, 1] for each task t -> logits [B, T]

    N_in = N_dense + sum_f D_f; E = expert_layer_sizes[-1].
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import flat_width, top_mlp
from recsys.models.layers import MixtureOfExperts


class MMoE(nn.Module):
    """Multi-gate mixture of experts over an EmbeddingBagCollection (tables of any dims).

    Args:
        embedding_bag_collection: the sparse arch.
        dense_in_features: number of dense features N_dense (fed to the experts as they are);
            0 for none.
        expert_layer_sizes: each expert's MLP sizes; the last is E.
        tower_layer_sizes: hidden sizes of each task's tower (may be empty); a last layer to
            one logit is added.
        num_tasks: T, the number of towers and logits.
        activation: activation of the hidden layers of experts and towers.
        dropout: dropout after each activated layer, in training only.
        num_experts: K, experts shared by all tasks.

    Example::

        model = MMoE(ebc, dense_in_features=13, expert_layer_sizes=[64, 32],
                     tower_layer_sizes=[32], num_tasks=2, num_experts=4)
        logits = model(dense_features, sparse_features)  # f32[B, 2]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        expert_layer_sizes: list[int],
        tower_layer_sizes: list[int],
        num_tasks: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        num_experts: int = 4,
    ) -> None:
        super().__init__()
        in_features = flat_width(embedding_bag_collection, dense_in_features)
        self.sparse_arch = embedding_bag_collection
        self.moe_arch = MixtureOfExperts(
            in_features,
            expert_layer_sizes,
            num_experts=num_experts,
            num_tasks=num_tasks,
            activation=activation,
            dropout=dropout,
        )
        self.tower_arch = nn.ModuleList(
            top_mlp(self.moe_arch.out_features, [*tower_layer_sizes, 1], activation, dropout)
            for _ in range(num_tasks)
        )

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features).values()  # [B, sum_f D_f]
        x = torch.cat([dense_features, pooled], dim=1)  # [B, N_in]
        mixed = self.moe_arch(x)  # [B, T, E]
        logits = [tower(mixed[:, t]) for t, tower in enumerate(self.tower_arch)]  # T x [B, 1]
        return torch.cat(logits, dim=1)  # [B, T]
