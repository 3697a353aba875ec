"""EmbeddingBagCollection: a drop-in for ``torchrec.EmbeddingBagCollection`` on recsys ops.

The constructor, ``forward(KeyedJaggedTensor) -> KeyedTensor`` and the state_dict keys
(``embedding_bags.<table>.weight``) are TorchRec's, so a TorchRec model switches by changing one
import and checkpoints load both ways. All tables are looked up by one call of
:func:`recsys.ops.embedding_bag.embedding_bag`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from recsys._suggest import quoted_with_hints
from recsys.ops.embedding_bag import embedding_bag

_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
_DTYPE = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


class EmbeddingTable(nn.Module):
    """One table's weight [num_embeddings, embedding_dim]; looked up by its collection."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device)
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, dtype={self.weight.dtype}"


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of several tables, each serving one or more features.

    Args:
        tables: ``torchrec.EmbeddingBagConfig`` per table (name, num_embeddings, embedding_dim,
            feature_names, pooling SUM or MEAN, data_type FP32 / FP16 / BF16, init_fn).
        is_weighted: the input KJT carries per-id weights, applied before pooling.
        device: where the tables live (``"meta"`` leaves them uninitialized).
        backend: op backend, ``"auto"`` / ``"torch"`` / ``"triton"``.
        validate: check every input's ids against the table sizes (one cheap pass).

    Gradients: tables are ordinary parameters with dense gradients, so any torch optimizer
    trains them.

    Example::

        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"]),
        ])
        kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                                offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
        ebc(kjt).values().shape  # [3, 7]; keys ["f1", "f2"], length_per_key [3, 4]
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        backend: str = "auto",
        validate: bool = True,
    ) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if not tables:
            raise ValueError("EmbeddingBagCollection needs at least one table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate table names: {duplicates}")
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        self.backend = backend
        self.validate = validate
        self.embedding_bags = nn.ModuleDict()
        for config in tables:
            if config.pooling not in _POOLING:
                raise ValueError(
                    f"table '{config.name}': pooling {config.pooling} is not supported; "
                    f"use {' or '.join(str(p) for p in _POOLING)}"
                )
            if config.data_type not in _DTYPE:
                raise ValueError(
                    f"table '{config.name}': data_type {config.data_type} is not supported; "
                    f"use one of {', '.join(str(d) for d in _DTYPE)}"
                )
            if not config.feature_names:
                config.feature_names = [config.name]
            self.embedding_bags[config.name] = EmbeddingTable(
                config.num_embeddings, config.embedding_dim, _DTYPE[config.data_type], self._device
            )
        dtypes = {_DTYPE[c.data_type] for c in tables}
        if len(dtypes) > 1:
            raise ValueError(f"all tables of a collection must share one data_type, got {dtypes}")
        self._feature_names: list[list[str]] = [list(t.feature_names) for t in tables]
        self._embedding_names: list[str] = [
            name for per_table in get_embedding_names_by_table(tables) for name in per_table
        ]
        self._lengths_per_embedding: list[int] = [
            t.embedding_dim for t in tables for _ in t.feature_names
        ]
        self._feature_to_table = [t for t, feats in enumerate(self._feature_names) for _ in feats]
        self._flat_feature_names = [f for feats in self._feature_names for f in feats]
        self._table_pooling = [_POOLING[t.pooling] for t in tables]
        self._key_index_cache: dict[tuple[str, ...], list[int]] = {}
        self.reset_parameters()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags: KJT with (at least) this collection's features ->
        KeyedTensor [B, sum of the features' dims], keys in table order."""
        if features.variable_stride_per_key():
            raise ValueError(
                "KeyedJaggedTensor with a variable batch size per key is not supported"
            )
        weights = None
        if self._is_weighted:
            weights = features.weights_or_none()
            if weights is None:
                raise ValueError(
                    "this collection is weighted (is_weighted=True) but the input "
                    "KeyedJaggedTensor has no weights"
                )
        pooled = embedding_bag(
            [bag.weight for bag in self.embedding_bags.values()],
            features.values(),
            features.offsets(),
            self._feature_to_key(features.keys()),
            self._feature_to_table,
            self._table_pooling,
            features.stride(),
            weights,
            backend=self.backend,
            validate=self.validate,
            feature_names=self._flat_feature_names,
        )
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=pooled
        )

    def _feature_to_key(self, keys: Sequence[str]) -> list[int]:
        cache_key = tuple(keys)
        if cache_key not in self._key_index_cache:
            position = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self._flat_feature_names if f not in position]
            if missing:
                hints = quoted_with_hints(missing, keys)
                raise ValueError(
                    f"KeyedJaggedTensor is missing features {hints} of this "
                    f"EmbeddingBagCollection; its keys are {list(keys)}, the collection expects "
                    f"{self._flat_feature_names}"
                )
            self._key_index_cache[cache_key] = [position[f] for f in self._flat_feature_names]
        return self._key_index_cache[cache_key]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    @property
    def device(self) -> torch.device:
        return self._device

    def reset_parameters(self) -> None:
        """Initialize every table with its config's ``init_fn`` (TorchRec's default: uniform
        in +-sqrt(1 / num_embeddings))."""
        if self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            with torch.no_grad():
                config.init_fn(self.embedding_bags[config.name].weight)
