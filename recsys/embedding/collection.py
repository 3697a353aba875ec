"""EmbeddingBagCollection: a drop-in for ``torchrec.EmbeddingBagCollection`` on recsys ops.

The constructor, ``forward(KeyedJaggedTensor) -> KeyedTensor`` and the state_dict keys
(``embedding_bags.<table>.weight``) are TorchRec's, so a TorchRec model switches by changing one
import and checkpoints load both ways. All tables are looked up by one call of
:func:`recsys.ops.embedding_bag.embedding_bag`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from recsys.embedding.inputs import FeatureOrder, input_weights, is_symbolic
from recsys.embedding.interface import EmbeddingCollectionInterface
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import check_table_config, output_keys, pooling_mode, table_dtype
from recsys.ops._triton import accumulate_dtype
from recsys.ops.embedding_bag import (
    FusedUpdate,
    LookupPlan,
    TableLayout,
    choose_backend,
    table_batched_embedding_bag,
)
from recsys.ops.embedding_bag_cpu import pool_torch
from recsys.ops.input_checks import check_mode

# (sorted touched rows [U], their reduced gradients [U, D]) -> the rows and gradients to apply.
RowExchange = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class EmbeddingTable(nn.Module):
    """One table's weight [num_embeddings, embedding_dim] (a view of its collection's packed
    buffer) and, with a fused optimizer, its optimizer state; looked up by its collection."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, dtype={self.weight.dtype}"


class EmbeddingBagCollection(EmbeddingCollectionInterface):
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
        super().__init__()
        check_mode(validate)
        names = [t.name for t in tables]
        if not tables:
            raise ValueError("EmbeddingBagCollection needs at least one table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate table names: {duplicates}")
        # Default: where a new tensor goes (CPU, or the device of a `with torch.device(...)`).
        self._device = torch.device(device) if device is not None else torch.empty(()).device
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        self.backend = backend
        self.validate = validate
        self.optimizer: FusedOptimizer | None = None
        # With a fused optimizer, tables replicated on several ranks exchange their touched
        # rows before the update (recsys.distributed.replicated sets it; see FusedUpdate).
        self.exchange: RowExchange | None = None
        for config in tables:
            check_table_config(config)
            if not config.feature_names:
                config.feature_names = [config.name]
        dtypes = {table_dtype(c) for c in tables}
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
        self._embedding_names, self._lengths_per_embedding = output_keys(tables)
        feature_to_table = [t for t, c in enumerate(tables) for _ in c.feature_names]
        self._features = FeatureOrder([f for c in tables for f in c.feature_names])
        self._plan = LookupPlan(self._layout, feature_to_table, [pooling_mode(c) for c in tables])
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

    def resize_table(
        self, index: int, rows: int, moved: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Give table ``index`` (in config order) ``rows`` rows, rebuilding the packed
        buffers (one copy): rows ``moved[0]`` of the old table land in rows ``moved[1]`` of the
        new one with their optimizer state; every other row of it starts at zero weight and
        the optimizer's initial state. The other tables keep their values."""
        old, rows_now = self._layout, list(self._layout.rows)
        rows_now[index] = rows
        new = TableLayout.build(rows_now, old.dims)

        def rebuilt(buffer: torch.Tensor, per_row: bool, fill: float) -> torch.Tensor:
            size = new.total_rows if per_row else new.numel
            out = torch.full((size,), fill, dtype=buffer.dtype, device=buffer.device)
            views = old.row_views if per_row else old.table_views
            new_views = new.row_views if per_row else new.table_views
            for t, (src, dst) in enumerate(zip(views(buffer), new_views(out), strict=True)):
                if t != index:
                    dst.copy_(src)
                elif moved is not None:
                    dst[moved[1]] = src[moved[0]]
            return out

        with torch.no_grad():
            self._flat = rebuilt(self._flat, False, 0.0)
            for name, buffer in self._states.items():
                per_row = self.optimizer.states[name] == "row"
                self._states[name] = rebuilt(buffer, per_row, self.optimizer.initial_state(name))
        self._layout = new
        poolings = [pooling_mode(c) for c in self._embedding_bag_configs]
        self._plan = LookupPlan(new, self._plan.feature_to_table, poolings)
        self._bind_views()

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

    def __prepare_scriptable__(self) -> EmbeddingBagCollection:
        raise RuntimeError(
            "recsys' EmbeddingBagCollection does not support TorchScript (torch.jit.script is "
            "deprecated since torch 2.13); use torch.export (recsys export writes a .pt2 file) "
            "or torch.fx.symbolic_trace"
        )

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
