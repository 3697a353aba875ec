"""The packed table store both embedding collections are built on: every table of a collection
in one flat buffer (a :class:`recsys.ops.embedding_bag.pooled.TableLayout`), each table's weight a
view of it, and a fused optimizer's state in flat buffers beside it.

:class:`PackedTables` owns that storage (building it, binding the views, repacking after a
parameter was replaced, moving it between devices and dtypes, resizing a table, swapping the
fused optimizer); the pooled :class:`recsys.embedding.collection.EmbeddingBagCollection` and the
unpooled :class:`recsys.embedding.sequence.EmbeddingCollection` add their lookup on top. The
tables are submodules ``<tables_key>.<table>`` (``embedding_bags`` or ``embeddings``, TorchRec's
names), so their state dict keys are TorchRec's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys.embedding.interface import EmbeddingCollectionInterface
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.tables import table_dtype
from recsys.ops.embedding_bag.pooled import LookupPlan, TableLayout
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


class PackedTables(EmbeddingCollectionInterface):
    """Tables packed in one buffer, with an optional fused optimizer (see the module docstring).

    Subclasses set :attr:`tables_key`, check their configs in :meth:`_check_config` and build
    the plan their lookup runs in :meth:`_lookup_plan` (called again when a table is resized).

    Args:
        tables: one config per table (names distinct, one data_type for all).
        device: where the tables live (``"meta"`` leaves them uninitialized).
        backend: op backend, ``"auto"`` / ``"torch"`` / ``"triton"``.
        validate: the input checks (see :func:`recsys.ops.input_checks.check_mode`).
        optimizer: a fused optimizer from :mod:`recsys.embedding.optim`, or None.
    """

    def __init__(
        self,
        tables: list[BaseEmbeddingConfig],
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
            raise ValueError(f"{type(self).__name__} needs at least one table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate table names: {duplicates}")
        reserved = [n for n in names if hasattr(nn.ModuleDict, n)]
        if reserved:  # TorchRec's collections (a ModuleDict of tables) cannot take them either
            raise ValueError(
                f"table names {reserved} are names of nn.ModuleDict methods, which hold the "
                "tables (as in TorchRec); rename the tables"
            )
        # Default: where a new tensor goes (CPU, or the device of a `with torch.device(...)`).
        self._device = torch.device(device) if device is not None else torch.empty(()).device
        self._embedding_bag_configs = tables
        self.backend = backend
        self.validate = validate
        self.optimizer: FusedOptimizer | None = None
        # With a fused optimizer, tables replicated on several ranks exchange their touched
        # rows before the update (recsys.distributed.replicated sets it; see FusedUpdate).
        self.exchange: RowExchange | None = None
        for config in tables:
            self._check_config(config)
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
        self.add_module(self.tables_key, nn.ModuleDict())
        for config, view in zip(tables, self._layout.table_views(self._flat), strict=True):
            self.table_modules[config.name] = EmbeddingTable(view, requires_grad=True)
        self.set_optimizer(optimizer)

    @property
    def table_modules(self) -> nn.ModuleDict:
        """The tables by name (the ``<tables_key>`` submodule)."""
        return self._modules[self.tables_key]

    def _check_config(self, config: BaseEmbeddingConfig) -> None:
        """Raise a ValueError naming the table when this kind cannot serve ``config``."""
        raise NotImplementedError

    def _lookup_plan(self) -> LookupPlan:
        """The plan of this collection's lookups over the current layout."""
        raise NotImplementedError

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
        self._plan = self._lookup_plan()
        self._bind_views()

    def set_optimizer(self, optimizer: FusedOptimizer | None) -> None:
        """Fuse ``optimizer`` into backward from now on (fresh state, step 0), or with None
        go back to dense gradients for a torch optimizer."""
        if optimizer is not None and not isinstance(optimizer, FusedOptimizer):
            raise ValueError(
                f"optimizer={optimizer!r}; expected None or a fused optimizer from "
                "recsys.embedding.optim (SGD, Adagrad, RowWiseAdagrad, Adam)"
            )
        for table in self.table_modules.values():
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
        for t, table in enumerate(self.table_modules.values()):
            table.weight.data = weight_views[t]
            for name, views in state_views.items():
                table._buffers[name] = views[t]

    def _views_intact(self) -> bool:
        base, size = self._flat.data_ptr(), self._flat.element_size()
        return all(
            table.weight.data_ptr() == base + offset * size
            and table.weight.dtype == self._flat.dtype
            for table, offset in zip(
                self.table_modules.values(), self._layout.elem_offsets, strict=True
            )
        )

    def _repack(self) -> None:
        """Rebuild the packed buffers from the tables' current tensors: needed when something
        replaced a parameter instead of writing into it (``load_state_dict(assign=True)``,
        ``param.data = ...``)."""
        tables = list(self.table_modules.values())
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

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def layout(self) -> TableLayout:
        """Where each table lives in the packed buffer."""
        return self._layout

    def packed_weight(self) -> torch.Tensor:
        """Every table as one [total rows, D] matrix, table t from row
        ``layout.row_offsets[t]``: a view of the packed buffer (repacked first if a table's
        parameter was replaced), for tables of one dim.

        Raises:
            ValueError: the tables have several dims (one matrix per dim would be needed).
        """
        dims = sorted(set(self._layout.dims))
        if len(dims) != 1:
            raise ValueError(f"tables of dims {dims} do not pack into one matrix")
        if not self._views_intact():
            self._repack()
        return self._flat.view(-1, dims[0])

    def reset_parameters(self) -> None:
        """Initialize every table with its config's ``init_fn`` (TorchRec's default: uniform
        in +-sqrt(1 / num_embeddings))."""
        if self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            with torch.no_grad():
                config.init_fn(self.table_modules[config.name].weight)
