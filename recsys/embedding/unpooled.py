"""EmbeddingCollection: a drop-in for ``torchrec.EmbeddingCollection`` (unpooled: one vector
per id) on the embedding bag's packed tables, kernels and fused optimizers.

The constructor, ``forward(KeyedJaggedTensor) -> Dict[str, JaggedTensor]`` and the state dict
keys (``embeddings.<table>.weight``) are TorchRec's, so a TorchRec sequence model switches by
changing one import and checkpoints load both ways. All features are looked up by one call of
:func:`recsys.ops.embedding_bag.lookup.table_batched_embedding_lookup` (a pooled lookup whose bags
hold one id each), so a fused optimizer updates the touched rows inside backward with
duplicates reduced first, as in :class:`recsys.EmbeddingBagCollection`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagConfig, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor

from recsys.embedding.inputs import FeatureOrder, input_weights, is_symbolic
from recsys.embedding.interface import UNPOOLED_TABLES
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.packed import PackedTables
from recsys.embedding.tables import TABLE_DTYPES, output_keys
from recsys.ops._triton import accumulate_dtype
from recsys.ops.embedding_bag.lookup import LookupGroups, table_batched_embedding_lookup
from recsys.ops.embedding_bag.pooled import FusedUpdate


class EmbeddingCollection(PackedTables):
    """Unpooled embeddings of several tables, each serving one or more features: every id of
    a feature gets its table's row, in input order.

    Args:
        tables: ``torchrec.EmbeddingConfig`` per table (name, num_embeddings, embedding_dim,
            feature_names, data_type FP32 / FP16 / BF16, init_fn). Tables may differ in dim
            (TorchRec's requires one dim); each feature's rows have its table's.
        device: where the tables live (``"meta"`` leaves them uninitialized).
        need_indices: each output JaggedTensor carries its ids as ``weights()`` (TorchRec's).
        backend: op backend, ``"auto"`` / ``"torch"`` / ``"triton"``.
        validate: check every input's ids and offsets: ``True`` / ``"sync"``, ``"async"``,
            ``False`` / ``"off"`` (as :class:`recsys.EmbeddingBagCollection`'s).
        optimizer: a fused optimizer from :mod:`recsys.embedding.optim` (``SGD``, ``Adagrad``,
            ``RowWiseAdagrad``, ``Adam``), or None: the tables are ordinary parameters with
            dense gradients for any torch optimizer.

    Example::

        from torchrec import EmbeddingConfig, KeyedJaggedTensor
        ec = EmbeddingCollection([
            EmbeddingConfig(name="items", embedding_dim=8, num_embeddings=100,
                            feature_names=["history"]),
        ], optimizer=RowWiseAdagrad(lr=0.05))
        kjt = KeyedJaggedTensor(keys=["history"], values=torch.tensor([3, 7, 7, 1, 9]),
                                lengths=torch.tensor([2, 0, 3]))
        out = ec(kjt)["history"]  # JaggedTensor: values [5, 8], lengths [2, 0, 3]
    """

    tables_key = UNPOOLED_TABLES

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        backend: str = "auto",
        validate: bool | str = True,
        optimizer: FusedOptimizer | None = None,
    ) -> None:
        super().__init__(tables, device, backend=backend, validate=validate, optimizer=optimizer)
        self._need_indices = need_indices
        self._embedding_names, _ = output_keys(tables)
        self._features = FeatureOrder([f for c in tables for f in c.feature_names])
        self._plan = self._lookup_plan()
        self.reset_parameters()

    def _check_config(self, config: EmbeddingConfig) -> None:
        if isinstance(config, EmbeddingBagConfig):
            raise ValueError(
                f"table '{config.name}' is an EmbeddingBagConfig (pooled); an "
                "EmbeddingCollection looks up every id unpooled: give it EmbeddingConfig tables "
                "(or use EmbeddingBagCollection)"
            )
        if not isinstance(config, EmbeddingConfig):
            raise ValueError(
                f"table {config!r}: expected a torchrec EmbeddingConfig, "
                f"got {type(config).__name__}"
            )
        if config.data_type not in TABLE_DTYPES:
            raise ValueError(
                f"table '{config.name}': data_type {config.data_type} is not supported; "
                f"use one of {', '.join(str(d) for d in TABLE_DTYPES)}"
            )

    def _lookup_plan(self) -> LookupGroups:
        tables = self._embedding_bag_configs
        return LookupGroups(
            self._layout, [t for t, c in enumerate(tables) for _ in c.feature_names]
        )

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up every id of this collection's features: KJT with (at least) them -> each
        feature's JaggedTensor (by output name: the feature, or ``<feature>@<table>`` when
        several tables read it), values [ids of the feature, its table's dim] in input order,
        lengths and offsets the KJT key's."""
        if is_symbolic(features):
            raise ValueError(
                "EmbeddingCollection cannot be traced by torch.fx yet; use torch.export"
            )
        input_weights(features, False)  # one batch size for every key
        positions = self._features.positions(features.keys())
        ids_per_key = features.length_per_key()  # on the host (a sync if the KJT lacks it)
        rows = self._rows(features, positions, ids_per_key)
        B, values = features.stride(), features.values()
        starts = features.offset_per_key()
        lengths, offsets = features.lengths(), features.offsets()
        out = {}
        for name, k, r in zip(self._embedding_names, positions, rows, strict=True):
            out[name] = JaggedTensor(
                values=r,
                lengths=lengths[k * B : (k + 1) * B],
                offsets=offsets[k * B : (k + 1) * B + 1] - starts[k],
                weights=values[starts[k] : starts[k + 1]] if self._need_indices else None,
            )
        return out

    def _rows(
        self, features: KeyedJaggedTensor, positions: list[int], ids_per_key: list[int]
    ) -> list[torch.Tensor]:
        """Each feature's [ids, dim] rows."""
        names = self._embedding_names
        tables = [t.weight for t in self.table_modules.values()]
        if torch.compiler.is_exporting():
            return self._rows_for_export(features, positions, tables)
        if features.values().is_meta or self._flat.is_meta:
            dtype = accumulate_dtype(self._flat.dtype)
            return [
                torch.empty(ids_per_key[k], tables[t].shape[1], dtype=dtype, device="meta")
                for k, t in zip(positions, self._plan.feature_to_table, strict=True)
            ]
        ids = self.lookup_ids(features)  # first: a dynamic table may grow (new buffers)
        if not self._views_intact():
            self._repack()
            tables = [t.weight for t in self.table_modules.values()]
        fused = None
        if self.optimizer is not None:
            fused = FusedUpdate(self.optimizer, self._states, self.optimizer_step)
            handles = [self._anchor]
        else:
            handles = self._plan.group_weights(self._flat, tables)
        return table_batched_embedding_lookup(
            self._plan,
            self._flat,
            handles,
            ids,
            features.offsets(),
            positions,
            features.stride(),
            ids_per_key,
            fused=fused,
            backend=self.backend,
            validate=self.validate,
            feature_names=names,
        )

    def _rows_for_export(
        self, features: KeyedJaggedTensor, positions: list[int], tables: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """What ``torch.export`` traces: one ``F.embedding`` per feature over its table's
        parameter (no checks: ``F.embedding`` raises on an id outside its table)."""
        starts, values = features.offset_per_key(), self.lookup_ids(features)
        dtype = accumulate_dtype(self._flat.dtype)
        return [
            F.embedding(values[starts[k] : starts[k + 1]], tables[t]).to(dtype)
            for k, t in zip(positions, self._plan.feature_to_table, strict=True)
        ]

    def lookup_ids(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The row each id of ``features.values()`` reads in its table: here the ids
        themselves (a dynamic or tiered collection maps its keys to rows)."""
        return features.values()

    def is_weighted(self) -> bool:
        return False

    def need_indices(self) -> bool:
        """Whether each output JaggedTensor carries its ids as ``weights()``."""
        return self._need_indices

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The tables' configs (TorchRec's name)."""
        return self._embedding_bag_configs

    def embedding_bag_configs(self) -> list[EmbeddingConfig]:
        """The logical tables, in output order (the collection interface's name)."""
        return self._embedding_bag_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's output names (TorchRec's)."""
        names, out = iter(self._embedding_names), []
        for config in self._embedding_bag_configs:
            out.append([next(names) for _ in config.feature_names])
        return out

    def embedding_dim(self) -> int:
        """The tables' dim.

        Raises:
            ValueError: the tables differ in dim (TorchRec's collection allows only one)."""
        dims = {c.embedding_dim for c in self._embedding_bag_configs}
        if len(dims) > 1:
            raise ValueError(
                f"the tables of this EmbeddingCollection have dims {sorted(dims)}; "
                "embedding_dim() is defined for one dim only"
            )
        return dims.pop()

    def __prepare_scriptable__(self) -> EmbeddingCollection:
        raise RuntimeError(
            "recsys' EmbeddingCollection does not support TorchScript; use torch.export"
        )
