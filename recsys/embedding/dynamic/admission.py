"""The admission counter of a dynamic table: how often keys without a row were seen, so a key
gets a row only once it has been seen ``threshold`` times (rare ids never take a slot).

The counts live in a :class:`~recsys.embedding.dynamic.slot_map.SlotMap` without rows, scored LFU,
so the counter is bounded and restores from a checkpoint like the table's own map.
"""

from __future__ import annotations

import torch

from recsys.embedding.dynamic.score_policy import LFU
from recsys.embedding.dynamic.slot_map import SlotMap

__all__ = ["AdmissionCounter"]


class AdmissionCounter:
    """Counts how often keys without a row were seen; a key is admitted once its count
    reaches ``threshold``. Bounded: at most ``capacity`` keys are counted, in a :class:`SlotMap`
    without rows scored LFU: a new key takes a free slot of its bucket, else evicts the least
    counted key the batch does not see (ties: lowest key); a full bucket with no such key
    leaves the batch's remaining new keys uncounted (the lowest keys of the bucket are counted).

    Args:
        threshold: occurrences at which a key is admitted (<= 1: every key, nothing counted).
        capacity: the most keys counted (rounded up to whole buckets).
        bucket_size: slots per bucket of the counter's map.
        device: where the counts live.
        backend: backend of the counter's map ops.
        name: the table's name, for error messages.
    """

    def __init__(
        self,
        threshold: int,
        capacity: int,
        *,
        bucket_size: int = 32,
        device: torch.device | str | None = None,
        backend: str = "auto",
        name: str = "table",
    ) -> None:
        self.threshold = threshold
        # Starts small and grows (doubling: no key is dropped) up to ``capacity``.
        self._map = SlotMap(
            min(capacity, 64 * bucket_size),
            capacity,
            bucket_size=bucket_size,
            policy=LFU(),
            load_factor=1.0,
            device=device,
            backend=backend,
            name=f"{name} (admission counter)",
        )
        self._admitted = 0

    @property
    def capacity(self) -> int:
        """The most keys counted."""
        return self._map.max_capacity

    @property
    def num_buckets(self) -> int:
        """Buckets of the counter's map now (it grows up to ``capacity``)."""
        return self._map.num_buckets

    def admit(self, keys: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
        """Add a batch's counts of keys without a row; admitted keys are forgotten by the
        counter (they get a row).

        Args:
            keys: [M] distinct int64 keys.
            counts: [M] occurrences in the batch.
            step: the training step.

        Returns:
            [M] bool, True where the key's count reached ``threshold``.
        """
        device = self._map.device
        keys, counts = keys.to(device), counts.to(device, torch.int64)
        if self.threshold <= 1:
            return torch.ones_like(keys, dtype=torch.bool)
        slots = self._map.find(keys)
        seen = torch.where(slots >= 0, self._map.scores[slots.clamp(min=0)], 0) + counts
        admitted = seen >= self.threshold
        self._map.remove(keys[admitted & (slots >= 0)])
        pending = ~admitted
        self._map.insert_if_room(keys[pending], counts[pending], step)
        self._admitted += int(admitted.sum())
        return admitted

    @property
    def map(self) -> SlotMap:
        """The counter's map (keys counted, scored by their counts)."""
        return self._map

    def count_arena(
        self, admitted: int, hits: int, inserts: int, evictions: int, overflow: int, removed: int
    ) -> None:
        """Count what a key arena (:mod:`recsys.embedding.dynamic.arena_admission`) did for this
        counter in one batch: keys ``admitted`` (``removed`` of them were counted), counted
        keys seen again (``hits``), keys newly counted (``inserts``), the ``evictions`` they
        caused, and keys left uncounted (``overflow``)."""
        self._admitted += admitted
        self._map.count_placed(inserts, evictions, overflow, hits=hits, removed=removed, warn=False)

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [K] ascending, their counts [K]) of every counted key."""
        keys, slots = self._map.entries()
        return keys, self._map.scores[slots]

    def restore(
        self, keys: torch.Tensor, counts: torch.Tensor, num_buckets: int | None = None
    ) -> None:
        """Replace the counts with ``keys`` / ``counts`` (as :meth:`state` returns them), in a
        map of ``num_buckets`` (:attr:`num_buckets` when they were saved; default: now),
        doubled while a bucket would overflow."""
        buckets = min(num_buckets or self._map.num_buckets, self._map.max_buckets)
        self._map.restore(buckets, keys, counts, torch.zeros_like(counts), grow=True)

    def stats(self) -> dict[str, int]:
        """counted (keys counted now), capacity, admitted, forgotten (counted keys evicted by
        new ones) and uncounted (new keys that found no room)."""
        inner = self._map.stats()
        return {
            "counted": inner["size"],
            "capacity": inner["capacity"],
            "admitted": self._admitted,
            "forgotten": inner["evictions"],
            "uncounted": inner["overflow"],
        }
