"""The built-in models and the one way every model is built: ``model.name`` (a built-in of
:data:`MODELS`, an installed entry point, or ``"module:Class"``: :mod:`recsys.build.registry`)
-> a module, from the ``[model]`` section and the dataset's
:class:`~recsys.data.batch.DatasetSpec`.

Every click model, built-in or not, is built the same way (see :func:`build_model`): its
constructor's signature says which of the trainer's arguments it takes
(:data:`~recsys.build.registry.TRAINER_ARGUMENTS`); those keys are checked, its own options are
read (a built-in's section, else ``[model.args]``), then its tables are made if it takes them
(one per categorical feature, sized by the data; then their dimension-1 twins for a first-order
term), then the module. Sequence models (sasrec, hstu, hstu_ranking) take their item table
from :mod:`recsys.build.sequence_models`.

Example::

    model = build_model(config.model, dataset.spec, torch.device("cuda"))
    logits = model(batch.dense, batch.sparse)  # [B, T]
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.build.dynamic_tables import dynamic_features, dynamic_options
from recsys.build.registry import (
    check_constructor,
    check_forward,
    resolve_model,
)
from recsys.build.sequence_models import build_sequence_model
from recsys.build.tiered_tables import storage_options
from recsys.config import ModelConfig, TrainConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.interface import embedding_collections
from recsys.embedding.optim import OPTIMIZERS as FUSED_OPTIMIZERS
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.models import (
    DCN,
    DLRM,
    DLRM_DCN,
    HSTU,
    PNN,
    DeepFM,
    HSTURanking,
    MMoE,
    SASRec,
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
    """A built-in model: its class and how its own options are read. What else it takes (the
    tables, ``dense_arch_layer_sizes``, a first-order term, ...) its constructor's signature
    says, as for any model class (:func:`~recsys.build.registry.check_constructor`)."""

    module: type[nn.Module]
    """The architecture (a class of :mod:`recsys.models`)."""
    options: Callable[[ModelConfig, DatasetSpec], dict[str, Any]] = _no_options
    """The model's own constructor arguments, from its section of ``[model]`` (and the data);
    raises ``ValueError`` for values it cannot use. Called before any table is made."""
    family: str = "click"
    """``"click"``: ``forward(dense, sparse) -> logits [B, T]``, built by :func:`build_model`;
    ``"next_item"`` / ``"target_ranking"``: a sequence model, built by
    :func:`~recsys.build.sequence_models.build_sequence_model`."""

    @property
    def linear(self) -> bool:
        """Takes a second collection of dimension-1 tables, a first-order term."""
        return "linear_embedding_bag_collection" in inspect.signature(self.module).parameters


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
    resolved = resolve_model(config.name)
    entry = MODELS[config.name] if resolved.builtin else None
    if entry is not None and entry.family != "click":  # user histories in
        if config.args:
            raise ValueError(
                f"[model.args] is for model classes of your own; {config.name}'s options are "
                "in [model.sequence]"
            )
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
    check_forward(resolved)
    own = entry.options(config, spec) if entry is not None else {}
    takes = check_constructor(resolved, own, config.args)
    if "dense_arch_layer_sizes" in takes:
        _check_bottom_mlp(config, spec)
    if "over_arch_layer_sizes" in takes:
        _check_num_tasks(config.over_arch_layer_sizes, spec, "model.over_arch_layer_sizes")
    arguments = {
        "dense_in_features": spec.num_dense,
        "embedding_dim": config.embedding_dim,
        "num_tasks": spec.num_tasks,
        "dense_arch_layer_sizes": config.dense_arch_layer_sizes,
        "over_arch_layer_sizes": config.over_arch_layer_sizes,
        "activation": config.activation,
        "dropout": config.dropout,
        "dense_device": device,
    }
    arguments |= _tables(
        takes,
        config,
        spec,
        device if table_device is None else table_device,
        seed,
        embedding_optimizer,
        run_dir,
    )
    model = resolved.cls(
        **{name: value for name, value in arguments.items() if name in takes},
        **own,
        **config.args,
    )
    if not resolved.builtin and not embedding_collections(model):
        warnings.warn(
            f"model.name {config.name!r} holds no embedding collection: it trains, but no "
            "table is sharded or updated by the fused optimizer (take embedding_bag_collection "
            "in its constructor)",
            stacklevel=2,
        )
    if table_device is None:
        return model.to(device)
    # Everything but the tables left on the meta device (parallelize materializes those).
    return model._apply(lambda t: t if t.is_meta else t.to(device))


def _tables(
    takes: set[str],
    config: ModelConfig,
    spec: DatasetSpec,
    device: torch.device,
    seed: int,
    optimizer: FusedOptimizer | None,
    run_dir: str | Path,
) -> dict[str, Any]:
    """The trainer's table arguments a model takes (``tables``, ``embedding_bag_collection``,
    ``linear_embedding_bag_collection``), made in that order: the order in which parameters
    are made (and so the initial weights under a seed) is part of the model. A dynamic table
    starts with model.dynamic.initial_capacity rows, whatever the data."""
    if not takes & {"tables", "embedding_bag_collection", "linear_embedding_bag_collection"}:
        return {}
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
        config=config, spec=spec, device=device, seed=seed, optimizer=optimizer, run_dir=run_dir
    )
    made: dict[str, Any] = {"tables": tables}
    if "embedding_bag_collection" in takes:
        made["embedding_bag_collection"] = _collection(tables, **build)
    if "linear_embedding_bag_collection" in takes:
        made["linear_embedding_bag_collection"] = _collection(linear_table_configs(tables), **build)
    return made


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
        "num_experts": config.mmoe.num_experts,
    }


MODELS: dict[str, ModelEntry] = {
    "dlrm": ModelEntry(DLRM),
    "dlrm_dcn": ModelEntry(DLRM_DCN, _dlrm_dcn_options),
    # DCN feeds the dense features to the cross network as they are: no bottom MLP.
    "dcn": ModelEntry(DCN, _dcn_options),
    "pnn": ModelEntry(PNN, lambda config, spec: {"product": config.pnn.product}),
    "mmoe": ModelEntry(MMoE, _mmoe_options),
    "deepfm": ModelEntry(DeepFM),
    # Wide&Deep's deep MLP takes the dense features as they are, beside the embeddings.
    "wide_deep": ModelEntry(WideDeep),
    "xdeepfm": ModelEntry(
        XDeepFM, lambda config, spec: {"cin_layer_sizes": config.xdeepfm.cin_layer_sizes}
    ),
    "sasrec": ModelEntry(SASRec, family="next_item"),
    "hstu": ModelEntry(HSTU, family="next_item"),
    "hstu_ranking": ModelEntry(HSTURanking, family="target_ranking"),
}
"""The built-in models: the short names ``model.name`` may take besides installed entry points
(:mod:`recsys.build.registry`), and how :func:`build_model` makes each."""


def fused_embedding_optimizer(config: TrainConfig) -> FusedOptimizer | None:
    """The fused embedding optimizer ``[train]`` asks for (None without
    ``fused_embedding_update``)."""
    if not config.fused_embedding_update:
        return None
    return FUSED_OPTIMIZERS[config.embedding_optimizer](
        lr=config.embedding_lr, stochastic_rounding=config.embedding_stochastic_rounding
    )


TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}
"""``train.dense_optimizer`` (and an unfused ``train.embedding_optimizer``) -> its torch class."""


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a dense optimizer trains: every one outside the embedding collections
    that needs a gradient, in ``model.parameters()`` order."""
    tables = {id(p) for c in embedding_collections(model).values() for p in c.parameters()}
    return [p for p in model.parameters() if id(p) not in tables and p.requires_grad]


def dense_optimizer(config: TrainConfig, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``train.dense_optimizer`` over ``parameters`` (every one but the tables'), as a run steps
    it. foreach: one multi-tensor kernel per update op for all parameters (the default on CUDA;
    on CPU torch loops per parameter: ~110 ops a step for DLRM instead of ~10), the same numbers
    bitwise."""
    return TORCH_OPTIMIZERS[config.dense_optimizer](parameters, lr=config.dense_lr, foreach=True)
