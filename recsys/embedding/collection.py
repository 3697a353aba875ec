"""EmbeddingBagCollection: a drop-in for ``torchrec.EmbeddingBagCollection`` on recsys ops.

The constructor, ``forward(KeyedJaggedTensor) -> KeyedTensor`` and the state_dict keys
(``embedding_bags.<table>.weight``) are TorchRec's, so a TorchRec model switches by changing one
import and checkpoints load both ways. All tables are looked up by one call of
:func:`recsys.ops.embedding_bag.pooled.embedding_bag`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from recsys.embedding.inputs import FeatureOrder, input_weights, is_symbolic
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.packed import EmbeddingTable, PackedTables, RowExchange
from recsys.embedding.tables import check_table_config, output_keys, pooling_mode
from recsys.ops._triton import accumulate_dtype
from recsys.ops.embedding_bag.cpu import pool_torch
from recsys.ops.embedding_bag.pooled import (
    FusedUpdate,
    LookupPlan,
    choose_backend,
    table_batched_embedding_bag,
)

__all__ = ["EmbeddingBagCollection", "EmbeddingTable", "RowExchange", "TracedLookup"]


class EmbeddingBagCollection(PackedTables):
    """Pooled embeddings of several tables, each serving one or more features.

    Args:
        tables: ``torchrec.EmbeddingBagConfig`` per table (name, num_embeddings, embedding_dim,
            feature_names, pooling SUM or MEAN, data_type FP32 / FP16 / BF16, init_fn).
        is_weighted: the input KJT carries per-id weights, applied before pooling.
        device: where the tables live (``"meta"`` leaves them uninitialized).
        backend: op backend, ``"auto"`` / ``"torch"`` / ``"triton"``.
        validate: check every input's ids, offsets and weights: ``True`` / ``"sync"`` (raise at
            once), ``"async"`` (on the device, without waiting for it: the error comes from
            ``recsys.ops.input_checks.INPUT_ERRORS.raise_first()`` and the bad batch's fused
            update is withheld), ``False`` / ``"off"``.
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
        validate: bool | str = True,
        optimizer: FusedOptimizer | None = None,
    ) -> None:
        super().__init__(tables, device, backend=backend, validate=validate, optimizer=optimizer)
        self._is_weighted = is_weighted
        self._embedding_names, self._lengths_per_embedding = output_keys(tables)
        self._features = FeatureOrder([f for c in tables for f in c.feature_names])
        self._plan = self._lookup_plan()
        self._traced_lookup = TracedLookup(self)
        self.reset_parameters()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags: KJT with (at least) this collection's features ->
        KeyedTensor [B, sum of the features' dims], keys in table order.

        Under ``torch.fx`` symbolic tracing the lookup is one opaque call (checks and backend
        choice read tensor values, which a trace cannot), which runs this same eager path
        when the traced module runs. On ``meta`` inputs or tables it returns a ``meta`` result
        of the right shape (shape inference) without reading any value."""
        if is_symbolic(features):
            pooled = pooled_values(self._traced_lookup, features)
        else:
            pooled = self.pooled_values(features)
        return KeyedTensor(
            keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=pooled
        )

    def pooled_values(
        self,
        features: KeyedJaggedTensor,
        distinct_rows: Sequence[int] | None = None,
        exchanged_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The eager lookup: [B, sum of the features' dims], the values of :meth:`forward`.
        ``distinct_rows`` / ``exchanged_rows``: with an :attr:`exchange`, per dim group of the
        tables the distinct rows ``features`` touch / the exchange returns, when the caller
        knows them (see ``FusedUpdate``)."""
        weights = input_weights(features, self._is_weighted)
        if torch.compiler.is_exporting():
            return self._pool_for_export(features, weights)
        if features.values().is_meta or self._flat.is_meta:
            width = sum(self._lengths_per_embedding)
            dtype = accumulate_dtype(self._flat.dtype)
            return torch.empty(features.stride(), width, dtype=dtype, device="meta")
        ids = self.lookup_ids(features)
        if not self._views_intact():
            self._repack()
        fused = None
        handles = [bag.weight for bag in self.embedding_bags.values()]
        if self.optimizer is not None:
            fused = FusedUpdate(
                self.optimizer,
                self._states,
                self.optimizer_step,
                exchange=self.exchange,
                distinct_rows=None if distinct_rows is None else tuple(distinct_rows),
                exchanged_rows=None if exchanged_rows is None else tuple(exchanged_rows),
            )
            handles = [self._anchor]
        # Which kernels serve this call (kept for inspection: ``ebc._last_backend``).
        self._last_backend = choose_backend(self.backend, self._plan, self._flat, fused)
        return table_batched_embedding_bag(
            self._plan,
            self._flat,
            handles,
            ids,
            features.offsets(),
            self._features.positions(features.keys()),
            features.stride(),
            weights,
            fused=fused,
            backend=self._last_backend,
            validate=self.validate,
            feature_names=self._features.features,
            key_lengths=features.length_per_key_or_none(),
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
            self.lookup_ids(features),
            features.offsets(),
            weights,
            self._features.positions(features.keys()),
            features.stride(),
        )

    def lookup_ids(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The row each id of ``features.values()`` reads in its table: here the ids
        themselves (a dynamic collection maps its keys to rows)."""
        return features.values()

    def _check_config(self, config: EmbeddingBagConfig) -> None:
        check_table_config(config)

    def _lookup_plan(self) -> LookupPlan:
        tables = self._embedding_bag_configs
        feature_to_table = [t for t, c in enumerate(tables) for _ in c.feature_names]
        return LookupPlan(self._layout, feature_to_table, [pooling_mode(c) for c in tables])

    def is_weighted(self) -> bool:
        return self._is_weighted

    def __prepare_scriptable__(self) -> EmbeddingBagCollection:
        raise RuntimeError(
            "recsys' EmbeddingBagCollection does not support TorchScript (torch.jit.script is "
            "deprecated since torch 2.13); use torch.export (recsys export writes a .pt2 file) "
            "or torch.fx.symbolic_trace"
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs


class TracedLookup(nn.Module):
    """A collection's handle for ``torch.fx``: a trace refers to modules by their path, and a
    collection traced on its own (the root) has none, so the traced call names this child,
    which points back at its collection (a plain attribute: not a submodule, no state)."""

    def __init__(self, collection: EmbeddingBagCollection) -> None:
        super().__init__()
        object.__setattr__(self, "collection", collection)


@torch.fx.wrap
def pooled_values(lookup: TracedLookup, features: KeyedJaggedTensor) -> torch.Tensor:
    """``collection.pooled_values(features)`` as one node of a ``torch.fx`` trace: the
    tracer records this call instead of tracing into it."""
    return lookup.collection.pooled_values(features)
