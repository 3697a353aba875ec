"""Sequence models of the registry (``model.name = "sasrec"`` or ``"hstu"``): one item table in
an unpooled :class:`recsys.EmbeddingCollection` serving the ``history`` and ``candidates``
features, sized by the data (``spec.cardinalities[0]`` items), of dimension
``model.embedding_dim``, under the model built from ``[model.sequence]``. Raw item keys (or
``model.dynamic.tables``) make the table dynamic (:class:`~recsys.embedding.unpooled_tables.
DynamicEmbeddingCollection`), ``[model.storage]`` tiered (:class:`~recsys.embedding.
unpooled_tables.TieredEmbeddingCollection`), as for CTR models' tables.

Example::

    model = build_sequence_model(config.model, data.spec, torch.device("cpu"))
    hidden, vectors = model(batch.items, batch.max_length, candidates)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from torchrec import EmbeddingConfig

from recsys.build.dynamic_tables import dynamic_features, dynamic_options
from recsys.build.tiered_tables import storage_options
from recsys.config import ModelConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import DATA_TYPE_NAMES
from recsys.embedding.tiered.options import StorageOptions
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection, TieredEmbeddingCollection
from recsys.models.hstu import HSTU
from recsys.models.hstu_ranking import HSTURanking
from recsys.models.sasrec import SASRec
from recsys.models.sequence import CANDIDATES, HISTORY

__all__ = ["ITEM_TABLE", "build_sequence_model"]

ITEM_TABLE = "item"


def build_sequence_model(
    config: ModelConfig,
    spec: DatasetSpec,
    device: torch.device,
    *,
    embedding_optimizer: FusedOptimizer | None = None,
    seed: int = 0,
    run_dir: str | Path = ".",
    table_device: torch.device | None = None,
) -> nn.Module:
    """``config.name`` (sasrec, hstu or hstu_ranking) over the item table of ``spec`` (one
    feature), on ``device``. The item table is dynamic when the data's items are raw keys or
    ``model.dynamic.tables`` names it (its rows start at ``model.dynamic.initial_capacity``;
    a key's initial row depends on (``seed``, table, key)), and tiered when
    ``[model.storage]`` puts it in host memory or on disk (or both: a dynamic table kept behind
    a cache, its ranking corpus the keys of its store and cache; a disk tier without a path keeps
    its files under ``run_dir``). A tiered item table is built on ``table_device`` when given
    (``meta`` under torchrun: each rank makes only its shards, see
    :func:`recsys.distributed.parallel.parallelize`); the rest of the model on ``device``.

    Raises:
        ValueError: a spec that is not one item feature, options the model cannot take
            (naming the key), a dynamic or tiered table without the fused embedding update,
            or a dynamic tiered table with options a tiered table cannot take (a cap, a
            memory budget, a TTL).
    """
    labelled = config.name == "hstu_ranking"  # clicks on candidates
    if len(spec.sparse_names) != 1 or spec.num_dense or bool(spec.label_names) != labelled:
        raise ValueError(
            f"model.name = {config.name!r} trains on user histories (one item feature); this "
            f"data has dense {list(spec.dense_names)}, categorical {list(spec.sparse_names)} and "
            f"labels {list(spec.label_names)}"
        )
    sequence, dim = config.sequence, config.embedding_dim
    dynamic = dynamic_features(config.dynamic, spec)
    # The table as the data's feature names it (what [model.dynamic] / [model.storage]
    # options and overrides name), then as the model reads it.
    logical = EmbeddingConfig(
        name=ITEM_TABLE,
        num_embeddings=config.dynamic.initial_capacity if dynamic else spec.cardinalities[0],
        embedding_dim=dim,
        feature_names=[spec.sparse_names[0]],
        data_type=DATA_TYPE_NAMES[config.embedding_dtype],
    )
    options = dynamic_options(config.dynamic, spec, [logical])
    storage = storage_options(config.storage, [logical], dynamic, run_dir)
    table = replace(logical, feature_names=[HISTORY, CANDIDATES])
    where = table_device if storage and table_device is not None else device
    items = _item_collection(config, table, options, storage, where, embedding_optimizer, seed)
    if config.name in ("hstu", "hstu_ranking") and sequence.num_heads > dim:
        raise ValueError(
            f"model.sequence.num_heads = {sequence.num_heads} must be <= model.embedding_dim "
            f"= {dim}"
        )
    if sequence.time_bias and (config.name != "hstu" or not sequence.relative_bias):
        raise ValueError(
            f"model.sequence.time_bias = true with model.name = {config.name!r} and "
            f"model.sequence.relative_bias = {str(sequence.relative_bias).lower()}: the time "
            "bias is the second half of hstu's relative bias (model.name = 'hstu', "
            "relative_bias = true: position bias; time_bias = true as well: position + time)"
        )
    if sequence.time_convention != "own" and not sequence.time_bias:
        raise ValueError(
            f"model.sequence.time_convention = {sequence.time_convention!r} with "
            "model.sequence.time_bias = false: the convention is the time bias's query time "
            "(set time_bias = true, or leave time_convention = 'own')"
        )
    if config.name == "sasrec":
        if dim % sequence.num_heads:
            raise ValueError(
                f"model.embedding_dim = {dim} must be divisible by model.sequence.num_heads = "
                f"{sequence.num_heads} (sasrec splits the dimension over the heads)"
            )
        model: nn.Module = SASRec(
            items,
            max_len=sequence.max_len,
            num_blocks=sequence.num_blocks,
            num_heads=sequence.num_heads,
            dropout=sequence.dropout,
            ffn_dim=sequence.ffn_dim or None,
            layer_norm=sequence.layer_norm,
            positions=sequence.positions,
        )
    elif config.name == "hstu":
        model = HSTU(
            items,
            max_len=sequence.max_len,
            num_blocks=sequence.num_blocks,
            num_heads=sequence.num_heads,
            qk_dim=sequence.qk_dim or None,
            v_dim=sequence.v_dim or None,
            dropout=sequence.dropout,
            relative_bias=sequence.relative_bias,
            time_bias=sequence.time_bias,
            time_convention=sequence.time_convention,
            positions=sequence.positions,
        )
    elif config.name == "hstu_ranking":
        model = HSTURanking(
            items,
            max_len=sequence.max_len,
            max_candidates=sequence.num_candidates,
            num_blocks=sequence.num_blocks,
            num_heads=sequence.num_heads,
            qk_dim=sequence.qk_dim or None,
            v_dim=sequence.v_dim or None,
            dropout=sequence.dropout,
            relative_bias=sequence.relative_bias,
        )
    else:
        raise ValueError(f"model.name = {config.name!r} is not a sequence model")
    if items.device.type != "meta":
        return model.to(device)
    for child in model.children():  # the rest; the tables stay on meta until sharded
        if child is not items:
            child.to(device)
    with torch.no_grad():
        for parameter in model.parameters(recurse=False):
            parameter.data = parameter.data.to(device)
    return model


def _item_collection(
    config: ModelConfig,
    table: EmbeddingConfig,
    dynamic: dict[str, DynamicTableOptions],
    storage: dict[str, StorageOptions],
    device: torch.device,
    optimizer: FusedOptimizer | None,
    seed: int,
) -> EmbeddingCollection:
    """The item table's collection: tiered (``storage``), dynamic (``dynamic``) or fixed."""
    if (dynamic or storage) and optimizer is None:
        kind = "tiered" if storage else "dynamic"
        raise ValueError(
            f"a {kind} item table ({config.name}) is trained by the fused embedding update; set "
            "train.fused_embedding_update = true"
        )
    if storage:  # dynamic too: its ranking corpus is the keys of its store and cache
        return TieredEmbeddingCollection(
            [table], storage, optimizer, dynamic or None, device=device, seed=seed
        )
    if dynamic:
        return DynamicEmbeddingCollection(
            [table], dynamic, device=device, seed=seed, optimizer=optimizer
        )
    return EmbeddingCollection([table], device=device, optimizer=optimizer)
