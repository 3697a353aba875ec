"""Placing a batch's new keys into a key arena's maps (:mod:`recsys.embedding.dynamic.key_arena`),
for every table of the arena at once and without waiting on the host, by each map's own rule
(:meth:`~recsys.embedding.dynamic.slot_map.SlotMap.insert`,
:func:`~recsys.ops.slot_map.hash_map.assign_slots`).

Per bucket, the distinct new keys of a batch, by ascending key, take the bucket's candidate
slots in order: its free slots by ascending slot, then, only for a table at its cap, its
occupied slots that no key of the batch uses, by ascending (score, key), evicting their keys.
A table below its cap is placed here only if every new key gets a free slot and the table
stays within its load factor (else it grows: its own insert path does that). A table at its
cap is always placed here; a key past its bucket's candidates gets no row this step (an
``overflow``, which reads the zero row, as on the insert path). A reserved key, a table with
admission or an arena of several dims leaves the table to its own path.

Shape letters: U the ids the arena scanned (new keys among them), S bucket size, T tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recsys.ops.slot_map.hash_map import EMPTY_KEY, RESERVED_KEY, bucket_of

__all__ = ["Placed", "candidate_order", "place_new"]

# Run slot of the entries of a key that overflowed its bucket at the cap (no row this step).
_OVERFLOW = -2


@dataclass
class Placed:
    """What :func:`place_new` did with the U ids an arena scanned (shape [U], in their order)
    and, sorted by (table, key), their distinct keys that got a row in this call.

    Attributes:
        slots: [U] each scanned id's slot (-1: its key has none; its table inserts it, or it
            overflowed).
        fresh: [U] True for ids whose key got its slot in this call.
        overflow: [U] True for ids whose key gets no row this step (the zero row): it found no
            candidate slot at its table's cap, or its table's admission counter did not admit
            it (None: no such id, no table at its cap or with a counter).
        tables: [U] the arena table of each sorted entry.
        rows: [U] the row each sorted entry's key got, the table's zero row for entries that
            got none in this call (a repeat, a hit, or not placed): the caller gives the new
            rows their initial values and optimizer state, and the zero rows are reset after.
        keys: [U] the key of each sorted entry.
        evicted: [U] the key each sorted entry's slot held before (``EMPTY_KEY``: none; None
            without a table at its cap).
        counts: [1, T + 1] per table the keys placed; with a table at its cap [3, T + 1]: then
            the keys they evicted, the keys that overflowed; with admission counters
            [10, T + 1]: then the keys not admitted, and the counters'
            :meth:`~recsys.embedding.dynamic.arena_admission.Counting.commit` counts.
    """

    slots: torch.Tensor
    fresh: torch.Tensor
    overflow: torch.Tensor | None
    tables: torch.Tensor
    rows: torch.Tensor
    keys: torch.Tensor
    evicted: torch.Tensor | None
    counts: torch.Tensor


def candidate_order(
    rows: torch.Tensor, scores: torch.Tensor, pinned: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each bucket row's slots in candidate order [U, S] (free slots by
    position, then unpinned occupied ones by ascending (score, key), pinned ones last) and how
    many are candidates [U]: the order of :func:`~recsys.ops.slot_map.hash_map.assign_slots` (stable
    sorts by the least significant criterion first).

    Args:
        rows: [U, S] keys of each row (``EMPTY_KEY`` where free).
        scores: [U, S] their scores.
        pinned: [U, S] True where a key of the batch sits (never evicted).
    """
    free = rows == EMPTY_KEY
    candidate = free | ~pinned
    score = torch.where(free, 0, scores)
    klass = torch.where(free, 0, torch.where(candidate, 1, 2))
    order = torch.sort(rows, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(score.gather(1, order), dim=1, stable=True).indices)
    order = order.gather(1, torch.sort(klass.gather(1, order), dim=1, stable=True).indices)
    return order, candidate.sum(dim=1)


def place_new(
    arena,
    keys: torch.Tensor,
    tables: torch.Tensor,
    found: torch.Tensor,
    hits: torch.Tensor,
    caps: torch.Tensor | None,
    step: int,
) -> Placed:
    """Give the new keys among the ids an arena scanned their slots (see the module docstring),
    writing their keys (scores 0: the caller's update follows) into ``arena``'s buffers.

    Args:
        arena: the :class:`~recsys.embedding.dynamic.key_arena.KeyArena` (its ``pinned(slots)``: the
            slots holding a key of the batch).
        keys: [U] the scanned ids' keys.
        tables: [U] their arena tables.
        found: [U] their slots before this call, -1 where absent.
        hits: [T + 1] each table's distinct keys of the batch it holds.
        caps: [T + 1] the cap of each table at its cap whose new keys may evict, -1 for the
            others; None when there are none (only free slots are taken).
        step: the training step (the admission counters' last steps).
    """
    missing = found < 0
    size = arena.bucket_size
    # distinct (table, key) runs: sorted by key, then stably by table
    order = torch.sort(keys, stable=True).indices
    order = order.index_select(0, torch.sort(tables.index_select(0, order), stable=True)[1])
    key, table = keys.index_select(0, order), tables.index_select(0, order)
    starts = torch.ones_like(missing)
    starts[1:] = (key[1:] != key[:-1]) | (table[1:] != table[:-1])
    new = starts & missing.index_select(0, order)  # one entry per distinct new key
    run = torch.cumsum(starts, 0) - 1  # [U] the run (distinct key) of each entry
    per_table = arena.per_table
    zeros = torch.zeros_like(arena.hits)
    num_new = zeros.index_add(0, table, new.long())  # distinct new keys (admitted or not)
    # a reserved key leaves its table to its own path (which raises)
    reserved = new & (key <= RESERVED_KEY)
    counting = None
    if arena.admission is not None:  # the admission counters first: only admitted keys place
        count = zeros.new_zeros(len(key) + 1).index_add_(0, run, torch.ones_like(run))
        counting = arena.admission.count(key, table, new, count.index_select(0, run))
        rejected = new & ~counting.admitted
        new = new & counting.admitted
    bucket = per_table("first_bucket").index_select(0, table) + bucket_of(
        key, per_table("num_buckets").index_select(0, table)
    )
    # each new key's rank among its bucket's new keys (ascending key: a stable sort)
    by_bucket, bucket_order = torch.sort(torch.where(new, bucket, arena.scratch), stable=True)
    position = torch.arange(len(key), device=key.device)
    first = torch.ones_like(new)
    first[1:] = by_bucket[1:] != by_bucket[:-1]
    rank_sorted = position - torch.cummax(torch.where(first, position, 0), 0).values
    rank = torch.empty_like(rank_sorted).index_copy_(0, bucket_order, rank_sorted)
    # the rank-th candidate slot of the bucket [U, S]
    bucket = torch.where(new, bucket, 0)
    rows = arena.keys[: arena.scratch].view(-1, size).index_select(0, bucket)
    free = rows == EMPTY_KEY  # [U, S]
    if caps is None:
        take = free & (torch.cumsum(free, 1) - 1 == rank.unsqueeze(1))
        slot = bucket * size + take.to(torch.int8).argmax(1)
        short = reserved | (new & ~take.any(1))
        overflow = torch.zeros_like(new)
        room = per_table("room")
    else:
        # at the cap, a batch of more distinct keys than slots is the insert path's error
        evicts = (caps >= 0) & (hits + num_new <= caps)
        slots = bucket.unsqueeze(1) * size + torch.arange(size, device=key.device)  # [U, S]
        scores = arena.scores.index_select(0, slots.view(-1)).view_as(slots)
        pinned = arena.pinned(slots.view(-1)).view_as(slots)
        ranked, available = candidate_order(rows, scores, pinned)
        evicting = evicts.index_select(0, table)
        got = rank < torch.where(evicting, available, free.sum(1))
        slot = bucket * size + ranked.gather(1, rank.clamp(max=size - 1).unsqueeze(1)).squeeze(1)
        short = reserved | (new & ~got & ~evicting)
        overflow = new & ~got & evicting
        room = torch.where(evicts, torch.inf, per_table("room"))  # at the cap: no growth
    num_short = zeros.index_add(0, table, short.long())
    num_placing = num_new if counting is None else zeros.index_add(0, table, new.long())
    fits = (arena.sizes + num_placing).double() <= room
    placeable_table = (num_short == 0) & fits & per_table("insertable")
    if counting is not None:
        placeable_table &= counting.ok
    placeable = placeable_table.index_select(0, table)
    place = new & ~overflow & placeable  # [U]
    overflow &= placeable
    admission_counts = None
    if counting is not None:
        admission_counts = counting.commit(arena.admission, placeable, step)
        rejected &= placeable
    target = torch.where(place, slot, arena.scratch)
    evicted = None  # only free slots are taken below the caps
    if caps is not None:
        evicted = arena.keys.index_select(0, target)  # EMPTY_KEY where free (and the scratch)
    arena.keys.index_put_((target,), key)
    arena.keys[arena.scratch :].fill_(EMPTY_KEY)  # the scratch took the rest
    arena.scores.index_fill_(0, target, 0)  # LFU adds the batch's count after
    no_row = None  # entries of keys without a row this step
    if caps is None and counting is None:
        counts = (num_placing * placeable_table).unsqueeze(0)  # [1, T + 1]
        arena.sizes += counts[0]
    else:
        counts = [
            zeros.index_add(0, table, place.long()),
            zeros.index_add(0, table, (evicted != EMPTY_KEY).long())
            if evicted is not None
            else zeros,
            zeros.index_add(0, table, overflow.long()),
        ]
        no_row = overflow
        if counting is not None:
            counts.append(zeros.index_add(0, table, rejected.long()))
            no_row = overflow | rejected
        arena.sizes += counts[0] - counts[1]
        counts = torch.stack(counts)  # [3 or 4, T + 1]
        if admission_counts is not None:
            counts = torch.cat([counts, admission_counts])  # [10, T + 1]
    # each entry's slot: its run's new slot where placed (-2 where it has no row this step),
    # else what find said
    run_slot = torch.full((len(key) + 1,), -1, dtype=torch.int64, device=key.device)
    run_slot.index_put_((torch.where(place, run, len(key)),), slot)
    if no_row is not None:
        run_slot.index_fill_(0, torch.where(no_row, run, len(key)), _OVERFLOW)
    got = run_slot.index_select(0, run)
    slots_sorted = torch.where(got >= 0, got, found.index_select(0, order))
    base = per_table("base").index_select(0, table)
    zero_row = per_table("zero_row").index_select(0, table)
    return Placed(
        slots=torch.empty_like(found).index_copy_(0, order, slots_sorted),
        fresh=torch.empty_like(missing).index_copy_(0, order, got >= 0),
        overflow=None
        if no_row is None
        else torch.empty_like(missing).index_copy_(0, order, got == _OVERFLOW),
        tables=table,
        rows=torch.where(place, slot - base, zero_row),
        keys=key,
        evicted=evicted,
        counts=counts,
    )
