"""Model zoo: architectures only, each built from an EmbeddingBagCollection plus layer sizes.

``MODELS`` maps the config's ``model.name`` to a builder that turns the ``[model]`` section and
the dataset's :class:`~recsys.data.batch.DatasetSpec` into a module with
``forward(dense_features, sparse_features) -> logits [B, T]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_configs import DataType

from recsys.config import ModelConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.dlrm import DLRM

__all__ = ["DLRM", "MODELS", "build_model", "linear_table_configs", "table_configs"]


_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}


def table_configs(
    spec: DatasetSpec, embedding_dim: int, pooling: str, dtype: str = "fp32"
) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, sized by the dataset (never typed by hand)."""
    return [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=embedding_dim,
            num_embeddings=cardinality,
            feature_names=[feature],
            pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
            data_type=_DATA_TYPES[dtype],
        )
        for feature, cardinality in zip(spec.sparse_names, spec.cardinalities, strict=True)
    ]


def linear_table_configs(configs: list[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """Dimension-1 twins of ``configs`` (same rows, features and pooling, name ``<t>_linear``):
    a collection of them pools one weight per id, the first-order ("linear", "wide") term of
    DeepFM, Wide&Deep and xDeepFM, through the same kernels as every other table."""
    return [
        EmbeddingBagConfig(
            name=f"{c.name}_linear",
            embedding_dim=1,
            num_embeddings=c.num_embeddings,
            feature_names=list(c.feature_names),
            pooling=c.pooling,
            data_type=c.data_type,
        )
        for c in configs
    ]


def _collection(
    config: ModelConfig, spec: DatasetSpec, device: torch.device
) -> EmbeddingBagCollection:
    """The model's tables: one per categorical feature, ``model.embedding_dim`` wide."""
    return EmbeddingBagCollection(
        table_configs(spec, config.embedding_dim, config.pooling, config.embedding_dtype),
        device=device,
    )


def _linear_collection(
    config: ModelConfig, spec: DatasetSpec, device: torch.device
) -> EmbeddingBagCollection:
    """Dimension-1 tables for a first-order term (see :func:`linear_table_configs`)."""
    tables = table_configs(spec, config.embedding_dim, config.pooling, config.embedding_dtype)
    return EmbeddingBagCollection(linear_table_configs(tables), device=device)


def _check_num_tasks(sizes: list[int], spec: DatasetSpec, key: str) -> None:
    if not sizes or sizes[-1] != spec.num_tasks:
        raise ValueError(
            f"{key} = {sizes} must end with the number of tasks: the data has "
            f"{spec.num_tasks} label(s)"
        )


def _build_dlrm(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return DLRM(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
    ).to(device)


MODELS: dict[str, Callable[[ModelConfig, DatasetSpec, torch.device], nn.Module]] = {
    "dlrm": _build_dlrm,
}


def build_model(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    """Build ``config.name`` for a dataset with ``spec``, on ``device``."""
    if config.name not in MODELS:
        raise ValueError(f"unknown model.name {config.name!r}; available: {', '.join(MODELS)}")
    return MODELS[config.name](config, spec, device)
