"""The id -> slot map of a dynamic embedding table and its score policies.

A :class:`SlotMap` keeps, for each of its ``capacity`` slots, the key held there (``EMPTY_KEY``
when free), the key's score and the step a training batch last looked it up. Rows of the table
(weights and optimizer state) live in the caller's buffers at the same slot; the map only says
which slot holds which key. The bucket rule and the kernels are :mod:`recsys.ops.slot_map.hash_map`.

Growth and eviction. A map starts at ``capacity`` slots and grows (doubling the buckets and
rehashing every live key) up to ``max_capacity``: whenever an insert would push it past
``load_factor`` of its slots, and whenever a new key finds its bucket full. Below the maximum
no key is ever evicted. At the maximum a new key evicts the unpinned entry of lowest (score,
key) of its bucket; the keys the same batch looks up are pinned. A rehash places each bucket's
keys in ascending key order; if the final rehash to the maximum puts more than ``bucket_size``
keys in one bucket, the lowest (pinned last, score, key) ones of that bucket are evicted.

Which keys a map holds depends only on the sequence of calls, never on slot positions, so a map
rebuilt with :meth:`SlotMap.restore` continues exactly as the original would (the slots may
differ; the keys, scores and evictions do not). Two runs are bitwise equal.

The admission counter, a map of counts without rows, is :mod:`recsys.embedding.dynamic.admission`.
"""

from __future__ import annotations

import math
import warnings

import torch

from recsys.embedding.dynamic.score_policy import LFU, LRU, ScorePolicy, score_policy
from recsys.embedding.dynamic.slot_layout import (
    Insertion,
    Layout,
    check_unique,
    compose_slot_maps,
    empty_layout,
    new_generation,
    rehash,
)
from recsys.ops.slot_map import EMPTY_KEY, assign_slots, check_keys, find_slots, keep_per_bucket

__all__ = ["LFU", "LRU", "Insertion", "ScorePolicy", "SlotMap", "score_policy"]


class SlotMap:
    """Bucketed, scored id -> slot map of one dynamic table (see the module docstring).

    Args:
        capacity: slots to start with (rounded up to whole buckets).
        max_capacity: the most slots it may grow to (rounded up to whole buckets).
        bucket_size: slots per bucket, 1..128 (need not be a power of two).
        policy: ``"lru"``, ``"lfu"`` or a :class:`ScorePolicy`.
        load_factor: grow once more than this share of the slots would be live, in (0, 1].
        device: where the map's tensors live.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for the map's ops.
        name: the table's name, for error messages.

    Raises:
        ValueError: an argument out of range.

    Example::

        slot_map = SlotMap(1024, 1 << 20, policy="lru", name="user_id")
        ids, counts = torch.unique(batch_ids, return_counts=True)
        insertion = slot_map.insert(ids, counts, step)
    """

    def __init__(
        self,
        capacity: int,
        max_capacity: int,
        *,
        bucket_size: int = 32,
        policy: str | ScorePolicy = "lru",
        load_factor: float = 0.75,
        device: torch.device | str | None = None,
        backend: str = "auto",
        name: str = "table",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"table {name!r}: capacity={capacity}; expected >= 1")
        if max_capacity < capacity:
            raise ValueError(
                f"table {name!r}: max_capacity={max_capacity}; expected >= capacity={capacity}"
            )
        if not 1 <= bucket_size <= 128:
            raise ValueError(f"table {name!r}: bucket_size={bucket_size}; expected 1..128")
        if not 0 < load_factor <= 1:
            raise ValueError(f"table {name!r}: load_factor={load_factor}; expected in (0, 1]")
        self.name = name
        self.bucket_size = bucket_size
        self.max_buckets = math.ceil(max_capacity / bucket_size)
        self.policy = score_policy(policy)
        self.load_factor = load_factor
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.backend = backend
        self.generation = 0
        """A new :func:`~recsys.embedding.dynamic.slot_layout.new_generation` whenever the map takes
        new tensors (grows, is restored): a caller holding views of them (a key arena) rebuilds."""
        self.pending_hits: torch.Tensor | None = None
        """A 0-d device counter of an arena's hits, added to ``hits`` when stats are read."""
        self._use(empty_layout(math.ceil(capacity / bucket_size), bucket_size, self.device))
        self._size = 0
        self._warned = False  # about keys without room at the maximum size
        self.dropped = torch.empty(0, dtype=torch.int64)
        """The keys the last :meth:`restore` left out to keep the cap."""
        self._stats = dict.fromkeys(
            (
                "hits",
                "misses",
                "inserts",
                "evictions",
                "expirations",
                "rejected",
                "overflow",
                "grows",
            ),
            0,
        )

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        """Slots now: ``num_buckets * bucket_size``."""
        return self.num_buckets * self.bucket_size

    @property
    def max_capacity(self) -> int:
        """The most slots the map grows to: ``max_buckets * bucket_size``."""
        return self.max_buckets * self.bucket_size

    @property
    def size(self) -> int:
        """Live keys."""
        return self._size

    def stats(self) -> dict[str, int | float]:
        """Counters since construction: size, capacity, load_factor (size / capacity), hits
        and misses (keys looked up by :meth:`insert`), inserts (new rows), evictions,
        expirations (TTL), rejected (misses not admitted), overflow (admitted misses that found
        no room: a full bucket at the maximum size) and grows (rehashes)."""
        self._take_pending_hits()
        return {
            "size": self._size,
            "capacity": self.capacity,
            "load_factor": self._size / self.capacity,
            **self._stats,
        }

    def reset_stats(self) -> None:
        """Zero the cumulative counters (size and capacity stay)."""
        self._take_pending_hits()
        self._stats = dict.fromkeys(self._stats, 0)

    def _take_pending_hits(self) -> None:
        if self.pending_hits is not None:
            self._stats["hits"] += int(self.pending_hits)
            self.pending_hits.zero_()

    def count_placed(
        self,
        count: int,
        evictions: int = 0,
        overflow: int = 0,
        rejected: int = 0,
        *,
        hits: int = 0,
        removed: int = 0,
        warn: bool = True,
    ) -> None:
        """Count ``count`` new keys an arena (:mod:`recsys.embedding.dynamic.key_arena`) wrote into
        slots of this map (misses and inserts, now live), the ``evictions`` they caused, the
        ``overflow`` new keys that found no slot at the maximum size and the ``rejected`` ones
        (misses, no row), ``hits`` (when the arena does not count them on the device) and the
        keys ``removed`` (an admission counter's admitted keys); ``warn`` about overflow the
        first time as :meth:`insert` does."""
        self._stats["hits"] += hits
        self._stats["misses"] += count + overflow + rejected
        self._stats["inserts"] += count
        self._stats["evictions"] += evictions
        self._stats["overflow"] += overflow
        self._stats["rejected"] += rejected
        self._size += count - evictions - removed
        if warn:
            self._warn_overflow()

    def adopt(self, keys: torch.Tensor, scores: torch.Tensor, last_seen: torch.Tensor) -> None:
        """Hold the map's keys, scores and last steps in ``keys`` / ``scores`` / ``last_seen``
        (views of an arena's buffers, already holding the same values) from now on."""
        if not keys.shape == scores.shape == last_seen.shape == self.keys.shape:
            raise ValueError(
                f"table {self.name!r}: adopt tensors of shapes {tuple(keys.shape)}, "
                f"{tuple(scores.shape)}, {tuple(last_seen.shape)}; expected "
                f"{tuple(self.keys.shape)}"
            )
        self.keys, self.scores, self.last_seen = keys, scores, last_seen

    # ------------------------------------------------------------------ lookups

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, -1 where absent. Read-only; any N, duplicates allowed.

        Args:
            keys: [N] int64.

        Returns:
            [N] int64 slots.

        Raises:
            ValueError: a reserved key.
        """
        keys = keys.to(self.device)
        return find_slots(self.keys, self.num_buckets, self.bucket_size, keys, self.backend)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [L] ascending, their slots [L]) of every live key."""
        live = (self.keys != EMPTY_KEY).nonzero().squeeze(1)
        keys, order = torch.sort(self.keys[live])
        return keys, live[order]

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        step: int,
        admit: torch.Tensor | None = None,
    ) -> Insertion:
        """Look up a batch's distinct keys, give rows to the admitted new ones (growing or
        evicting as needed) and update every looked-up entry's score and last step.

        Args:
            keys: [U] int64 distinct keys (any order).
            counts: [U] occurrences of each key in the batch (for the score policy).
            step: the training step.
            admit: [U] bool, False for new keys that must not get a row (default: all True).

        Returns:
            :class:`Insertion`.

        At the maximum size, new keys whose bucket has fewer free or unpinned slots than new
        keys (its other slots hold keys of this batch) get no row this call (slot -1, like a
        key not admitted): counted as ``overflow``, with a warning the first time.

        Raises:
            ValueError: a reserved or repeated key, or more keys than ``max_capacity``. Nothing
                is modified when it raises.
        """
        if len(keys) > self.max_capacity:
            raise ValueError(
                f"table {self.name!r}: this batch has {len(keys)} distinct keys but the table "
                f"holds at most {self.max_capacity} rows; raise max_capacity"
            )
        keys = keys.to(self.device)
        found = self.find(keys)
        if len(keys) and not bool((found < 0).any()):
            return self._all_hits(keys, found, counts, step)
        insertion = self._insert(keys, counts, step, admit, skip_overflow=True, found=found)
        self._warn_overflow()
        return insertion

    def _warn_overflow(self) -> None:
        """Warn, once, when new keys have found no room at the maximum size."""
        overflow = self._stats["overflow"]
        if overflow and not self._warned:
            self._warned = True
            warnings.warn(
                f"table {self.name!r} is at its maximum ({self.max_capacity} rows) and "
                f"{overflow} new key(s) found their bucket full of keys the same batch uses: "
                "they pool as zeros and are not trained this step (counted as 'overflow'); "
                "raise max_capacity or bucket_size",
                stacklevel=3,
            )

    def insert_if_room(self, keys: torch.Tensor, counts: torch.Tensor, step: int) -> Insertion:
        """:meth:`insert` for a caller that accounts for the keys without room itself (the
        admission counter): any number of keys, every new one admitted; at the maximum size new
        keys whose bucket has no free or unpinned slot left get slot -1 (counted as
        ``overflow``), without a warning.

        Raises:
            ValueError: a reserved or repeated key.
        """
        return self._insert(keys, counts, step, None, skip_overflow=True)

    def _all_hits(
        self, keys: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, step: int
    ) -> Insertion:
        """The common case, every key already at ``slots``: only their scores and last steps
        change (no growth or assignment)."""
        check_unique(torch.sort(keys).values, self.name)
        counts = counts.to(self.device, torch.int64)
        not_new = torch.zeros_like(keys, dtype=torch.bool)
        self.scores[slots] = self.policy.update(self.scores[slots], not_new, counts, step).to(
            torch.int64
        )
        self.last_seen[slots] = step
        self._stats["hits"] += len(keys)
        return Insertion(slots, not_new, None, keys[:0])

    def _insert(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        step: int,
        admit: torch.Tensor | None,
        skip_overflow: bool,
        found: torch.Tensor | None = None,
    ) -> Insertion:
        """:meth:`insert`; with ``skip_overflow`` the new keys past a full bucket's candidates
        get no row (counted as overflow) instead of raising. ``found``: the keys' slots when
        the caller has looked them up already."""
        keys = keys.to(self.device)  # checked by find (a reserved key raises)
        sorted_keys, order = torch.sort(keys)
        check_unique(sorted_keys, self.name)
        counts = counts.to(self.device, torch.int64)[order]
        admit = torch.ones_like(keys, dtype=torch.bool) if admit is None else admit
        admit = admit.to(self.device, torch.bool)[order]
        found = self.find(sorted_keys) if found is None else found[order]
        hit = found >= 0
        is_new = ~hit & admit
        layout, to_new, new_slots, evicted = self._plan(
            found[hit], sorted_keys[is_new], skip_overflow
        )
        slots = torch.full_like(found, -1)
        slots[hit] = found[hit] if to_new is None else to_new[found[hit]]
        slots[is_new] = new_slots
        grew = layout.num_buckets != self.num_buckets
        self._commit(layout, sorted_keys, slots, is_new, counts, step)
        self._count(hit, admit, new_slots, evicted, grew)
        return self._result(order, slots, is_new, to_new, evicted)

    def _plan(
        self, hit_slots: torch.Tensor, new_keys: torch.Tensor, skip_overflow: bool
    ) -> tuple[Layout, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Grow as needed and assign slots to ``new_keys``, on new tensors where it grows.

        Returns:
            (layout after growth, old -> new slot map or None, slots of the new keys, keys
            evicted by the rehash and the assignment).
        """
        layout = Layout(self.num_buckets, self.keys, self.scores, self.last_seen)
        to_new, dropped = None, []
        target = self._buckets_for(self._size + len(new_keys))
        while True:
            if target > layout.num_buckets:
                layout, slot_map, gone = self._rehash(layout, hit_slots, target)
                hit_slots = slot_map[hit_slots]
                to_new, dropped = compose_slot_maps(to_new, slot_map), [*dropped, gone]
            pinned = torch.zeros_like(layout.keys, dtype=torch.bool)
            pinned[hit_slots] = True
            slots, evicted, overflow = self._assign(layout, pinned, new_keys)
            grow = len(overflow) > 0 or bool((evicted != EMPTY_KEY).any())
            if grow and layout.num_buckets < self.max_buckets:
                target = min(self.max_buckets, 2 * layout.num_buckets)
                continue
            break
        if len(overflow) and not skip_overflow:
            self._raise_overflow(overflow, layout.num_buckets)
        return layout, to_new, slots, torch.cat([*dropped, evicted[evicted != EMPTY_KEY]])

    def _assign(
        self, layout: Layout, pinned: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return assign_slots(
            layout.keys,
            layout.scores,
            pinned,
            layout.num_buckets,
            self.bucket_size,
            keys,
            self.backend,
        )

    def _buckets_for(self, live: int) -> int:
        """Buckets for ``live`` keys under the load factor: doubled until they fit, at most
        ``max_buckets`` (the current count if they already fit)."""
        buckets = self.num_buckets
        while live > self.load_factor * buckets * self.bucket_size and buckets < self.max_buckets:
            buckets = min(self.max_buckets, 2 * buckets)
        return buckets

    def _rehash(
        self, layout: Layout, hit_slots: torch.Tensor, num_buckets: int
    ) -> tuple[Layout, torch.Tensor, torch.Tensor]:
        """:func:`rehash` into ``num_buckets`` (trimming buckets only for the last growth, to
        ``max_buckets``); pinned keys that do not fit raise."""
        trim = num_buckets == self.max_buckets
        new, slot_map, dropped, overflow = rehash(
            layout, hit_slots, num_buckets, self.bucket_size, trim, self.backend
        )
        if len(overflow):  # only pinned keys left, see rehash
            self._raise_overflow(overflow, num_buckets)
        return new, slot_map, dropped

    def _raise_overflow(self, overflow: torch.Tensor, num_buckets: int) -> None:
        bucket, needed, available = overflow[0].tolist()
        raise ValueError(
            f"table {self.name!r}: bucket {bucket} of {num_buckets} (the maximum, "
            f"{self.max_capacity} slots) has {available} slots available (free or held by keys "
            f"this batch does not use) but {needed} new keys need one, and "
            f"{len(overflow)} bucket(s) overflow in all; raise max_capacity or bucket_size"
        )

    def _commit(
        self,
        layout: Layout,
        keys: torch.Tensor,
        slots: torch.Tensor,
        is_new: torch.Tensor,
        counts: torch.Tensor,
        step: int,
    ) -> None:
        """Adopt ``layout`` and write the looked-up keys (sorted) that got a slot."""
        self._use(layout)
        placed = slots >= 0
        rows, new = slots[placed], is_new[placed]
        self.keys[rows] = keys[placed]
        old = torch.where(new, torch.zeros_like(rows), self.scores[rows])
        self.scores[rows] = self.policy.update(old, new, counts[placed], step).to(torch.int64)
        self.last_seen[rows] = step

    def _count(
        self,
        hit: torch.Tensor,
        admit: torch.Tensor,
        new_slots: torch.Tensor,
        evicted: torch.Tensor,
        grew: bool,
    ) -> None:
        hits, inserts = int(hit.sum()), int((new_slots >= 0).sum())
        self._stats["hits"] += hits
        self._stats["misses"] += len(hit) - hits
        rejected = int((~hit & ~admit).sum())
        self._stats["rejected"] += rejected
        self._stats["overflow"] += len(hit) - hits - rejected - inserts
        self._stats["inserts"] += inserts
        self._stats["evictions"] += len(evicted)
        self._stats["grows"] += int(grew)
        self._size += inserts - len(evicted)

    def _result(
        self,
        order: torch.Tensor,
        slots: torch.Tensor,
        is_new: torch.Tensor,
        to_new: torch.Tensor | None,
        evicted: torch.Tensor,
    ) -> Insertion:
        """The Insertion in the caller's key order."""
        out_slots = torch.empty_like(slots).index_copy_(0, order, slots)
        inserted = torch.empty_like(is_new).index_copy_(0, order, is_new & (slots >= 0))
        moved = None
        if to_new is not None:
            old = (to_new >= 0).nonzero().squeeze(1)
            moved = (old, to_new[old])
        return Insertion(out_slots, inserted, moved, evicted)

    def _use(self, layout: Layout) -> None:
        if layout.keys is not getattr(self, "keys", None):
            self.generation = new_generation()
        self.num_buckets = layout.num_buckets
        self.keys, self.scores, self.last_seen = layout.keys, layout.scores, layout.last_seen

    # ------------------------------------------------------------------ removal

    def _free(self, slots: torch.Tensor) -> None:
        """Empty distinct live ``slots``."""
        self.keys[slots] = EMPTY_KEY
        self.scores[slots] = 0
        self.last_seen[slots] = 0
        self._size -= len(slots)

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Drop ``keys`` from the map.

        Args:
            keys: [K] int64 (absent keys and duplicates allowed).

        Returns:
            [K] int64 slots freed (-1 for absent keys).
        """
        slots = self.find(keys)
        self._free(torch.unique(slots[slots >= 0]))
        return slots

    def expire(self, step: int, ttl: int) -> torch.Tensor:
        """Drop every key with ``step - last_seen > ttl`` (counted as expirations).

        Returns:
            [E] int64 slots freed, ascending.
        """
        return self.expire_keys(step, ttl)[0]

    def expire_keys(self, step: int, ttl: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`expire`, returning (the slots freed, the keys they held)."""
        stale = (self.keys != EMPTY_KEY) & (step - self.last_seen > ttl)
        slots = stale.nonzero().squeeze(1)
        keys = self.keys[slots]
        self._free(slots)
        self._stats["expirations"] += len(slots)
        return slots, keys

    def restore(
        self,
        num_buckets: int,
        keys: torch.Tensor,
        scores: torch.Tensor,
        last_seen: torch.Tensor,
        *,
        grow: bool = False,
        past_cap: bool = False,
    ) -> torch.Tensor:
        """Clear the map, give it ``num_buckets`` buckets and put ``keys`` back with their
        scores and last steps (each bucket's keys in ascending key order).

        Args:
            num_buckets: 1..max_buckets.
            keys: [L] distinct int64 keys.
            scores: [L] int64.
            last_seen: [L] int64.
            grow: double ``num_buckets`` while a bucket would get more keys than it has
                slots (keys saved by maps of other sizes, or by several maps), up to
                ``max_buckets``. There, a bucket keeps its ``bucket_size`` highest-scored keys
                (ties: the highest keys), as inserts at the cap evict: the cap is never
                exceeded. The keys left out get slot -1 and are :attr:`dropped`.
            past_cap: with ``grow``, keep every key instead: double past ``max_buckets``
                while a bucket would overflow, and make that the cap (a model loaded to score,
                as the run that saved it did).

        Returns:
            [L] int64 slot of each key, in the order given (-1: dropped, with ``grow``).

        Raises:
            ValueError: num_buckets out of range, a reserved or repeated key, or (without
                ``grow``) a bucket with more than ``bucket_size`` keys (the map is then left
                unchanged).
        """
        if not 1 <= num_buckets <= self.max_buckets:
            raise ValueError(
                f"table {self.name!r}: restore to num_buckets={num_buckets}; expected "
                f"1..{self.max_buckets} (max_capacity {self.max_capacity})"
            )
        keys = keys.to(self.device)
        check_keys(keys)
        check_unique(torch.sort(keys).values, self.name)
        scores = scores.to(self.device, torch.int64)
        keep = torch.ones_like(keys, dtype=torch.bool)
        while True:
            layout = empty_layout(num_buckets, self.bucket_size, self.device)
            no_pins = torch.zeros_like(layout.keys, dtype=torch.bool)
            slots, _, overflow = self._assign(layout, no_pins, keys[keep])
            if not (grow and len(overflow)):
                break
            if num_buckets < self.max_buckets:
                num_buckets = min(2 * num_buckets, self.max_buckets)
            elif past_cap:
                num_buckets *= 2
            else:  # at the cap: drop what the cap cannot hold
                pins = torch.zeros_like(keys, dtype=torch.bool)
                keep = keep_per_bucket(keys, scores, pins, num_buckets, self.bucket_size)
        if len(overflow):
            bucket, needed, available = overflow[0].tolist()
            raise ValueError(
                f"table {self.name!r}: restore puts {needed} keys in bucket {bucket} of "
                f"{num_buckets}, which has {available} slots; restore to more buckets"
            )
        self.max_buckets = max(self.max_buckets, num_buckets)  # past the cap: past_cap only
        self.dropped = keys[~keep]
        kept, keys = slots, keys[keep]
        slots = torch.full(keep.shape, -1, dtype=torch.int64, device=self.device)
        slots[keep] = kept
        scores, last_seen = scores[keep], last_seen.to(self.device)[keep]
        layout.keys[kept] = keys
        layout.scores[kept] = scores
        layout.last_seen[kept] = last_seen.to(torch.int64)
        self._use(layout)
        self._size = len(keys)
        return slots
