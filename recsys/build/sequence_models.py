"""Sequence models of the registry (``model.name = "sasrec"`` or ``"hstu"``): one item table in
an unpooled :class:`recsys.EmbeddingCollection` serving the ``history`` and ``candidates``
features, sized by the data (``spec.cardinalities[0]`` items), of dimension
``model.embedding_dim``, under the model built from ``[model.sequence]``.

Example::

    model = build_sequence_model(config.model, data.spec, torch.device("cpu"))
    hidden, vectors = model(batch.items, batch.max_length, candidates)
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingConfig

from recsys.config import ModelConfig
from recsys.data.batch import DatasetSpec
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import DATA_TYPE_NAMES
from recsys.embedding.unpooled import EmbeddingCollection
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
) -> nn.Module:
    """``config.name`` (sasrec, hstu or hstu_ranking) over the item table of ``spec`` (one
    feature), on ``device``.

    Raises:
        ValueError: a spec that is not one item feature, options the model cannot take
            (naming the key), or dynamic / tiered tables, which sequence models do not take
            yet.
    """
    labelled = config.name == "hstu_ranking"  # clicks on candidates
    if len(spec.sparse_names) != 1 or spec.num_dense or bool(spec.label_names) != labelled:
        raise ValueError(
            f"model.name = {config.name!r} trains on user histories (one item feature); this "
            f"data has dense {list(spec.dense_names)}, categorical {list(spec.sparse_names)} and "
            f"labels {list(spec.label_names)}"
        )
    if config.dynamic.tables or spec.id_encoding == "raw":
        raise ValueError(
            f"model.name = {config.name!r} takes a fixed item table; dynamic tables "
            "(model.dynamic.tables, raw ids) are not supported for sequence models yet"
        )
    if config.storage.tier != "device" or config.storage.overrides:
        raise ValueError(
            f"model.storage.tier = {config.storage.tier!r} (overrides {config.storage.overrides})"
            f": {config.name} keeps its item table on the device (tiered tables are not "
            "supported for sequence models yet)"
        )
    sequence, dim = config.sequence, config.embedding_dim
    table = EmbeddingConfig(
        name=ITEM_TABLE,
        num_embeddings=spec.cardinalities[0],
        embedding_dim=dim,
        feature_names=[HISTORY, CANDIDATES],
        data_type=DATA_TYPE_NAMES[config.embedding_dtype],
    )
    items = EmbeddingCollection([table], device=device, optimizer=embedding_optimizer)
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
        )
    elif config.name == "hstu":
        if sequence.num_heads > dim:
            raise ValueError(
                f"model.sequence.num_heads = {sequence.num_heads} must be <= model.embedding_dim "
                f"= {dim}"
            )
        model = HSTU(
            items,
            max_len=sequence.max_len,
            num_blocks=sequence.num_blocks,
            num_heads=sequence.num_heads,
            qk_dim=sequence.qk_dim or None,
            v_dim=sequence.v_dim or None,
            dropout=sequence.dropout,
            relative_bias=sequence.relative_bias,
        )
    elif config.name == "hstu_ranking":
        if sequence.num_heads > dim:
            raise ValueError(
                f"model.sequence.num_heads = {sequence.num_heads} must be <= model.embedding_dim "
                f"= {dim}"
            )
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
    return model.to(device)
