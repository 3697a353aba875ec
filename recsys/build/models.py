"""The model registry: ``model.name`` -> an architecture of :mod:`recsys.models`, built from the
``[model]`` section and the dataset's :class:`~recsys.data.batch.DatasetSpec`.

Every model is built the same way (see :func:`build_model`): the shared keys are checked, then
the model's own section is read, then its tables are made (one per categorical feature, sized by
the data; plus their dimension-1 twins for a first-order term), then the module. :data:`MODELS`
says, per model, which of the shared pieces it takes and how its own options are read.

Example::

    model = build_model(config.model, dataset.spec, torch.device("cuda"))
    logits = model(batch.dense, batch.sparse)  # [B, T]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.build.dynamic_tables import dynamic_features, dynamic_options
from recsys.build.sequence_models import build_sequence_model
from recsys.build.tiered_tables import storage_options
from recsys.config import SEQUENCE_MODELS, TARGET_RANKING_MODELS, ModelConfig, TrainConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic import DynamicEmbeddingBagCollection
from recsys.embedding.optim import OPTIMIZERS as FUSED_OPTIMIZERS
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tiered import TieredEmbeddingBagCollection
from recsys.models import (
    DCN,
    DLRM,
    DLRM_DCN,
    PNN,
    DeepFM,
    MMoE,
    WideDeep,
    XDeepFM,
    linear_table_configs,
    table_configs,
)

__all__ = ["MODELS", "ModelEntry", "build_model", "fused_embedding_optimizer"]


def _no_options(config: ModelConfig, spec: DatasetSpec) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelEntry:
    """How :func:`build_model` makes one model of the zoo.

    Every model takes an :class:`EmbeddingBagCollection` (one table per categorical feature),
    ``dense_in_features``, ``activation`` and ``dropout``; the flags add the shared pieces it
    also takes, and ``options`` reads its own section.
    """

    module: type[nn.Module]
    """The architecture (a class of :mod:`recsys.models`)."""
    options: Callable[[ModelConfig, DatasetSpec], dict[str, Any]] = _no_options
    """The model's own constructor arguments, from its section of ``[model]`` (and the data);
    raises ``ValueError`` for values it cannot use. Called after the shared keys are checked,
    before any table is made."""
    dense_arch: bool = True
    """Takes ``model.dense_arch_layer_sizes`` (a bottom MLP that ends with
    ``model.embedding_dim``)."""
    over_arch: bool = True
    """Takes ``model.over_arch_layer_sizes`` (a top MLP that ends with the number of tasks)."""
    linear: bool = False
    """Takes a second collection of dimension-1 tables, a first-order term."""


def build_model(
    config: ModelConfig,
    spec: DatasetSpec,
    device: torch.device,
    seed: int = 0,
    *,
    embedding_optimizer: FusedOptimizer | None = None,
    run_dir: str | Path = ".",
    table_device: torch.device | None = None,
) -> nn.Module:
    """Build ``config.name`` for a dataset with ``spec``, on ``device``.

    Args:
        config: the ``[model]`` section.
        spec: the dataset's features, table sizes and tasks.
        device: where the parameters live.
        seed: the run's seed (``run.seed``): dynamic and tiered tables draw a new row's initial
            value from (seed, table, key).
        embedding_optimizer: the fused optimizer of the tables; tiered tables
            (``[model.storage]``) need it, since their stored rows hold its state.
        run_dir: the run directory (a disk tier without a path keeps its files there).
        table_device: where the tables go (default: ``device``); ``meta`` under torchrun,
            where each rank then materializes only its shards
            (:func:`recsys.distributed.parallel.parallelize`).

    Returns:
        The model, with ``forward(dense_features, sparse_features) -> logits [B, T]``; a
        sequence model (sasrec, hstu: :mod:`recsys.build.sequence_models`) reads histories.

    Raises:
        ValueError: an unknown ``model.name``, or sizes that do not fit the data (naming the
            key).
    """
    if config.name in (*SEQUENCE_MODELS, *TARGET_RANKING_MODELS):  # user histories in
        # Under torchrun too a fixed or dynamic item table is built whole on ``device``:
        # parallelize copies its rows into the shards, so every world size starts from one
        # process's rows (a tiered one goes to ``table_device``: its rows start lazily).
        return build_sequence_model(
            config,
            spec,
            device,
            embedding_optimizer=embedding_optimizer,
            seed=seed,
            run_dir=run_dir,
            table_device=table_device,
        )
    if config.name not in MODELS:
        raise ValueError(
            f"unknown model.name {config.name!r}; available: "
            f"{', '.join([*MODELS, *SEQUENCE_MODELS, *TARGET_RANKING_MODELS])}"
        )
    entry = MODELS[config.name]
    shared: dict[str, Any] = {}
    if entry.dense_arch:
        _check_bottom_mlp(config, spec)
        shared["dense_arch_layer_sizes"] = config.dense_arch_layer_sizes
    if entry.over_arch:
        _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
        shared["over_arch_layer_sizes"] = config.over_arch_layer_sizes
    options = entry.options(config, spec)
    # Tables before the module, the main tables before their twins: the order in which
    # parameters are made (and so the initial weights under a seed) is part of the model.
    # A dynamic table starts with model.dynamic.initial_capacity rows, whatever the data.
    dynamic = dynamic_features(config.dynamic, spec)
    tables = table_configs(
        spec.sparse_names,
        [
            config.dynamic.initial_capacity if feature in dynamic else cardinality
            for feature, cardinality in zip(spec.sparse_names, spec.cardinalities, strict=True)
        ],
        config.embedding_dim,
        config.pooling,
        config.embedding_dtype,
    )
    build = dict(
        config=config,
        spec=spec,
        device=device if table_device is None else table_device,
        seed=seed,
        optimizer=embedding_optimizer,
        run_dir=run_dir,
    )
    collections = [_collection(tables, **build)]
    if entry.linear:
        collections.append(_collection(linear_table_configs(tables), **build))
    model = entry.module(
        *collections,
        dense_in_features=spec.num_dense,
        activation=config.activation,
        dropout=config.dropout,
        **shared,
        **options,
    )
    if table_device is None:
        return model.to(device)
    # Everything but the tables left on the meta device (parallelize materializes those).
    return model._apply(lambda t: t if t.is_meta else t.to(device))


def _collection(
    tables: list[EmbeddingBagConfig],
    config: ModelConfig,
    spec: DatasetSpec,
    device: torch.device,
    seed: int,
    optimizer: FusedOptimizer | None,
    run_dir: str | Path,
) -> EmbeddingBagCollection:
    """The collection of ``tables``: tiered when ``[model.storage]`` puts any of them off the
    device, else dynamic when any of them is."""
    options = dynamic_options(config.dynamic, spec, tables)
    storage = storage_options(
        config.storage, tables, dynamic_features(config.dynamic, spec), run_dir
    )
    if storage:
        if optimizer is None:
            raise ValueError(
                f"model.storage.tier = {config.storage.tier!r} needs the fused embedding update "
                "(train.fused_embedding_update = true): a tiered table's stored rows hold its "
                "optimizer state"
            )
        return TieredEmbeddingBagCollection(
            tables, storage, optimizer, options, device=device, seed=seed
        )
    if options:
        return DynamicEmbeddingBagCollection(tables, options, device=device, seed=seed)
    return EmbeddingBagCollection(tables, device=device)


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


def _dlrm_dcn_options(config: ModelConfig, spec: DatasetSpec) -> dict[str, Any]:
    cross = config.cross
    if cross.version != "v2" or cross.structure != "stacked":
        raise ValueError(
            f"model.cross.version = {cross.version!r} and model.cross.structure = "
            f"{cross.structure!r}: dlrm_dcn is a stacked DCN-v2 (those keys are for dcn)"
        )
    return {"dcn_num_layers": cross.num_layers, "dcn_low_rank_dim": cross.low_rank}


def _dcn_options(config: ModelConfig, spec: DatasetSpec) -> dict[str, Any]:
    cross = config.cross
    return {
        "num_cross_layers": cross.num_layers,
        "low_rank": cross.low_rank,
        "version": cross.version,
        "structure": cross.structure,
    }


def _mmoe_options(config: ModelConfig, spec: DatasetSpec) -> dict[str, Any]:
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
    return {
        "expert_layer_sizes": config.mmoe.expert_layer_sizes,
        "tower_layer_sizes": config.mmoe.tower_layer_sizes,
        "num_tasks": spec.num_tasks,
        "num_experts": config.mmoe.num_experts,
    }


MODELS: dict[str, ModelEntry] = {
    "dlrm": ModelEntry(DLRM),
    "dlrm_dcn": ModelEntry(DLRM_DCN, _dlrm_dcn_options),
    # DCN feeds the dense features to the cross network as they are: no bottom MLP.
    "dcn": ModelEntry(DCN, _dcn_options, dense_arch=False),
    "pnn": ModelEntry(PNN, lambda config, spec: {"product": config.pnn.product}),
    "mmoe": ModelEntry(MMoE, _mmoe_options, dense_arch=False, over_arch=False),
    "deepfm": ModelEntry(DeepFM, linear=True),
    # Wide&Deep's deep MLP takes the dense features as they are, beside the embeddings.
    "wide_deep": ModelEntry(WideDeep, dense_arch=False, linear=True),
    "xdeepfm": ModelEntry(
        XDeepFM,
        lambda config, spec: {"cin_layer_sizes": config.xdeepfm.cin_layer_sizes},
        linear=True,
    ),
}
"""Every model ``model.name`` may name, and how :func:`build_model` makes it."""


def fused_embedding_optimizer(config: TrainConfig) -> FusedOptimizer | None:
    """The fused embedding optimizer ``[train]`` asks for (None without
    ``fused_embedding_update``)."""
    if not config.fused_embedding_update:
        return None
    return FUSED_OPTIMIZERS[config.embedding_optimizer](
        lr=config.embedding_lr, stochastic_rounding=config.embedding_stochastic_rounding
    )
