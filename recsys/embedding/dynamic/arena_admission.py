"""The admission counters of a key arena's tables (:mod:`recsys.embedding.dynamic.key_arena`) in one
buffer, and the counting of a batch's new keys for all of them at once, without waiting on
the host, bitwise as :meth:`~recsys.embedding.dynamic.admission.AdmissionCounter.admit` counts them.

Each counter's :class:`~recsys.embedding.dynamic.slot_map.SlotMap` (scored LFU, no rows) works on
views of its range of the buffer, as the arena's maps do, so its own path (growth, checkpoints) is
unchanged. For the distinct new keys of a batch (keys of a table's map that it does not hold),
per table with a counter:

- a key's count so far (0 if not counted) plus its occurrences in the batch reaches the
  threshold: admitted, and forgotten by the counter (its slot freed);
- else it stays counted: a counted key adds its occurrences (and is pinned), a key not counted
  yet takes a slot of its bucket by the map's rule (free slots, the ones just freed included, by
  slot; at the counter's cap the unpinned keys by ascending (count, key), which it evicts;
  past them it stays uncounted).

A counter that would grow (below its cap, a key finds no free slot or the counter passes its
load factor) leaves its table to its own path: the decision is made on the device before
anything is written (:meth:`AdmissionArena.count` returns it), and the writes follow only for
the tables the arena places (:meth:`Counting.commit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsys.embedding.dynamic.arena_placement import candidate_order
from recsys.ops.slot_map.hash_map import EMPTY_KEY, bucket_of, find_slots_torch

__all__ = ["AdmissionArena", "Counting"]


@dataclass
class Counting:
    """What :meth:`AdmissionArena.count` decided for the sorted entries [U] of a batch.

    Attributes:
        admitted: [U] True for new keys admitted now (and for every entry of a table without
            a counter).
        ok: [T + 1] False for tables whose counter would grow (their own path counts them).
    """

    admitted: torch.Tensor
    ok: torch.Tensor
    _writes: tuple

    def commit(self, arena: AdmissionArena, placed: torch.Tensor, step: int) -> torch.Tensor:
        """Write the counting of the entries of tables ``placed`` ([U] bool per entry) and
        return per table [6, T + 1]: keys admitted, counted keys seen again, keys newly
        counted, keys they evicted, keys left uncounted, keys forgotten (admitted)."""
        (table, key, count, slot, admitted, removed, hit, new, got, overflow, target) = self._writes
        removed, hit, overflow = removed & placed, hit & placed, overflow & placed
        scratch = arena.scratch
        freed = torch.where(removed, slot, scratch)
        arena.keys.index_fill_(0, freed, EMPTY_KEY)
        arena.scores.index_fill_(0, freed, 0)
        arena.last_seen.index_fill_(0, freed, 0)
        seen = torch.where(hit, slot, scratch)
        arena.scores.index_put_((seen,), count, accumulate=True)
        arena.last_seen.index_fill_(0, seen, step)
        place = new & got & placed
        target = torch.where(place, target, scratch)
        evicted = arena.keys.index_select(0, target) != EMPTY_KEY
        arena.keys.index_put_((target,), key)
        arena.scores.index_put_((target,), count)
        arena.last_seen.index_fill_(0, target, step)
        arena.keys[scratch:].fill_(EMPTY_KEY)
        zeros = torch.zeros_like(arena.sizes)
        counts = torch.stack(
            [
                zeros.index_add(0, table, (admitted & placed).long()),
                zeros.index_add(0, table, hit.long()),
                zeros.index_add(0, table, place.long()),
                zeros.index_add(0, table, (evicted & place).long()),
                zeros.index_add(0, table, overflow.long()),
                zeros.index_add(0, table, removed.long()),
            ]
        )
        arena.sizes += counts[2] - counts[3] - counts[5]
        return counts


class AdmissionArena:
    """The admission counters of ``tables`` (a key arena's tables, one bucket size and device;
    tables without admission take no slot) in one buffer.

    Args:
        tables: the key arena's :class:`~recsys.embedding.dynamic.table.DynamicTable` s.
    """

    def __init__(self, tables) -> None:
        self.tables = tables
        self.counters = [table.admission for table in tables]
        self.bucket_size = tables[0].map.bucket_size
        self.device = tables[0].map.device
        self._generations = None
        self._caps: dict[tuple[int, ...], torch.Tensor] = {}
        self._mark = 1

    @property
    def active(self) -> bool:
        """Whether any table has an admission counter."""
        return any(c is not None for c in self.counters)

    def current(self) -> None:
        """Rebuild if a counter took new tensors (it grew, or was restored), else copy the
        counters' sizes to the device when ``sizes`` changed on the host."""
        generations = tuple(c.map.generation if c else -1 for c in self.counters)
        if generations != self._generations:
            self._rebuild(generations)

    def refresh(self) -> None:
        """After some tables counted on their own path."""
        self.current()
        self.sizes = self._sizes_now()

    def _sizes_now(self) -> torch.Tensor:
        return torch.tensor(
            [*(c.map.size if c else 0 for c in self.counters), 0], device=self.device
        )

    def _rebuild(self, generations) -> None:
        maps = [c.map if c else None for c in self.counters]
        capacities = [m.capacity if m else 0 for m in maps]
        total = sum(capacities)
        buffers = {}
        for name, fill in (("keys", EMPTY_KEY), ("scores", 0), ("last_seen", 0)):
            buffer = torch.full((total + 1,), fill, dtype=torch.int64, device=self.device)
            torch.cat([getattr(m, name) for m in maps if m], out=buffer[:total])
            buffers[name] = buffer
        self.keys, self.scores, self.last_seen = (
            buffers["keys"],
            buffers["scores"],
            buffers["last_seen"],
        )
        self.scratch = total
        bases, base = [], 0
        for m, capacity in zip(maps, capacities, strict=True):
            if m:
                span = slice(base, base + capacity)
                m.adopt(self.keys[span], self.scores[span], self.last_seen[span])
            bases.append(base)
            base += capacity
        per_table = {
            "has": [*(m is not None for m in maps), False],
            "num_buckets": [*(m.num_buckets if m else 1 for m in maps), 1],
            # (tables without a counter: bucket 0, their entries masked)
            "first_bucket": [
                *(b // self.bucket_size if m else 0 for b, m in zip(bases, maps, strict=True)),
                0,
            ],
            "threshold": [*(c.threshold if c else 0 for c in self.counters), 0],
        }
        self._per_table = {n: torch.tensor(v, device=self.device) for n, v in per_table.items()}
        self._per_table["room"] = torch.tensor(
            [*(m.load_factor * m.capacity if m else 0.0 for m in maps), 0.0],
            dtype=torch.float64,
            device=self.device,
        )
        self._pins = torch.zeros_like(self.keys)
        self.sizes = self._sizes_now()
        self._generations = generations

    def _caps_now(self) -> torch.Tensor:
        """[T + 1] each counter's cap when it is at it, -1 for the others."""
        flags = tuple(
            c.map.max_capacity if c and c.map.num_buckets == c.map.max_buckets else -1
            for c in self.counters
        )
        cap = self._caps.get(flags)
        if cap is None:
            cap = torch.tensor([*flags, -1], device=self.device)
            self._caps[flags] = cap
        return cap

    def count(
        self, key: torch.Tensor, table: torch.Tensor, new: torch.Tensor, count: torch.Tensor
    ) -> Counting:
        """Decide the counting of a batch's distinct new keys (see the module docstring);
        nothing is written until :meth:`Counting.commit`.

        Args:
            key: [U] entries sorted by (table, key).
            table: [U] their arena tables.
            new: [U] True for one entry of each distinct key the table's map does not hold.
            count: [U] the occurrences of each entry's key in the batch.
        """
        size = self.bucket_size
        per_table = self._per_table
        has = new & per_table["has"].index_select(0, table)
        first = per_table["first_bucket"].index_select(0, table)
        slot = find_slots_torch(
            self.keys[: self.scratch],
            per_table["num_buckets"].index_select(0, table),
            size,
            key,
            first,
        )
        slot = torch.where(has, slot, -1)
        counted = slot >= 0
        held = self.scores.index_select(0, torch.where(counted, slot, self.scratch))
        seen = torch.where(counted, held, 0) + count
        admitted = has & (seen >= per_table["threshold"].index_select(0, table))
        removed = admitted & counted
        hit = has & ~admitted & counted
        fresh = has & ~admitted & ~counted  # to be counted
        # marks: the slots freed (removed) and pinned (seen again) by this batch
        mark, self._mark = self._mark, self._mark + 2
        self._pins.index_fill_(0, torch.where(removed, slot, self.scratch), mark)
        self._pins.index_fill_(0, torch.where(hit, slot, self.scratch), mark + 1)
        # each fresh key's rank among its bucket's fresh keys (entries by ascending key)
        bucket = torch.where(
            fresh, first + bucket_of(key, per_table["num_buckets"].index_select(0, table)), 0
        )
        by_bucket, order = torch.sort(torch.where(fresh, bucket, self.scratch), stable=True)
        position = torch.arange(len(key), device=key.device)
        starts = torch.ones_like(fresh)
        starts[1:] = by_bucket[1:] != by_bucket[:-1]
        rank_sorted = position - torch.cummax(torch.where(starts, position, 0), 0).values
        rank = torch.empty_like(rank_sorted).index_copy_(0, order, rank_sorted)
        slots = bucket.unsqueeze(1) * size + torch.arange(size, device=key.device)  # [U, S]
        rows = self.keys.index_select(0, slots.view(-1)).view_as(slots)
        pins = self._pins.index_select(0, slots.view(-1)).view_as(slots)
        free = (rows == EMPTY_KEY) | (pins == mark)
        rows = torch.where(free, EMPTY_KEY, rows)
        scores = self.scores.index_select(0, slots.view(-1)).view_as(slots)
        ranked, available = candidate_order(rows, scores, pins == mark + 1)
        evicting = self._caps_now() >= 0
        at_cap = evicting.index_select(0, table)
        got = rank < torch.where(at_cap, available, free.sum(1))
        target = bucket * size + ranked.gather(1, rank.clamp(max=size - 1).unsqueeze(1)).squeeze(1)
        zeros = torch.zeros_like(self.sizes)
        short = zeros.index_add(0, table, (fresh & ~got & ~at_cap).long())
        grown = self.sizes - zeros.index_add(0, table, removed.long())
        grown += zeros.index_add(0, table, fresh.long())
        room = torch.where(evicting, torch.inf, per_table["room"])
        ok = (short == 0) & (grown.double() <= room)
        writes = (table, key, count, slot, admitted, removed, hit, fresh, got, fresh & ~got, target)
        admitted = admitted | ~per_table["has"].index_select(0, table)
        return Counting(admitted=admitted, ok=ok, _writes=writes)
