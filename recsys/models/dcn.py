"""Deep & Cross Network: DCN-v1 (Wang et al., 2017, https://arxiv.org/abs/1708.05123) and
DCN-v2 (Wang et al., 2021, https://arxiv.org/abs/2008.13535).

The raw dense features and every pooled embedding, concatenated, form x0 of width
W = N_dense + sum_f D_f; a cross network (v2: full- or low-rank matrix layers, v1: vector
layers) and a deep MLP read it, one after the other or side by side, and a final linear layer
gives the logits::

    dense [B, N_dense] ----------------------+
    sparse KJT -> sparse_arch -> [B, sum D_f] +-> concat x0 [B, W]
    stacked:   x0 -> cross_arch [B, W] -> deep_arch [B, H] -> over_arch -> logits [B, T]
    parallel:  x0 -> cross_arch [B, W] --+
               x0 -> deep_arch  [B, H] --+-> concat [B, W + H] -> over_arch -> logits [B, T]

H is the deep network's last hidden width. Unlike DLRM there is no bottom MLP and tables may
have different dims.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.fields import flat_width
from recsys.models.layers import CrossNet, FusedMLP, LowRankCrossNet, VectorCrossNet

VERSIONS = ("v2", "v1")
STRUCTURES = ("stacked", "parallel")


class DCN(nn.Module):
    """DCN-v1 / DCN-v2 over an EmbeddingBagCollection (tables of any dims).

    ``over_arch_layer_sizes`` is the deep network followed by the number of tasks:
    ``[H_1, ..., H_k, T]`` builds ``deep_arch`` = FusedMLP ``[H_1, ..., H_k]`` (every layer
    activated) and ``over_arch`` = one linear layer to T logits. In the stacked structure the
    two form one MLP ``over_arch_layer_sizes`` on the cross network's output; in the parallel
    structure the deep network reads x0 and ``over_arch`` reads [cross output | deep output]
    (W + H_k wide). At least one deep layer is required (k >= 1).

    Args:
        embedding_bag_collection: the sparse arch; F features of dims D_f.
        dense_in_features: number of dense features N_dense, fed to the cross network as they
            are (there is no bottom MLP); 0 for none.
        over_arch_layer_sizes: ``[H_1, ..., H_k, T]`` as above.
        activation: activation of the deep network's layers.
        dropout: dropout after each deep layer, in training only.
        num_cross_layers: number of cross layers (>= 0).
        low_rank: v2 only: rank r of each layer's weight U V; 0 for a full-rank [W, W] matrix.
        version: ``"v2"`` (matrix layers) or ``"v1"`` (vector layers).
        structure: ``"stacked"`` (deep after cross) or ``"parallel"`` (both on x0).

    Example::

        model = DCN(ebc, dense_in_features=13, over_arch_layer_sizes=[256, 64, 1],
                    num_cross_layers=3, low_rank=64, structure="parallel")
        logits = model(dense_features, sparse_features)  # f32[B, 1]
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        over_arch_layer_sizes: list[int],
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        num_cross_layers: int = 3,
        low_rank: int = 0,
        version: Literal["v2", "v1"] = "v2",
        structure: Literal["stacked", "parallel"] = "stacked",
    ) -> None:
        super().__init__()
        if version not in VERSIONS:
            raise ValueError(f"version = {version!r}; expected one of {VERSIONS}")
        if structure not in STRUCTURES:
            raise ValueError(f"structure = {structure!r}; expected one of {STRUCTURES}")
        if len(over_arch_layer_sizes) < 2:
            raise ValueError(
                f"over_arch_layer_sizes = {over_arch_layer_sizes} needs at least one deep layer "
                "and the number of tasks, e.g. [64, 1]"
            )
        if num_cross_layers < 0:
            raise ValueError(f"num_cross_layers must be >= 0, got {num_cross_layers}")
        if low_rank < 0:
            raise ValueError(f"low_rank must be >= 0 (0: full rank), got {low_rank}")
        if version == "v1" and low_rank > 0:
            raise ValueError(
                f"low_rank = {low_rank} applies to version 'v2' only; DCN-v1's cross layers "
                "are vectors"
            )
        cross_width = flat_width(embedding_bag_collection, dense_in_features)
        *deep_sizes, num_tasks = over_arch_layer_sizes
        self.structure = structure
        self.sparse_arch = embedding_bag_collection
        self.cross_arch: nn.Module
        if version == "v1":
            self.cross_arch = VectorCrossNet(cross_width, num_cross_layers)
        elif low_rank > 0:
            self.cross_arch = LowRankCrossNet(cross_width, num_cross_layers, low_rank)
        else:
            self.cross_arch = CrossNet(cross_width, num_cross_layers)
        self.deep_arch = FusedMLP(cross_width, deep_sizes, activation=activation, dropout=dropout)
        over_in_features = deep_sizes[-1] + (cross_width if structure == "parallel" else 0)
        self.over_arch = FusedMLP(over_in_features, [num_tasks], final_activation=False)

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        pooled = self.sparse_arch(sparse_features).values()  # [B, sum D_f]
        x0 = torch.cat([dense_features, pooled], dim=1)  # [B, W]
        crossed = self.cross_arch(x0)  # [B, W]
        if self.structure == "stacked":
            top = self.deep_arch(crossed)  # [B, H]
        else:
            top = torch.cat([crossed, self.deep_arch(x0)], dim=1)  # [B, W + H]
        return self.over_arch(top)  # [B, T]
