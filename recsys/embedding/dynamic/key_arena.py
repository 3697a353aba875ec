"""One buffer for the id -> slot maps of a collection's dynamic tables, and a lookup that maps
the ids of all of them at once.

A :class:`KeyArena` holds the keys, scores and last steps of several dynamic tables' maps side
by side: table t's slots are ``[base_t, base_t + capacity_t)`` of one buffer (its buckets
``[first_t, first_t + num_buckets_t)``), and one scratch slot at the end takes the writes of
ids that must change nothing. Each :class:`~recsys.embedding.dynamic.slot_map.SlotMap` works on
views of its range, so its own insert, eviction, expiry and checkpoint code is unchanged; when a map
takes new tensors (it grew, or was restored) the arena is rebuilt before its next use (one
copy of every map: growth doubles, so this is rare).

:meth:`KeyArena.lookup`, for every id of a batch at once (shape letters: V ids of the batch, U
ids that scanned their bucket, T tables of the arena)::

    ids -> each id's own map: find -> [U ids scanned: misses per table]
        no miss: scores, last steps and hits updated on the device
        misses: new keys placed -> [placed, evicted, overflowed, still missing per table]
            tables whose new keys fit, or at their cap: placed, their ids then as hits
            the others (they grow, or count admission): named to the caller, which runs
            their own insert path

The host reads (``[...]``): on CUDA the misses per table (1 per step) and, on a step with new
keys, what was placed (2); on CPU, the compiled loops (below) list the ids without a slot, and
when there are any, what was placed is read (a step of hits: no read; with new keys: 1); the
tensor ops first list the ids without a valid hint (1 to 3 per step; a step of hits: 1 or 2).
A table at its cap (its eviction) costs no more reads.

Finding the slots: on CUDA one Triton launch scans each id's bucket
(:func:`~recsys.ops.slot_map.arena_scan.find_arena_slots`). On CPU, where scanning the [V, S] bucket
rows costs more than the rest of the step, each id first tries its **hint**: the entry picked by
a hash of the key in its table's own region of a hint buffer, naming a slot; a hint is
accepted only if its slot holds the key (only the table's ids write its region, so the slot
is the key's slot in that table). The ids without a valid hint (new keys, two hot keys on one
entry, slots moved by a rehash) are listed (``nonzero``) and only those scan their bucket,
then write their hint. Hints never change a result, only how it is found. On CPU the hints'
check with the scans it needs, and the update of the slots a lookup uses (scores, last steps,
hits) are one compiled loop each (:mod:`recsys.ops.slot_map.key_arena_cpu`), bitwise the tensor ops
they replace (which run where the loops cannot be compiled); the loop lists only the ids without a
slot, as a length it returns: a CPU step of hits reads nothing back.

Placing new keys (:func:`~recsys.embedding.dynamic.arena_placement.place_new`) follows the map's own
rule: the distinct new keys of a bucket, by ascending key, take its free slots by ascending slot,
then, at the table's cap, the slots of keys the batch does not use by ascending (score, key),
evicting those keys; a key past them gets no row this step (``overflow``: the zero row). A
table below its cap is placed only if all its new keys find a free slot and it stays within its
load factor (else it grows: its own insert path does that, and is the reference the arena is
tested against). A table is placed only without an admission counter, with no more ids in the
batch than its cap (the insert path checks its distinct keys), and if the arena's tables share
one dim (their initial rows are written in one pass by the collection). A placed key starts as
a fresh row: its initial row of (seed, table, key), the optimizer's initial state, score 0
before the batch's update.

The all-hits update is bitwise the per-table path's (:meth:`SlotMap.insert` on the distinct
keys): an LRU score becomes the step, an LFU score adds one per occurrence (the per-key count
the per-table path adds), a last step becomes the step. ``hits`` counts distinct keys without
deduplicating them: every id scatters its position into its slot's last step, and the one id
whose position stays (whichever wins) counts its slot; the counts stay on the device until the
map's stats are read.

Which tables join (:func:`joins_arena`): those scored ``"lru"`` or ``"lfu"`` without a TTL (a
TTL scans the whole map every step, a custom
:class:`~recsys.embedding.dynamic.score_policy.ScorePolicy` needs each key's count); tables of one
bucket size and device share an arena.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

from recsys.embedding.dynamic import arena_find
from recsys.embedding.dynamic.arena_admission import AdmissionArena
from recsys.embedding.dynamic.arena_placement import Placed, place_new
from recsys.embedding.dynamic.score_policy import LFU, LRU
from recsys.embedding.dynamic.slot_layout import latest_generation
from recsys.embedding.dynamic.table import DynamicTable
from recsys.ops._triton import resolve_backend
from recsys.ops.slot_map import key_arena_cpu
from recsys.ops.slot_map.hash_map import EMPTY_KEY, check_keys

__all__ = ["KeyArena", "Placed", "build_arenas", "joins_arena"]


def joins_arena(table: DynamicTable) -> bool:
    """Whether ``table``'s keys are mapped by an arena: scored LRU or LFU, without a TTL."""
    return type(table.map.policy) in (LRU, LFU) and not table.options.ttl_steps


def build_arenas(tables: dict[str, DynamicTable], features: dict[str, list[str]]):
    """The arenas of a collection's dynamic ``tables`` (name -> table, in config order) that
    :func:`joins_arena`: one per (bucket size, device). ``features``: name -> the features
    the table reads."""
    groups: dict[tuple[int, torch.device], list[str]] = {}
    for name, table in tables.items():
        if joins_arena(table):
            groups.setdefault((table.map.bucket_size, table.map.device), []).append(name)
    return [
        KeyArena([tables[n] for n in names], [features[n] for n in names])
        for names in groups.values()
    ]


@dataclass
class _Ids:
    """Per id of a batch [V]: its arena table (``T`` for ids of no table of the arena), that
    table's entries of the per-table tensors, its position; whether every id is the arena's
    (``mine``: which are, None when every id is)."""

    table: torch.Tensor
    mine: torch.Tensor | None
    position: torch.Tensor
    every_id: bool
    num_buckets: torch.Tensor
    first_bucket: torch.Tensor
    base: torch.Tensor
    zero_row: torch.Tensor
    hint_base: torch.Tensor
    hint_mask: torch.Tensor
    # the columns as the arena's CPU loops take them (checked once; None until first used)
    loop_columns: tuple | None = None


# the per-table tensors each id carries (columns of one gather per batch)
_PER_ID = ("num_buckets", "first_bucket", "base", "zero_row", "hint_base", "hint_mask")


class KeyArena:
    """The maps of ``tables`` in one buffer (see the module docstring).

    Args:
        tables: dynamic tables of one bucket size, on one device.
        features: per table, the features it reads.
    """

    # On CPU, find and update through the compiled loops of :mod:`recsys.ops.slot_map.key_arena_cpu`
    # where they load (False: the tensor ops, the same results; read at the next rebuild).
    cpu_loops = True

    def __init__(self, tables: list[DynamicTable], features: list[list[str]]) -> None:
        maps = [table.map for table in tables]
        if len({(m.bucket_size, m.device) for m in maps}) != 1:
            raise ValueError("the tables of an arena share one bucket size and one device")
        self.tables = tables
        self.names = [table.name for table in tables]
        self.features = features
        self.bucket_size = maps[0].bucket_size
        self.device = maps[0].device
        self.backend = resolve_backend(
            maps[0].backend, self.device, op="find_arena_slots", has_triton=True
        )
        # Per table, and a last entry for ids of no table of the arena.
        self.hits = torch.zeros(len(tables) + 1, dtype=torch.int64, device=self.device)
        for t, slot_map in enumerate(maps):
            slot_map.pending_hits = self.hits[t]
        self._lfu = [isinstance(m.policy, LFU) for m in maps]
        # how scores update: 0 every table LRU, 1 every table LFU, 2 both kinds
        self.lfu_mode = 0 if not any(self._lfu) else 1 if all(self._lfu) else 2
        self.admission = AdmissionArena(tables) if any(t.admission for t in tables) else None
        self._generations: tuple[int, ...] | None = None
        self._feature_columns: dict[tuple[str, ...], torch.Tensor] = {}
        self._per_ids: dict[tuple[object, ...], _Ids] = {}
        self._caps: dict[tuple[int, ...], torch.Tensor] = {}
        self._pins: torch.Tensor | None = None  # per slot, the last lookup that pinned it
        self.bound_loops: key_arena_cpu.ArenaLoops | None = None  # the CPU loops on its buffers
        self._changes_seen = -1  # latest_generation() at the last check of the generations
        self._mark = self._next_mark = 1  # marks of the slots pinned by the current lookup

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickle) binds the CPU loops to its own buffers: what they
        hold are this arena's data pointers (and a foreign function, which does not pickle)."""
        state = self.__dict__.copy()
        state["bound_loops"] = None
        state["_per_ids"] = {}  # (their loop columns hold pointers too)
        return state

    # ------------------------------------------------------------------ layout

    def _current(self) -> None:
        """Rebuild the buffers if a map took new tensors since the last build (their
        generations compared only when some map anywhere took new ones)."""
        if self._generations is None or self._changes_seen != latest_generation():
            if self._generations != tuple(table.map.generation for table in self.tables):
                self._rebuild()
            self._changes_seen = latest_generation()
        if self.admission is not None:
            self.admission.current()

    def _rebuild(self) -> None:
        maps = [table.map for table in self.tables]
        capacities = [m.capacity for m in maps]
        total = sum(capacities)
        buffers = {}
        for name, fill in (("keys", EMPTY_KEY), ("scores", 0), ("last_seen", 0)):
            buffer = torch.full((total + 1,), fill, dtype=torch.int64, device=self.device)
            torch.cat([getattr(m, name) for m in maps], out=buffer[:total])
            buffers[name] = buffer
        self.keys, self.scores, self.last_seen = (
            buffers["keys"],
            buffers["scores"],
            buffers["last_seen"],
        )
        self.scratch = total
        bases, base = [], 0
        for slot_map, capacity in zip(maps, capacities, strict=True):
            span = slice(base, base + capacity)
            slot_map.adopt(self.keys[span], self.scores[span], self.last_seen[span])
            bases.append(base)
            base += capacity
        # Per table, then the entry of ids of no table: one bucket at 0 (their find is masked).
        per_table = {
            "num_buckets": [*(m.num_buckets for m in maps), 1],
            "first_bucket": [*(b // self.bucket_size for b in bases), 0],
            "base": [*bases, 0],
            "zero_row": [*capacities, 0],
            "lfu": [*self._lfu, False],
            "seed": [*(table.seed for table in self.tables), 0],
            "insertable": [*(self._insertable(table) for table in self.tables), False],
        }
        # the CPU loops (compiled C) where they load, else the same as tensor ops
        self._loops = self.device.type == "cpu" and self.cpu_loops and key_arena_cpu.available()
        # each table's own region of hints (a power of two), then one entry for ids of no
        # table, all naming the scratch slot (EMPTY_KEY, of no table) until written
        per_slot = arena_find.HINTS_PER_SLOT_LOOPS if self._loops else arena_find.HINTS_PER_SLOT
        sizes = arena_find.hint_sizes(capacities, per_slot)
        per_table["hint_base"] = [*itertools.accumulate([0, *sizes[:-1]]), sum(sizes)]
        per_table["hint_mask"] = [*(n - 1 for n in sizes), 0]
        self.hints_buffer = None
        if self.backend == "torch":
            self.hints_buffer = torch.full(
                (sum(sizes) + 1,), total, dtype=torch.int64, device=self.device
            )
        # the find's loop (with hints) lists only the ids without a slot
        self.lists_misses = self._loops and self.hints_buffer is not None
        self._per_table = {
            name: torch.tensor(values, device=self.device) for name, values in per_table.items()
        }
        self._per_id_columns = torch.stack([self._per_table[name] for name in _PER_ID], dim=1)
        self._per_table["bound"] = torch.tensor(
            [*(table.bound for table in self.tables), 0.0], dtype=torch.float64, device=self.device
        )
        # the most live keys each table takes before it must grow (as SlotMap._buckets_for)
        self._per_table["room"] = torch.tensor(
            [*(m.load_factor * m.capacity for m in maps), 0.0],
            dtype=torch.float64,
            device=self.device,
        )
        self.bound_loops = None  # bound to these buffers at the next training lookup
        self._per_ids.clear()
        self._feature_columns.clear()
        self._pins = None
        self.refresh_sizes()
        self._generations = tuple(m.generation for m in maps)

    @property
    def places_keys(self) -> bool:
        """Whether the arena places any table's new keys (see :meth:`_insertable`)."""
        return any(self._insertable(table) for table in self.tables)

    def _insertable(self, table: DynamicTable) -> bool:
        """Whether the arena places ``table``'s new keys: every table of the arena of one dim
        (one write of new rows)."""
        return len({t.dim for t in self.tables}) == 1

    def per_table(self, name: str) -> torch.Tensor:
        """[T + 1] the per-table tensor ``name`` (``seed``, ``bound``, ``base``, ...), with a
        last entry for ids of no table of the arena."""
        return self._per_table[name]

    def refresh(self) -> None:
        """After some tables ran their own insert path: rebuild if a map took new tensors,
        else copy the live-key counts to the device."""
        if self._generations != tuple(table.map.generation for table in self.tables):
            self._rebuild()
        else:
            self.refresh_sizes()
        if self.admission is not None:
            self.admission.refresh()

    def refresh_sizes(self) -> None:
        """Copy the maps' live-key counts to the device (after their own insert path ran)."""
        self.sizes = torch.tensor(
            [*(table.map.size for table in self.tables), 0], device=self.device
        )

    def release(self) -> None:
        """Give every map its own tensors again (an exported program holds a map's keys as a
        constant, which must not be a view of the whole arena); the next lookup rebuilds."""
        if self._generations is None:  # not built since the last release
            return
        for table in self.tables:
            m = table.map
            m.adopt(m.keys.clone(), m.scores.clone(), m.last_seen.clone())
        self._generations = None

    def _per_id(self, features: KeyedJaggedTensor, num_ids: int) -> _Ids:
        """Each id's arena table and that table's entries of the per-table tensors, found
        from the KJT's offsets on the device (no host read); cached by the offsets per key
        when the batch carries them (until the next rebuild)."""
        keys = tuple(features.keys())
        offsets = features.offset_per_key_or_none()
        cache_key = (keys, tuple(offsets)) if offsets is not None else None
        cached = self._per_ids.get(cache_key) if cache_key else None
        if cached is not None:
            return cached
        table_of = {f: t for t, fs in enumerate(self.features) for f in fs}
        # [F, 7] each feature's arena table, then that table's per-id columns
        feature_columns = self._feature_columns.get(keys)
        if feature_columns is None:
            feature_table = torch.tensor(
                [table_of.get(key, len(self.tables)) for key in keys], device=self.device
            )
            feature_columns = torch.cat(
                [feature_table.unsqueeze(1), self._per_id_columns.index_select(0, feature_table)],
                dim=1,
            )
            self._feature_columns[keys] = feature_columns
        stride = features.stride()
        key_ends = features.offsets()[stride::stride].contiguous()  # [F] where keys end
        position = torch.arange(num_ids, device=self.device)
        columns = (
            feature_columns.index_select(0, torch.searchsorted(key_ends, position, right=True))
            .t()
            .contiguous()
        )  # [7, V]: each a contiguous [V] (the CPU loops take them as arrays)
        table = columns[0]
        every_id = all(key in table_of for key in keys)
        per_id = _Ids(
            table=table,
            mine=None if every_id else table < len(self.tables),
            position=position,
            every_id=every_id,
            **{name: columns[c + 1] for c, name in enumerate(_PER_ID)},
        )
        if cache_key:
            if len(self._per_ids) >= 8:  # lengths per key vary: keep the recent ones
                self._per_ids.clear()
            self._per_ids[cache_key] = per_id
        return per_id

    # ------------------------------------------------------------------ lookup

    def lookup(
        self, features: KeyedJaggedTensor, step: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[str], Placed | None]:
        """The row of every id of this arena's tables in ``features``.

        Args:
            features: the batch (ids are ``features.values()``).
            step: the training step (scores and last steps updated; tables with new keys
                named), or None to only look up (keys without a row read the zero row).

        Returns:
            ``(rows, mapped, missing)``: rows [V] int64, each id's row in its table where
            ``mapped`` [V] bool (None: every id); ``missing``, the names of tables with ids
            their map does not hold (their rows here are not set and nothing of theirs was
            updated: the caller inserts them). ``missing`` is empty without ``step``.

        Raises:
            ValueError: a reserved key, when looking up without ``step`` (with ``step``,
                a reserved key is a miss and the insert path raises).
        """
        self._current()
        ids = features.values()
        if not ids.numel():
            return ids, torch.zeros_like(ids, dtype=torch.bool), [], None
        per_id = self._per_id(features, ids.numel())
        if self.lists_misses and step is not None:
            # one call: find, and where every id has a slot, the touch and the rows
            found, rows, scanned = arena_find.find_and_touch(self, ids, per_id, step)
            if rows is not None:
                return rows, None if per_id.every_id else per_id.mine, [], None
        else:
            found, scanned = arena_find.find(self, ids, per_id)  # [V], -1 where absent
        if step is None:
            check_keys(ids)
            rows = torch.where(found >= 0, found - per_id.base, per_id.zero_row)
            return rows, None if per_id.every_id else per_id.mine, [], None
        mapped, missing, fresh, counted = None if per_id.every_id else per_id.mine, [], None, False
        overflow = False
        if scanned is not None:  # misses can only be among the scanned ids
            where, slots, hints = scanned
            tables = per_id.table.index_select(0, where)
            # the CPU loops list only ids without a slot (some table misses one); else [T + 1]
            # the ids without a row per table, a host read
            if self.lists_misses or any(
                torch.zeros_like(self.hits).index_add_(0, tables, (slots < 0).long()).tolist()
            ):
                hits = self._pin_hits(found, per_id)
                fresh = place_new(
                    self, ids.index_select(0, where), tables, slots, hits, self._caps_now(), step
                )
                # those still without a row (their tables take the insert path), what was
                # placed, evicted, overflowed: another read
                left = fresh.slots < 0
                if fresh.overflow is not None:
                    left &= ~fresh.overflow
                missed = torch.zeros_like(self.hits).index_add_(0, tables, left.long())
                counts = torch.cat([missed.unsqueeze(0), fresh.counts]).tolist()
                missing = [n for n, m in zip(self.names, counts[0], strict=False) if m]
                overflow = fresh.overflow is not None and any(map(any, counts[3:5]))
                self._count_inserts(fresh, *counts[1:])
                self.hits += hits * (missed == 0)  # the others count theirs on their path
                counted = True
                found.index_put_((where,), fresh.slots)
                if hints is not None:  # the keys placed now: hinted for the next lookups
                    arena_find.remember(self, hints, torch.where(slots < 0, fresh.slots, -1))
            if missing:  # the ids of tables with no miss left
                mapped = (missed == 0).index_select(0, per_id.table)
                if per_id.mine is not None:
                    mapped &= per_id.mine
        live = mapped
        if overflow:  # ids of keys without a row at their table's cap read its zero row
            live = found >= 0 if mapped is None else mapped & (found >= 0)
        # [V] each live id's slot, the scratch for the rest
        target = found if live is None else torch.where(live, found, self.scratch)
        touch = key_arena_cpu.touch if self._loops else arena_find.touch_tensor_ops
        hits = None if counted else self.hits
        touch(target, live, per_id.table, hits, self.last_seen, self.scores,
              self._per_table["lfu"], self.lfu_mode, self.scratch, step)  # fmt: skip
        rows = found - per_id.base
        if overflow:
            rows = torch.where(found >= 0, rows, per_id.zero_row)
        return rows, mapped, missing, fresh

    def _pin_hits(self, found: torch.Tensor, per_id: _Ids) -> torch.Tensor:
        """Before new keys are placed: mark the slot of every id of the batch that has one
        (pinned: never evicted by the batch's new keys; see :meth:`pinned`) and return each
        table's distinct keys among them [T + 1] (its hits). Each id writes a mark of its
        position into its slot, and the one whose mark stays counts the slot."""
        hit = found >= 0
        if not per_id.every_id:
            hit &= per_id.mine
        if self._pins is None:
            self._pins = torch.zeros_like(self.keys)
        self._mark = self._next_mark  # above every mark of earlier lookups
        self._next_mark += len(found)
        marks = per_id.position + self._mark
        target = torch.where(hit, found, self.scratch)
        self._pins.index_put_((target,), marks)
        won = (self._pins.index_select(0, target) == marks) & hit
        return torch.zeros_like(self.hits).index_add_(0, per_id.table, won.long())

    def pinned(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] bool: which of ``slots`` [N] hold a key of the batch being placed (marked by
        :meth:`_pin_hits` of this lookup)."""
        return self._pins.index_select(0, slots) >= self._mark

    def _caps_now(self) -> torch.Tensor | None:
        """([T + 1] the cap of each table at its cap whose new keys may evict here, -1 for the
        others; None when there are none): without admission, in an arena of one dim."""
        flags = tuple(
            (m.max_capacity if m.num_buckets == m.max_buckets and self._insertable(t) else -1)
            for t, m in ((t, t.map) for t in self.tables)
        )
        if max(flags) < 0:
            return None
        cap = self._caps.get(flags)
        if cap is None:
            cap = torch.tensor([*flags, -1], device=self.device)
            self._caps[flags] = cap
        return cap

    def _count_inserts(
        self,
        placed: Placed,
        inserts: list[int],
        evictions: list[int] | None = None,
        overflow: list[int] | None = None,
        rejected: list[int] | None = None,
        *counter: list[int],
    ) -> None:
        """Count what :func:`~recsys.embedding.dynamic.arena_placement.place_new` did in each
        table's stats (and its admission counter's); tables that record deletions (deltas) record
        their evicted keys."""
        zeros = [0] * len(inserts)
        evictions, overflow, rejected = evictions or zeros, overflow or zeros, rejected or zeros
        for t, table in enumerate(self.tables):
            if inserts[t] or overflow[t] or rejected[t]:
                table.map.count_placed(inserts[t], evictions[t], overflow[t], rejected[t])
            if counter and table.admission is not None:
                table.admission.count_arena(*(c[t] for c in counter))
            if evictions[t] and table.records_deletions:
                mine = placed.tables == t
                table.record_deleted(torch.where(mine, placed.evicted, EMPTY_KEY))
