"""DynamicTables: what dynamic tables add to a collection of packed tables, pooled
(:class:`~recsys.embedding.dynamic.collection.DynamicEmbeddingBagCollection`) or unpooled
(:class:`~recsys.embedding.unpooled_tables.DynamicEmbeddingCollection`).

The id -> slot map per dynamic table in front of the packed buffers
(:mod:`recsys.embedding.dynamic.slot_map`, the arena of :mod:`recsys.embedding.dynamic.key_arena`),
fresh rows, state by key (the state-dict hooks below), deltas and the counters; and
:func:`keyed_tables`, which turns a collection's table configs into its dynamic tables and the
configs of its packed tables. What a dynamic table promises is in the docstring of
:mod:`recsys.embedding.dynamic.collection`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from recsys.embedding.dynamic.key_arena import KeyArena, Placed, build_arenas
from recsys.embedding.dynamic.slot_map import Insertion
from recsys.embedding.dynamic.table import (
    ADMISSION_STATE,
    KEY_STATE,
    DynamicTable,
    DynamicTableOptions,
)
from recsys.embedding.inputs import feature_positions, feature_spans
from recsys.embedding.interface import WEIGHT, TableDelta
from recsys.embedding.optim import FusedOptimizer
from recsys.embedding.row_init import initial_rows, table_seed
from recsys.embedding.tables import options_by_table, row_bytes
from recsys.ops.slot_map.hash_map import find_slots_torch

__all__ = ["DYNAMIC", "DynamicTables", "keyed_tables"]

DYNAMIC = "dynamic"
DYNAMIC_STEP = "dynamic_step"


class DynamicTables:
    """What dynamic tables add to a collection of packed tables: the id -> slot maps in front of
    them, fresh rows, state by key and the counters (see the module docstring). The first base
    of :class:`DynamicEmbeddingBagCollection` and of the unpooled
    :class:`~recsys.embedding.unpooled_tables.DynamicEmbeddingCollection`, whose constructor
    builds its packed tables from :func:`keyed_tables`' configs, then calls
    :meth:`_init_dynamic`."""

    def _init_dynamic(
        self,
        tables: list[BaseEmbeddingConfig],
        keyed: dict[str, DynamicTable],
        seed: int,
        optimizer: FusedOptimizer | None,
    ) -> None:
        self._logical_configs = tables
        self.dynamic = nn.ModuleDict(keyed)
        features = {c.name: c.feature_names for c in tables}
        self._set_arenas(build_arenas(keyed, features))
        self._zero_rows = None  # (layout, element and row indices of the arena zero rows)
        self._live_keys = {}  # name -> (its map's keys, their version, its live keys)
        self._zero_rows_stale = False  # a training step may have updated the zero rows
        # the arena tables' zero rows or their state may not be at their initial value: a
        # training step gave ids no row, or something wrote the tables (a load, an init)
        self._zero_rows_dirty = True
        self._arena_offsets = {}  # id(arena) -> (layout, its tables' element and row offsets)
        self.seed = seed
        self.register_buffer(DYNAMIC_STEP, torch.zeros((), dtype=torch.int64, device=self.device))
        self._step_seen = (None, -1, 0)  # (buffer, its version, the step it holds)
        self.set_optimizer(optimizer)  # binds the state buffers of the packed tables
        self.reset_parameters()
        self.register_state_dict_post_hook(_save_key_layout)
        self.register_load_state_dict_pre_hook(_load_key_layout)
        self.register_load_state_dict_post_hook(_start_delta_at_load)

    def _set_arenas(self, arenas: list[KeyArena]) -> None:
        """Map the keys of the tables of ``arenas`` through them (the others: each on its own
        insert path)."""
        self._arenas = arenas
        self._arena_tables = {name for arena in arenas for name in arena.names}
        self._outside_arenas = [name for name in self.dynamic if name not in self._arena_tables]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._logical_configs

    def set_optimizer(self, optimizer: FusedOptimizer | None) -> None:
        """As the packed tables'; a table's ``memory_budget_mb`` now counts this
        optimizer's state per row."""
        super().set_optimizer(optimizer)
        self._zero_rows_dirty = True  # state buffers of their own
        for config in self._logical_configs if hasattr(self, DYNAMIC) else []:
            if config.name in self.dynamic:
                self.dynamic[config.name].budget(row_bytes(config, optimizer))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """As the packed tables'; a dynamic table cannot be one of them.

        Raises:
            ValueError: a dynamic table would be trained by a torch optimizer."""
        self._check_trainable()
        return super().trainable_parameters()

    def _check_trainable(self) -> None:
        if self.optimizer is None and any(
            self.table_modules[name].weight.requires_grad for name in self.dynamic
        ):
            raise ValueError(
                f"dynamic tables {list(self.dynamic)} are trained by a fused optimizer (pass "
                "optimizer=..., or train.fused_embedding_update = true); their rows move as "
                "they grow, which a torch optimizer holding the parameters cannot follow. "
                "Freeze them (requires_grad_(False)) to use them without training"
            )

    def reset_parameters(self) -> None:
        """Fixed tables from their ``init_fn``; a dynamic table's live keys back to their
        initial rows (the other rows zero)."""
        if self.device.type == "meta" or not hasattr(self, DYNAMIC):
            return
        self._zero_rows_dirty = True
        for config in self._logical_configs:
            weight = self.table_modules[config.name].weight
            with torch.no_grad():
                if config.name not in self.dynamic:
                    config.init_fn(weight)
                    continue
                table = self.dynamic[config.name]
                keys, slots = table.map.entries()
                weight.zero_()
                weight[slots] = table.fresh_rows(keys, weight.dtype)

    def lookup_ids(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The ids with every dynamic table's keys replaced by their rows: assigned (inserting
        keys) in a training forward with a fused optimizer, else only looked up.

        The tables of an arena (:mod:`recsys.embedding.dynamic.key_arena`) are looked up together,
        without waiting on the device except for one read of which tables miss a key; only
        those, and the tables outside an arena, take the per-table insert path."""
        values = features.values()
        if not self.dynamic:
            return values
        if torch.compiler.is_exporting():
            for arena in self._arenas:
                arena.release()
            return self._exported_rows(features)
        training = self.training and self.optimizer is not None
        if training:
            if not self._zero_rows_stale:
                self._zero_rows_stale = True
        elif self._zero_rows_stale:
            self._clear_zero_rows()
        step = self._advance_step() if training else None
        out, missing, placed_keys = values, set(), False
        for arena in self._arenas:
            rows, mapped, names, placed = arena.lookup(features, step)
            out = rows if mapped is None else torch.where(mapped, rows, out)
            missing.update(names)
            if placed is not None:
                placed_keys = True
                if arena.places_keys:
                    self._init_placed_rows(arena, placed)
        if training and self._arenas:
            self._reset_zero_rows(placed_keys or bool(missing))
        per_table = self._outside_arenas
        if missing:
            per_table = [n for n in self.dynamic if n not in self._arena_tables or n in missing]
        if not per_table:
            return out
        out = self._per_table_rows(features, out, per_table, step)
        for arena in self._arenas:
            if missing.intersection(arena.names):
                arena.refresh()  # the maps these tables grew or filled
        return out

    def _clear_zero_rows(self) -> None:
        """Zero every dynamic table's zero row before a lookup outside training: the fused
        update of the step before may have moved it (the gradients of keys not admitted land
        there until the next training lookup resets it), and keys without a row must read
        zeros."""
        with torch.no_grad():
            for name, table in self.dynamic.items():
                self.table_modules[name].weight.select(0, table.zero_row).zero_()
        self._zero_rows_stale = False

    def _per_table_rows(
        self, features: KeyedJaggedTensor, out: torch.Tensor, names: list[str], step: int | None
    ) -> torch.Tensor:
        """Each table of ``names`` on its own insert path: its ids' rows written into ``out``."""
        values = features.values()
        out = values.clone() if out is values else out
        spans = feature_spans(features)
        training = step is not None
        for index, config in enumerate(self._logical_configs):
            if config.name not in names:
                continue
            where = feature_positions(spans, config.feature_names)
            ids = values[where]
            table = self.dynamic[config.name]
            if not training:
                out[where] = table.find(ids)
                continue
            rows, insertion, keys = table.assign(ids, step)
            self._place(index, table, insertion, keys)
            out[where] = rows
        return out

    def _init_placed_rows(self, arena: KeyArena, placed: Placed) -> None:
        """The initial rows and optimizer state of the keys ``arena`` placed (one write per
        packed buffer; its tables share one dim)."""
        layout = self._layout
        cached = self._arena_offsets.get(id(arena))
        if cached is None or cached[0] is not layout or cached[1].device != self._flat.device:
            tables = self._table_indices(arena.names)
            # ids of no table of the arena (row 0 of their entry) write the zero row of the
            # arena's first table, reset right after
            zero = (tables[0], layout.rows[tables[0]] - 1)
            elements = [*(layout.elem_offsets[t] for t in tables)]
            elements.append(layout.elem_offsets[zero[0]] + zero[1] * layout.dims[zero[0]])
            rows = [*(layout.row_offsets[t] for t in tables), layout.row_offsets[zero[0]] + zero[1]]
            cached = (
                layout,
                torch.tensor(elements, device=self.device),
                torch.tensor(rows, device=self.device),
            )
            self._arena_offsets[id(arena)] = cached
        _, element_offsets, row_offsets = cached
        dim = arena.tables[0].dim
        tables = placed.tables
        seeds = arena.per_table("seed").index_select(0, tables)
        bounds = arena.per_table("bound").index_select(0, tables)
        values = initial_rows(placed.keys, seeds, dim, bounds, self._flat.dtype)  # [U, D]
        rows = row_offsets.index_select(0, tables) + placed.rows  # [U] in the row space
        first = element_offsets.index_select(0, tables) + placed.rows * dim
        elements = first.unsqueeze(1) + torch.arange(dim, device=self.device)  # [U, D]
        with torch.no_grad():
            self._flat.index_put_((elements.view(-1),), values.view(-1))
            self._initial_state_at(rows, elements.view(-1))

    def _table_indices(self, names) -> list[int]:
        """The index of each table of ``names`` in the packed layout (config order)."""
        index = {c.name: t for t, c in enumerate(self._logical_configs)}
        return [index[name] for name in names]

    def _advance_step(self) -> int:
        """Count a training step in ``dynamic_step`` and return it, from a host copy: the
        buffer is read only when something else wrote it (a load, a reshard)."""
        buffer = self.dynamic_step
        seen, version, step = self._step_seen
        if buffer is not seen or buffer._version != version:
            step = int(buffer)
        buffer.fill_(step + 1)
        self._step_seen = (buffer, buffer._version, step + 1)
        return step + 1

    def _reset_zero_rows(self, ids_without_rows: bool) -> None:
        """Put the zero row of every arena table back to zero and its optimizer state to the
        initial value (as :meth:`_place` does for a table on the insert path): one write per
        packed buffer. Skipped while nothing can have moved them: the last training step
        gave every id a row (so its update wrote no zero row) and nothing wrote the tables
        since. ``ids_without_rows``: this step placed keys (its ids at a cap or not admitted
        read a zero row, and the placement writes one) or left some to the insert path."""
        layout = self._layout
        dirty = self._zero_rows_dirty
        if dirty != ids_without_rows:
            self._zero_rows_dirty = ids_without_rows
        cached = self._zero_rows
        if cached is not None and cached[0] is layout and not (dirty or ids_without_rows):
            return
        if cached is None or (cached[0], cached[1].device) != (layout, self._flat.device):
            tables = self._table_indices(self._arena_tables)
            elements = torch.cat(
                [
                    torch.arange(layout.dims[t], device=self.device)
                    + layout.elem_offsets[t]
                    + (layout.rows[t] - 1) * layout.dims[t]
                    for t in tables
                ]
            )
            rows = torch.tensor(
                [layout.row_offsets[t] + layout.rows[t] - 1 for t in tables], device=self.device
            )
            cached = (layout, elements, rows)
        if cached[0] is not layout:  # an equal layout in a new object
            cached = (layout, *cached[1:])
        self._zero_rows = cached
        _, elements, rows = cached
        with torch.no_grad():
            self._flat.index_fill_(0, elements, 0)
            self._initial_state_at(rows, elements)

    def _initial_state_at(self, rows: torch.Tensor, elements: torch.Tensor) -> None:
        """Put the optimizer state of packed ``rows`` (per-row state) and ``elements`` (state
        per element) back to its initial value."""
        for name, buffer in self._states.items():
            where = rows if self.optimizer.states[name] == "row" else elements
            buffer.index_fill_(0, where, self.optimizer.initial_state(name))

    def _place(self, index: int, table: DynamicTable, insertion: Insertion, keys: torch.Tensor):
        """After an insertion: follow the map's growth, give new keys their initial rows and
        state, and put the zero row back to zero."""
        name = table.name
        if self.table_modules[name].weight.shape[0] != table.rows:  # the map grew
            self.resize_table(index, table.rows, insertion.moved)
        fresh = insertion.slots[insertion.inserted]
        bag = self.table_modules[name]
        with torch.no_grad():
            if len(fresh):
                bag.weight[fresh] = table.fresh_rows(keys[insertion.inserted], bag.weight.dtype)
            bag.weight[table.zero_row] = 0
            for state in self.optimizer.states:
                initial = self.optimizer.initial_state(state)
                if len(fresh):
                    getattr(bag, state)[fresh] = initial
                getattr(bag, state)[table.zero_row] = initial

    def _exported_rows(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """What ``torch.export`` traces: every dynamic table's keys looked up in its frozen
        map with plain tensor ops (no check that reads values), the zero row for the rest."""
        values = features.values()
        spans = feature_spans(features)
        out = values
        for config in self._logical_configs:
            if config.name not in self.dynamic:
                continue
            table = self.dynamic[config.name]
            for feature in config.feature_names:
                span = spans[feature]
                positions = torch.arange(span.start, span.stop, device=values.device)
                slots = find_slots_torch(
                    table.map.keys, table.map.num_buckets, table.map.bucket_size, values[positions]
                )
                rows = torch.where(slots >= 0, slots, table.zero_row)
                out = out.index_put((positions,), rows)
        return out

    def dynamic_stats(self) -> dict[str, dict[str, float]]:
        """Per dynamic table, its counters: ``size`` (live keys), ``capacity`` (slots now),
        ``load_factor``, and since the collection was built ``hits``, ``misses``,
        ``inserts``, ``evictions``, ``expirations``, ``rejected`` (lookups of keys not
        admitted), ``grows``; with admission, ``admission_*``."""
        return {name: table.stats() for name, table in self.dynamic.items()}

    def live_keys(self, name: str) -> torch.Tensor | None:
        """[n] int64, ascending: the keys dynamic table ``name`` holds a row for now (None for
        a fixed table, whose ids are its rows ``0 .. num_embeddings - 1``). The same tensor
        while the map holds the same keys: read it, do not write it."""
        if name not in self.dynamic:
            return None
        # kept until the map's keys change (an insert, an eviction, new tensors): a training
        # step that reads the corpus (a sequence model's negatives) and inserts nothing
        # neither waits on the host (``entries`` lists the live slots) nor sorts them again
        keys = self.dynamic[name].map.keys
        if torch.is_inference(keys):  # (no version counter to tell a change)
            return self.dynamic[name].map.entries()[0]
        cached = self._live_keys.get(name)
        if cached is None or cached[0] is not keys or cached[1] != keys._version:
            cached = (keys, keys._version, self.dynamic[name].map.entries()[0])
            self._live_keys[name] = cached
        return cached[2]

    def variable_state_keys(self) -> list[str]:
        """State keys whose size is the number of keys a dynamic table holds."""
        return [key for name in self.dynamic for key in self.table_state_keys(name)]

    def table_state_keys(self, name: str) -> list[str]:
        """The state keys of dynamic table ``name``: its rows, their optimizer state, and its
        key state (``dynamic.<name>.keys``, ...)."""
        states = self.optimizer.states if self.optimizer is not None else {}
        prefix = f"{self.tables_key}.{name}"
        keys = [f"{prefix}.{WEIGHT}"] + [f"{prefix}.{s}" for s in states]
        return keys + [f"{DYNAMIC}.{name}.{k}" for k in self.dynamic[name].state_names()]

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Dynamic table ``name``'s part of ``state_dict()``: its live keys' rows and optimizer
        state, and its key state, keys in (routing bucket, key) order (see
        :meth:`~recsys.embedding.dynamic.table.DynamicTable.key_state`)."""
        slots, key_state = self.dynamic[name].key_state()
        bag = self.table_modules[name]
        out = {f"{self.tables_key}.{name}.{WEIGHT}": bag.weight.detach()[slots]}
        for state in self.optimizer.states if self.optimizer is not None else {}:
            out[f"{self.tables_key}.{name}.{state}"] = getattr(bag, state)[slots]
        out.update({f"{DYNAMIC}.{name}.{key}": value for key, value in key_state.items()})
        return out

    def load_table_state(self, name: str, saved: dict[str, torch.Tensor]) -> None:
        """Replace dynamic table ``name``'s keys, rows and optimizer state by ``saved`` (what
        :meth:`table_state` returns, keys in any order; optimizer state it lacks starts
        fresh)."""
        self._zero_rows_dirty = True
        with torch.no_grad():
            for key, rows in self.slot_rows(name, saved).items():
                _, _, tensor = key.split(".")
                bag = self.table_modules[name]
                (bag.weight if tensor == WEIGHT else getattr(bag, tensor)).copy_(rows)

    def slot_rows(self, name: str, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Restore table ``name``'s map from ``saved`` (as :meth:`table_state` returns it),
        resize its rows to the map, and return its saved rows and optimizer state in that
        slot layout (the zero row at zero, other unused rows at the initial state)."""
        index = [c.name for c in self.embedding_bag_configs()].index(name)
        table = self.dynamic[name]
        key_state = {
            key: saved[f"{DYNAMIC}.{name}.{key}"]
            for key in KEY_STATE + ADMISSION_STATE
            if f"{DYNAMIC}.{name}.{key}" in saved
        }
        slots = table.load_key_state(key_state)
        self.resize_table(index, table.rows)
        bag = self.table_modules[name]
        targets = {WEIGHT: (bag.weight, 0.0)}
        for state in self.optimizer.states if self.optimizer else {}:
            targets[state] = (getattr(bag, state), self.optimizer.initial_state(state))
        out = {}
        for key, (live, fill) in targets.items():
            if f"{self.tables_key}.{name}.{key}" not in saved:
                continue
            rows = torch.full_like(live, fill)
            values = saved[f"{self.tables_key}.{name}.{key}"]
            kept = slots >= 0  # a key the cap left out has no row
            rows[slots[kept]] = values.to(rows.device)[kept.to(values.device)].to(rows.dtype)
            if key == WEIGHT:
                rows[table.zero_row] = 0
            out[f"{self.tables_key}.{name}.{key}"] = rows
        return out

    def take_delta(self) -> dict[str, TableDelta]:
        """Per dynamic table, what changed since the previous call (or since the collection
        was built or loaded): the keys trained since then (a row changes only when its key is
        trained) with their rows and last steps now, and the keys that lost their row since
        (evicted, expired) and have none now. The next call starts from now.

        Deletions are recorded only once deltas are taken: from the first call on, one int64
        per key that loses its row until the next call (a collection whose deltas are never
        taken records nothing). Call it once right after building or loading to start (the
        trainer does, with ``checkpoint.delta_every_steps``); the first call after a load
        without that warns if keys left unrecorded. Take deltas between training steps.

        Returns:
            table name -> :class:`~recsys.embedding.interface.TableDelta` (tensors on the
            collection's device; rows in the table's dtype).
        """
        step = int(self.dynamic_step)
        deltas = {}
        for name, table in self.dynamic.items():
            keys, slots = table.changed_keys()
            rows = self.table_modules[name].weight.detach()[slots]
            last_seen = table.map.last_seen[slots]
            deltas[name] = TableDelta(keys, rows, last_seen, table.deleted_keys())
            table.start_delta(step)
        return deltas


def keyed_tables(
    tables: list[BaseEmbeddingConfig],
    dynamic: DynamicTableOptions | dict[str, DynamicTableOptions],
    seed: int,
    optimizer: FusedOptimizer | None,
    device: torch.device | str | None,
    backend: str,
) -> tuple[dict[str, DynamicTable], list[BaseEmbeddingConfig]]:
    """(the dynamic tables' maps by name, the configs of the packed tables: a dynamic table's
    slots and its zero row) of a collection of ``tables`` whose ``dynamic`` options name some
    (a bare :class:`DynamicTableOptions`: all)."""
    options = options_by_table(tables, dynamic, DynamicTableOptions, "dynamic")
    for config in tables:
        if not config.feature_names:
            config.feature_names = [config.name]
    where = torch.device(device) if device is not None else torch.empty(()).device
    keyed = {
        c.name: DynamicTable(
            c,
            options[c.name],
            table_seed(seed, c.name),
            row_bytes(c, optimizer),
            where,
            backend,
        )
        for c in tables
        if c.name in options
    }
    packed = [
        replace(c, num_embeddings=keyed[c.name].rows) if c.name in keyed else c for c in tables
    ]
    return keyed, packed


def _save_key_layout(module: DynamicTables, state_dict, prefix, local_metadata):
    """state_dict post-hook: each dynamic table's rows and state in key order, with its key
    state, instead of its slots."""
    for name in module.dynamic:
        for key, value in module.table_state(name).items():
            state_dict[prefix + key] = value


def _load_key_layout(
    module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
):
    """load_state_dict pre-hook: restore each dynamic table's map from its saved keys, size its
    rows to the saved capacity, and turn its saved rows into its slot layout (the tables'
    own loading then copies them in). Optimizer state a checkpoint lacks starts fresh."""
    for name in module.dynamic:
        names = module.table_state_keys(name)
        saved = {key: state_dict.pop(prefix + key) for key in names if prefix + key in state_dict}
        if f"{DYNAMIC}.{name}.keys" not in saved:
            state_dict.update({prefix + key: value for key, value in saved.items()})
            continue  # missing keys: reported by the table's own loading (shapes differ)
        rows = module.slot_rows(name, saved)
        state_dict.update({prefix + key: value for key, value in rows.items()})


def _start_delta_at_load(module: DynamicTables, incompatible_keys) -> None:
    """load_state_dict post-hook: the loaded state is the baseline of the next delta (see
    :meth:`DynamicEmbeddingBagCollection.take_delta`); its zero rows are reset before the
    next training step."""
    module._zero_rows_dirty = True
    step = int(module.dynamic_step)
    for table in module.dynamic.values():
        table.start_delta(step, loaded=True)
