"""GatedDLRM: DLRM's bottom and top MLPs around a gated cross network (GDCN, Wang et al.,
"Towards Deeper, Lighter and Interpretable Cross Network for CTR Prediction", CIKM 2023).

The cross network reads x0 = [bottom MLP(dense), e_1, ..., e_F] (one embedding per categorical
feature) and applies ``cross_layers`` gated cross layers

    x_{l+1} = x0 * (W_l x_l + b_l) * sigmoid(G_l x_l) + x_l

(the information gate ``sigmoid(G_l x_l)`` decides, per element, how much of each crossed
feature passes); the top MLP maps the result to one logit per task.

The constructor follows recsys' model contract: ``embedding_bag_collection``,
``dense_in_features``, ``dense_arch_layer_sizes`` and ``over_arch_layer_sizes`` come from the
trainer by name, ``cross_layers`` from ``[model.args]``.
"""

from __future__ import annotations

import torch
from torch import nn

from recsys import EmbeddingBagCollection, KeyedJaggedTensor
from recsys.models.layers import FusedMLP


class GatedCross(nn.Module):
    """One gated cross layer over vectors of ``width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.cross = nn.Linear(width, width)
        self.gate = nn.Linear(width, width, bias=False)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.cross(x) * torch.sigmoid(self.gate(x)) + x


class GatedDLRM(nn.Module):
    """Bottom MLP, a gated cross network over [dense vector, embeddings], top MLP.

    Args:
        embedding_bag_collection: one table per categorical feature, all of one dimension D.
        dense_in_features: the number of dense features.
        dense_arch_layer_sizes: the bottom MLP; it ends with D.
        over_arch_layer_sizes: the top MLP; it ends with the number of tasks.
        cross_layers: gated cross layers (``[model.args] cross_layers``).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        *,
        cross_layers: int = 2,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        self.dim = configs[0].embedding_dim
        self.num_features = sum(len(c.feature_names) for c in configs)
        if cross_layers < 1:
            raise ValueError(f"cross_layers={cross_layers}; expected >= 1")
        self.sparse_arch = embedding_bag_collection
        self.dense_arch = FusedMLP(dense_in_features, dense_arch_layer_sizes)
        width = (self.num_features + 1) * self.dim
        self.cross_arch = nn.ModuleList(GatedCross(width) for _ in range(cross_layers))
        self.over_arch = FusedMLP(width, over_arch_layer_sizes, final_activation=False)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        batch = dense_features.shape[0]
        embedded = self.sparse_arch(sparse_features).values()  # [B, F * D]
        x0 = torch.cat([self.dense_arch(dense_features), embedded.view(batch, -1)], dim=1)
        x = x0
        for layer in self.cross_arch:
            x = layer(x0, x)
        return self.over_arch(x)  # [B, T] logits
