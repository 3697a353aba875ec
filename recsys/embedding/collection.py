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
from recsys.embedding.optim import FusedOptimizer
from recsys.ops.embedding_bag import (
    FusedUpdate,
    LookupPlan,
    TableLayout,
    choose_backend,
    table_batched_embedding_bag,
)
from recsys.ops.embedding_bag_cpu import pool_torch

_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
_DTYPE = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


class EmbeddingTable(nn.Module):
    """One table's weight [num_embeddings, embedding_dim] (a view of its collection's packed
    buffer) and, with a fused optimizer, its optimizer state; looked up by its collection."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

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
        optimizer: a fused optimizer from :mod:`recsys.embedding.optim` (``SGD``, ``Adagrad``,
            ``RowWiseAdagrad``, ``Adam``), or None.

    Training the tables:

    - ``optimizer=None``: tables are ordinary parameters and backward gives them dense
      gradients (a zero-filled tensor of the table's shape with the touched rows set), so any
      torch optimizer trains them. Simple, but the gradient is as big as the table.
    - ``optimizer=RowWiseAdagrad(lr=...)`` (or another fused optimizer): backward applies the
      update to the touched rows in place, with duplicate ids reduced first, and builds no
      gradient tensor; the table parameters have ``requires_grad=False`` (give them to no
      torch optimizer). Its state is in ``state_dict()`` as ``embedding_bags.<table>.<state>``
      plus ``optimizer_step``; ``ebc.optimizer.lr = x`` changes the learning rate.

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
        optimizer: FusedOptimizer | None = None,
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
        self.optimizer: FusedOptimizer | None = None
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
        dtypes = {_DTYPE[c.data_type] for c in tables}
        if len(dtypes) > 1:
            raise ValueError(f"all tables of a collection must share one data_type, got {dtypes}")
        self._layout = TableLayout.build(
            [c.num_embeddings for c in tables], [c.embedding_dim for c in tables]
        )
        self._flat = torch.empty(self._layout.numel, dtype=dtypes.pop(), device=self._device)
        self._states: dict[str, torch.Tensor] = {}
        # Autograd input that makes backward run when the tables themselves take no gradient.
        self._anchor = torch.zeros((), device=self._device, requires_grad=True)
        self.embedding_bags = nn.ModuleDict()
        for config, view in zip(tables, self._layout.table_views(self._flat), strict=True):
            self.embedding_bags[config.name] = EmbeddingTable(view, requires_grad=True)
        self.set_optimizer(optimizer)
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
        self._plan = LookupPlan(self._layout, self._feature_to_table, self._table_pooling)
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
        if torch.compiler.is_exporting():
            pooled = self._pool_for_export(features, weights)
            return KeyedTensor(
                keys=self._embedding_names,
                length_per_key=self._lengths_per_embedding,
                values=pooled,
            )
        if not self._views_intact():
            self._repack()
        fused = None
        handles = [bag.weight for bag in self.embedding_bags.values()]
        if self.optimizer is not None:
            fused = FusedUpdate(self.optimizer, self._states, self.optimizer_step)
            handles = [self._anchor]
        # Which kernels serve this call (kept for inspection: ``ebc._last_backend``).
        self._last_backend = choose_backend(self.backend, self._plan, self._flat, fused)
        pooled = table_batched_embedding_bag(
            self._plan,
            self._flat,
            handles,
            features.values(),
            features.offsets(),
            self._feature_to_key(features.keys()),
            features.stride(),
            weights,
            fused=fused,
            backend=self._last_backend,
            validate=self.validate,
            feature_names=self._flat_feature_names,
        )
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=pooled
        )

    def _pool_for_export(
        self, features: KeyedJaggedTensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """What ``torch.export`` traces: the torch backend's forward over the tables' own
        parameters. The training path's autograd.Function, backend choice, id validation and
        packed-buffer checks are Python that reads tensor data, which export cannot trace;
        an exported (inference) program needs none of them. Ids are not validated here:
        ``F.embedding_bag`` raises on an id outside its table."""
        return pool_torch(
            self._plan,
            [bag.weight for bag in self.embedding_bags.values()],
            features.values(),
            features.offsets(),
            weights,
            self._feature_to_key(features.keys()),
            features.stride(),
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

    def set_optimizer(self, optimizer: FusedOptimizer | None) -> None:
        """Fuse ``optimizer`` into backward from now on (fresh state, step 0), or with None
        go back to dense gradients for a torch optimizer."""
        if optimizer is not None and not isinstance(optimizer, FusedOptimizer):
            raise ValueError(
                f"optimizer={optimizer!r}; expected None or a fused optimizer from "
                "recsys.embedding.optim (SGD, Adagrad, RowWiseAdagrad, Adam)"
            )
        for table in self.embedding_bags.values():
            for name in list(table._buffers):
                del table._buffers[name]
            table.weight.requires_grad_(optimizer is None)
        self._states = {}
        self._buffers.pop("optimizer_step", None)
        self.optimizer = optimizer
        if optimizer is not None:
            for name, kind in optimizer.states.items():
                size = self._layout.total_rows if kind == "row" else self._layout.numel
                self._states[name] = torch.full(
                    (size,), optimizer.initial_state(name), device=self._device
                )
            self.register_buffer(
                "optimizer_step", torch.zeros((), dtype=torch.int64, device=self._device)
            )
        self._bind_views()

    def _bind_views(self) -> None:
        """Point every table's weight (and state buffers) at its slice of the packed buffers."""
        weight_views = self._layout.table_views(self._flat)
        state_views = {
            name: (
                self._layout.row_views(buffer)
                if self.optimizer.states[name] == "row"
                else self._layout.table_views(buffer)
            )
            for name, buffer in self._states.items()
        }
        for t, table in enumerate(self.embedding_bags.values()):
            table.weight.data = weight_views[t]
            for name, views in state_views.items():
                table._buffers[name] = views[t]

    def _views_intact(self) -> bool:
        base, size = self._flat.data_ptr(), self._flat.element_size()
        return all(
            table.weight.data_ptr() == base + offset * size
            and table.weight.dtype == self._flat.dtype
            for table, offset in zip(
                self.embedding_bags.values(), self._layout.elem_offsets, strict=True
            )
        )

    def _repack(self) -> None:
        """Rebuild the packed buffers from the tables' current tensors: needed when something
        replaced a parameter instead of writing into it (``load_state_dict(assign=True)``,
        ``param.data = ...``)."""
        tables = list(self.embedding_bags.values())
        self._flat = self._layout.pack([t.weight for t in tables])
        for name in self._states:
            self._states[name] = self._layout.pack([t._buffers[name] for t in tables])
        self._device = self._flat.device
        self._bind_views()

    def _apply(self, fn, recurse: bool = True):
        # Move or convert the packed buffers once, then re-point the tables' views at them
        # (applying ``fn`` table by table would unpack the tables into separate tensors).
        self._flat = fn(self._flat)
        self._states = {name: fn(buffer) for name, buffer in self._states.items()}
        for name, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[name] = fn(buffer)
        self._anchor = torch.zeros((), device=self._flat.device, requires_grad=True)
        self._device = self._flat.device
        self._bind_views()
        return self

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
