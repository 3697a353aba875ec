"""Finding a batch's ids in a key arena's maps (:mod:`recsys.embedding.dynamic.key_arena`) and
updating the slots they use: the compiled CPU loops (:mod:`recsys.ops.slot_map.key_arena_cpu`) bound
to the arena's buffers, the same as tensor ops where they cannot load, and one Triton scan of every
id's bucket on CUDA.

On CPU and with tensor ops each table has a region of hints: a key's hash names one entry,
which names a slot; the hint is valid when that slot holds the key. Ids without a valid hint
scan their bucket, and the keys they find are hinted for the next lookups. The functions take
the :class:`~recsys.embedding.dynamic.key_arena.KeyArena` (``arena``) and a batch's per-id columns
(``per_id``, as its lookup builds them).
"""

from __future__ import annotations

import torch

from recsys.ops.slot_map import key_arena_cpu
from recsys.ops.slot_map.arena_scan import find_arena_slots
from recsys.ops.slot_map.hash_map import EMPTY_KEY, find_slots_torch

__all__ = ["find", "find_and_touch", "hint_sizes", "remember", "touch_tensor_ops"]

# Hint entries per slot of a table (more: fewer keys sharing an entry, more memory and cache
# traffic), and the most hint entries of an arena (2**23: 64 MiB): past that, the largest
# tables get fewer per slot, and hints serve their hot keys. A key's hint is the one entry its
# hash names (sets of several entries cost more gathers per id than the scans they save). The
# CPU loops scan a failed hint's bucket at once, for less than the cache misses of a larger
# hint buffer: 2 per slot there (measured on the DLRM step, batch 256 and 2048).
HINTS_PER_SLOT = 4
HINTS_PER_SLOT_LOOPS = 2
MAX_HINTS = 1 << 23
# Fibonacci hashing: bits 32.. of key * 2**64 / golden ratio pick a hint entry.
_FIBONACCI = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as int64


def hint_sizes(capacities: list[int], per_slot: int = HINTS_PER_SLOT) -> list[int]:
    """Hint entries of each table: a power of two near ``per_slot`` per slot (at least 64),
    the largest halved while they sum past ``MAX_HINTS``."""
    sizes = [max(64, 1 << (per_slot * c - 1).bit_length()) for c in capacities]
    while sum(sizes) > MAX_HINTS and max(sizes) > 64:
        largest = sizes.index(max(sizes))
        sizes[largest] //= 2
    return sizes


def find_and_touch(
    arena, ids: torch.Tensor, per_id, step: int
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """The CPU loops' lookup of a training step: ``(found, rows, scanned)`` as
    :func:`find` gives ``found`` and ``scanned``; where every id has a slot (``scanned``
    None), the slots are touched as :meth:`KeyArena.lookup` does and ``rows`` are each id's row
    (``found`` is then None)."""
    if arena.bound_loops is None:
        arena.bound_loops = key_arena_cpu.ArenaLoops(
            arena.hints_buffer,
            arena.keys,
            arena.last_seen,
            arena.scores,
            arena.hits,
            arena.per_table("lfu"),
            arena.lfu_mode,
            arena.bucket_size,
            EMPTY_KEY,
            arena.scratch,
        )
    if per_id.loop_columns is None:
        per_id.loop_columns = arena.bound_loops.columns(
            per_id.hint_mask,
            per_id.hint_base,
            per_id.num_buckets,
            per_id.first_bucket,
            None if per_id.every_id else per_id.mine,
            per_id.table,
            per_id.base,
        )
    slot, rows, where, hints = arena.bound_loops.lookup(ids.contiguous(), per_id.loop_columns, step)
    if rows is not None:
        return None, rows, None
    return slot, None, (where, slot.index_select(0, where), hints)


def find(
    arena, ids: torch.Tensor, per_id
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]:
    """Each id's slot in the arena, -1 where its table does not hold it, and the ids whose
    bucket was scanned (positions [U], their slots [U] and hint entries [U] (None: no hints);
    None when every id of the arena had a valid hint). Triton: one scan of every id's
    bucket. Torch: the hints, then a scan of the ids without a valid one, listed by a host
    read; the keys it finds are hinted."""
    if arena.hints_buffer is None:
        found = find_arena_slots(
            arena.keys[: arena.scratch],
            arena.bucket_size,
            per_id.num_buckets,
            per_id.first_bucket,
            ids,
            arena.backend,
        )
        if not per_id.every_id:  # ids of no table of the arena: at the scratch, no miss
            found = torch.where(per_id.mine, found, arena.scratch)
        return found, (per_id.position, found, None)
    if arena.lists_misses:  # one pass: hints, then scans, hints written
        slot, where, hints = key_arena_cpu.find(
            ids.contiguous(),
            per_id.hint_mask,
            per_id.hint_base,
            per_id.num_buckets,
            per_id.first_bucket,
            None if per_id.every_id else per_id.mine,
            arena.hints_buffer,
            arena.keys,
            arena.bucket_size,
            EMPTY_KEY,
        )
        if not len(where):
            return slot, None
        return slot, (where, slot.index_select(0, where), hints)
    # [V] the hint of the id's own table, the slot it names (the scratch where none)
    hint_at = (((ids * _FIBONACCI) >> 32) & per_id.hint_mask) + per_id.hint_base
    slot = arena.hints_buffer.index_select(0, hint_at)
    # (a free slot holds EMPTY_KEY: an id of that reserved value must scan, find nothing
    # and reach the insert path's error)
    unsure = (arena.keys.index_select(0, slot) != ids) | (ids == EMPTY_KEY)
    if not per_id.every_id:
        unsure &= per_id.mine
    # the first host read of a step (its only one when every id has a valid hint)
    where = unsure.nonzero().squeeze(1)  # [U]
    if not len(where):
        return slot, None
    return _scan(arena, ids, per_id, slot, where, hint_at.index_select(0, where))


def _scan(
    arena,
    ids: torch.Tensor,
    per_id,
    slot: torch.Tensor,
    where: torch.Tensor,
    hints: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ids at ``where`` [U] (without a valid hint, entries ``hints`` [U]) scan their
    bucket; the keys found are hinted; ``slot`` [V] takes their slots (-1: absent)."""
    slots = find_slots_torch(
        arena.keys[: arena.scratch],
        per_id.num_buckets.index_select(0, where),
        arena.bucket_size,
        ids.index_select(0, where),
        per_id.first_bucket.index_select(0, where),
    )  # [U]
    remember(arena, hints, slots)
    return slot.index_put_((where,), slots), (where, slots, hints)


def remember(arena, hints: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the found ``slots`` [U] into their ``hints`` entries [U] (-1: absent, the
    entry kept)."""
    kept = arena.hints_buffer.index_select(0, hints)
    arena.hints_buffer.index_put_((hints,), torch.where(slots >= 0, slots, kept))


def touch_tensor_ops(target, live, table, hits, last_seen, scores, lfu, lfu_mode, scratch, step):
    """:func:`recsys.ops.slot_map.key_arena_cpu.touch` as tensor ops: each table's distinct live
    slots of ``target`` [V] added to ``hits`` (unless None: each id writes its position into
    its slot's last step, and the one whose position stays counts the slot), then the last
    steps and scores."""
    one = scores.new_ones(())
    if hits is not None:
        positions = torch.arange(len(target), device=target.device)
        last_seen.index_put_((target,), positions)
        won = last_seen.index_select(0, target) == positions
        hits.index_add_(0, table, (won if live is None else won & live).long())
    last_seen.index_fill_(0, target, step)
    if lfu_mode == 0:
        scores.index_fill_(0, target, step)
    elif lfu_mode == 1:
        scores.index_put_((target,), one, accumulate=True)
    else:
        lfu = lfu.index_select(0, table)
        scores.index_put_((torch.where(lfu, target, scratch),), one, accumulate=True)
        scores.index_fill_(0, torch.where(lfu, scratch, target), step)
