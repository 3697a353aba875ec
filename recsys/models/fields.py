"""The input and output sides every model of the zoo shares, so that a model file holds its
architecture only.

A model sees the dense features [B, N_dense] and the pooled embeddings of its sparse arch in
one of two ways:

- As fields (DLRM, DLRM-DCN, DeepFM, xDeepFM, PNN): every table has one embedding dim D and
  the bottom MLP makes the dense features one more D-dim field, [B, F+1, D].
  :class:`FieldModel` is their base: it owns the sparse arch, the first-order term
  (:class:`~recsys.models.layers.LinearArch`, DeepFM and xDeepFM) and the bottom MLP, and
  stacks the fields.
- As one flat vector (Wide & Deep, DCN, MMoE): [dense | pooled], [B, N_dense + sum_f D_f],
  of :func:`flat_width`; tables may have any dims.

A dataset may have no dense feature at all (Avazu-like logs, rating logs): then there is no
bottom MLP (``dense_arch`` is None, whatever ``dense_arch_layer_sizes`` says) and the fields
are the F embeddings alone. The model's forward still takes ``dense_features`` [B, 0].

Every model ends with a top MLP to T logits (:func:`top_mlp`).

Shape letters: B batch, F sparse features, D embedding dim, N_dense dense features, T tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.layers import FusedMLP, LinearArch


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


def flat_width(embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int) -> int:
    """N_dense + sum_f D_f: the width of [dense | pooled], the input of the models that read
    the raw dense features beside the embeddings (tables of any dims).

    Raises:
        ValueError: N_dense < 0.
    """
    if dense_in_features < 0:
        raise ValueError(f"dense_in_features must be >= 0 (0: none), got {dense_in_features}")
    configs = embedding_bag_collection.embedding_bag_configs()
    return dense_in_features + sum(c.embedding_dim * len(c.feature_names) for c in configs)


def num_tasks_of(over_arch_layer_sizes: Sequence[int]) -> int:
    """T, the last of ``over_arch_layer_sizes``; ``ValueError`` when there is none."""
    if not over_arch_layer_sizes:
        raise ValueError("over_arch_layer_sizes must end with the number of tasks, got []")
    return over_arch_layer_sizes[-1]


def top_mlp(
    in_features: int, layer_sizes: Sequence[int], activation: str, dropout: float
) -> FusedMLP:
    """The MLP that ends a model: ``layer_sizes`` (the last is T), every layer but the last
    activated (and dropped out), so that it returns logits."""
    return FusedMLP(
        in_features, layer_sizes, activation=activation, dropout=dropout, final_activation=False
    )


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


class FieldModel(nn.Module):
    """Base of the models that read their inputs as D-dim fields [B, F(+1), D].

    Registers, in this order (the order in which parameters are made, so the initial weights
    under a seed, and the order of the state_dict): ``sparse_arch`` (the collection),
    ``linear_arch`` (a :class:`~recsys.models.layers.LinearArch` of T outputs, only when
    ``linear_embedding_bag_collection`` is given) and ``dense_arch`` (the bottom MLP, None
    without dense features). Sets ``embedding_dim`` (D) and ``num_fields`` (F, plus 1 with a
    bottom MLP). A subclass adds its interaction and top MLP after ``super().__init__``.

    Args:
        embedding_bag_collection: the sparse arch; F features of dim D (one D for all tables,
            else ``ValueError`` naming the model's class).
        dense_in_features: N_dense; 0 for none (no bottom MLP).
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D (unused without dense
            features).
        why: what the dense vector joins, for the error message of sizes that do not end
            with D.
        activation: activation of the bottom MLP's layers.
        dropout: dropout after each bottom MLP layer, in training only.
        linear_embedding_bag_collection: the first-order term's tables, or None for no
            first-order term.
        num_tasks: T, the first-order term's outputs.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        *,
        why: str,
        activation: str,
        dropout: float,
        linear_embedding_bag_collection: EmbeddingBagCollection | None = None,
        num_tasks: int = 1,
    ) -> None:
        super().__init__()
        embedding_dim = shared_embedding_dim(embedding_bag_collection, type(self).__name__)
        self.embedding_dim = embedding_dim
        self.sparse_arch = embedding_bag_collection
        if linear_embedding_bag_collection is not None:
            self.linear_arch = LinearArch(
                linear_embedding_bag_collection, dense_in_features, num_tasks
            )
        self.dense_arch = bottom_mlp(
            dense_in_features,
            dense_arch_layer_sizes,
            embedding_dim,
            why,
            activation=activation,
            dropout=dropout,
        )
        num_sparse = num_sparse_features(embedding_bag_collection)
        self.num_fields = num_sparse + (self.dense_arch is not None)

    def sparse_fields(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """The pooled embeddings [e_1; ...; e_F], [B, F, D]."""
        pooled = self.sparse_arch(sparse_features).values()  # [B, F*D]
        return pooled.view(pooled.shape[0], -1, self.embedding_dim)  # [B, F, D]

    def fields(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        """[e_0; e_1; ...; e_F] [B, F+1, D], e_0 the bottom MLP's output; [B, F, D] without
        dense features."""
        embedded_dense = None if self.dense_arch is None else self.dense_arch(dense_features)
        embedded_sparse = self.sparse_fields(sparse_features)  # [B, F, D]
        if embedded_dense is None:
            return embedded_sparse
        return torch.cat([embedded_dense.unsqueeze(1), embedded_sparse], dim=1)  # [B, F+1, D]
