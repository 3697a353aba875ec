"""The fields of the models that stack their inputs as [B, F(+1), D] (DLRM, DLRM-DCN, DeepFM,
xDeepFM, PNN): the one embedding dim D of the tables, and the bottom MLP that makes the dense
features one more D-dim field.

A dataset may have no dense feature at all (Avazu-like logs, rating logs): then there is no
bottom MLP (:func:`bottom_mlp` returns None, whatever ``dense_arch_layer_sizes`` says) and the
fields are the F embeddings alone. The model's forward still takes ``dense_features`` [B, 0].

Shape letters: B batch, F sparse features, D embedding dim, N_dense dense features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.layers import FusedMLP


def shared_embedding_dim(embedding_bag_collection: EmbeddingBagCollection, model: str) -> int:
    """The one embedding_dim of every table of the collection, for models that stack the
    pooled embeddings into [B, F, D]; ``ValueError`` naming ``model`` otherwise."""
    dims = {c.embedding_dim for c in embedding_bag_collection.embedding_bag_configs()}
    if len(dims) != 1:
        raise ValueError(f"{model} needs all tables to have one embedding_dim, got {sorted(dims)}")
    (embedding_dim,) = dims
    return embedding_dim


def num_sparse_features(embedding_bag_collection: EmbeddingBagCollection) -> int:
    """F: the features the collection pools (a table may serve several)."""
    return sum(len(c.feature_names) for c in embedding_bag_collection.embedding_bag_configs())


def bottom_mlp(
    dense_in_features: int,
    dense_arch_layer_sizes: Sequence[int],
    embedding_dim: int,
    why: str,
    *,
    activation: str = "relu",
    dropout: float = 0.0,
) -> FusedMLP | None:
    """The bottom MLP that maps the N_dense dense features to one D-dim vector, or None when
    N_dense = 0 (``dense_arch_layer_sizes`` is then unused and not checked).

    Args:
        dense_in_features: N_dense (>= 0).
        dense_arch_layer_sizes: the MLP's sizes; the last must be ``embedding_dim``.
        embedding_dim: D.
        why: what the dense vector joins, for the error message.
        activation: activation of every layer (the last one too).
        dropout: dropout after each layer, in training only.

    Raises:
        ValueError: N_dense < 0, or dense features and sizes that do not end with D.
    """
    if dense_in_features < 0:
        raise ValueError(f"dense_in_features must be >= 0 (0: none), got {dense_in_features}")
    if dense_in_features == 0:
        return None
    if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != embedding_dim:
        raise ValueError(
            f"dense_arch_layer_sizes = {list(dense_arch_layer_sizes)} must end with the "
            f"embedding_dim {embedding_dim} ({why})"
        )
    return FusedMLP(
        dense_in_features, dense_arch_layer_sizes, activation=activation, dropout=dropout
    )


def stack_fields(
    embedded_dense: torch.Tensor | None, pooled: torch.Tensor, embedding_dim: int
) -> torch.Tensor:
    """[e_0; e_1; ...; e_F] [B, F+1, D] from the bottom MLP's output e_0 [B, D] and the pooled
    embeddings [B, F*D]; [B, F, D] when there is no dense vector (None)."""
    embedded_sparse = pooled.view(pooled.shape[0], -1, embedding_dim)  # [B, F, D]
    if embedded_dense is None:
        return embedded_sparse
    return torch.cat([embedded_dense.unsqueeze(1), embedded_sparse], dim=1)  # [B, F+1, D]
