"""Model zoo: architectures only, each built from an EmbeddingBagCollection plus layer sizes.

``MODELS`` maps the config's ``model.name`` to a builder that turns the ``[model]`` section and
the dataset's :class:`~recsys.data.batch.DatasetSpec` into a module with
``forward(dense_features, sparse_features) -> logits [B, T]``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_configs import DataType

from recsys.config import ModelConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.models.dcn import DCN
from recsys.models.deepfm import DeepFM
from recsys.models.dlrm import DLRM, DLRM_DCN
from recsys.models.mmoe import MMoE
from recsys.models.pnn import PNN
from recsys.models.wide_deep import WideDeep
from recsys.models.xdeepfm import XDeepFM

__all__ = [
    "DCN",
    "DLRM",
    "DLRM_DCN",
    "MODELS",
    "PNN",
    "DeepFM",
    "MMoE",
    "WideDeep",
    "XDeepFM",
    "build_model",
    "linear_table_configs",
    "table_configs",
]


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


def _check_bottom_mlp(config: ModelConfig, spec: DatasetSpec) -> None:
    """The bottom MLP turns the dense features into one more embedding-sized field: its last
    size must be model.embedding_dim (no bottom MLP without dense features)."""
    sizes = config.dense_arch_layer_sizes
    if spec.num_dense and (not sizes or sizes[-1] != config.embedding_dim):
        hint = ",".join(str(n) for n in [*sizes[:-1], config.embedding_dim])
        raise ValueError(
            f"model.dense_arch_layer_sizes = {sizes} must end with model.embedding_dim = "
            f"{config.embedding_dim} (the bottom MLP's output is one more embedding); e.g. "
            f"--model.dense_arch_layer_sizes={hint}"
        )


def _check_num_tasks(sizes: list[int], spec: DatasetSpec, key: str) -> None:
    if not sizes or sizes[-1] != spec.num_tasks:
        raise ValueError(
            f"{key} = {sizes} must end with the number of tasks: the data has "
            f"{spec.num_tasks} label(s)"
        )


def _build_dlrm(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_bottom_mlp(config, spec)
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return DLRM(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
    ).to(device)


def _build_dlrm_dcn(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_bottom_mlp(config, spec)
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    if config.cross.version != "v2" or config.cross.structure != "stacked":
        raise ValueError(
            f"model.cross.version = {config.cross.version!r} and model.cross.structure = "
            f"{config.cross.structure!r}: dlrm_dcn is a stacked DCN-v2 (those keys are for dcn)"
        )
    return DLRM_DCN(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        dcn_num_layers=config.cross.num_layers,
        dcn_low_rank_dim=config.cross.low_rank,
        activation=config.activation,
        dropout=config.dropout,
    ).to(device)


def _build_dcn(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    """model.dense_arch_layer_sizes is unused: DCN feeds the dense features to the cross
    network as they are."""
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return DCN(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
        num_cross_layers=config.cross.num_layers,
        low_rank=config.cross.low_rank,
        version=config.cross.version,
        structure=config.cross.structure,
    ).to(device)


def _build_pnn(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_bottom_mlp(config, spec)
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return PNN(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
        product=config.pnn_product,
    ).to(device)


def _build_mmoe(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    """Sizes come from ``[model.mmoe]`` and the number of tasks from the data:
    model.over_arch_layer_sizes and model.dense_arch_layer_sizes are not used (the dense
    features go to the experts as they are); setting them to other than their defaults warns."""
    defaults = ModelConfig()
    for key in ("over_arch_layer_sizes", "dense_arch_layer_sizes"):
        if getattr(config, key) != getattr(defaults, key):
            warnings.warn(
                f"model.{key} = {getattr(config, key)} is not used by mmoe; its sizes are "
                "model.mmoe.expert_layer_sizes and model.mmoe.tower_layer_sizes",
                stacklevel=2,
            )
    return MMoE(
        _collection(config, spec, device),
        dense_in_features=spec.num_dense,
        expert_layer_sizes=config.mmoe.expert_layer_sizes,
        tower_layer_sizes=config.mmoe.tower_layer_sizes,
        num_tasks=spec.num_tasks,
        activation=config.activation,
        dropout=config.dropout,
        num_experts=config.mmoe.num_experts,
    ).to(device)


def _build_deepfm(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_bottom_mlp(config, spec)
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return DeepFM(
        _collection(config, spec, device),
        _linear_collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
    ).to(device)


def _build_wide_deep(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    """model.dense_arch_layer_sizes is unused: the deep MLP takes the dense features as they
    are, concatenated with the embeddings."""
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return WideDeep(
        _collection(config, spec, device),
        _linear_collection(config, spec, device),
        dense_in_features=spec.num_dense,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
    ).to(device)


def _build_xdeepfm(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    _check_bottom_mlp(config, spec)
    _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    return XDeepFM(
        _collection(config, spec, device),
        _linear_collection(config, spec, device),
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=config.dense_arch_layer_sizes,
        cin_layer_sizes=config.cin_layer_sizes,
        over_arch_layer_sizes=config.over_arch_layer_sizes,
        activation=config.activation,
        dropout=config.dropout,
    ).to(device)


MODELS: dict[str, Callable[[ModelConfig, DatasetSpec, torch.device], nn.Module]] = {
    "dlrm": _build_dlrm,
    "dlrm_dcn": _build_dlrm_dcn,
    "dcn": _build_dcn,
    "pnn": _build_pnn,
    "mmoe": _build_mmoe,
    "deepfm": _build_deepfm,
    "wide_deep": _build_wide_deep,
    "xdeepfm": _build_xdeepfm,
}


def build_model(config: ModelConfig, spec: DatasetSpec, device: torch.device) -> nn.Module:
    """Build ``config.name`` for a dataset with ``spec``, on ``device``."""
    if config.name not in MODELS:
        raise ValueError(f"unknown model.name {config.name!r}; available: {', '.join(MODELS)}")
    return MODELS[config.name](config, spec, device)
