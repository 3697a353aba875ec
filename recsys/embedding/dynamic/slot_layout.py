"""The pieces of a :class:`~recsys.embedding.dynamic.slot_map.SlotMap` outside its methods: the
tensors of a map layout (keys, scores, last steps of ``num_buckets`` buckets), the rehash of a
layout into more buckets and how slot maps of successive rehashes compose, the distinct-key
check, and :class:`Insertion`, what an insert did.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from recsys.ops.slot_map.hash_map import EMPTY_KEY, assign_slots, keep_per_bucket

__all__ = [
    "Insertion",
    "Layout",
    "check_unique",
    "compose_slot_maps",
    "empty_layout",
    "latest_generation",
    "new_generation",
    "rehash",
]

_GENERATIONS = itertools.count(1)
_latest = 0


@dataclass
class Insertion:
    """What :meth:`SlotMap.insert` did; all tensors follow the order of the keys passed in.

    Attributes:
        slots: [U] int64 slot of each key after the call, -1 where not admitted.
        inserted: [U] bool, True where the key got a new row in this call: the caller
            initializes that row and resets its optimizer state.
        moved: ``(old_slots, new_slots)`` [L] of every key live before the call that is still
            live after the rehash, when the map grew during the call (else None): the caller
            moves its rows old -> new into buffers of the new capacity before using ``slots``.
        evicted: [E] int64 keys that lost their row in this call.
    """

    slots: torch.Tensor
    inserted: torch.Tensor
    moved: tuple[torch.Tensor, torch.Tensor] | None
    evicted: torch.Tensor


@dataclass
class Layout:
    """Tensors of a map of ``num_buckets`` buckets, before they replace the map's own."""

    num_buckets: int
    keys: torch.Tensor
    scores: torch.Tensor
    last_seen: torch.Tensor


def empty_layout(num_buckets: int, bucket_size: int, device: torch.device) -> Layout:
    """An empty map of ``num_buckets`` buckets: every key ``EMPTY_KEY``, scores and last steps 0."""
    capacity = num_buckets * bucket_size
    zeros = torch.zeros(capacity, dtype=torch.int64, device=device)
    keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=device)
    return Layout(num_buckets, keys, zeros, zeros.clone())


def rehash(
    layout: Layout,
    hit_slots: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    trim: bool,
    backend: str,
) -> tuple[Layout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every live key of ``layout`` placed into an empty map of ``num_buckets``.

    Doubling splits each bucket in two (bucket mod 2n determines bucket mod n), so only a
    rehash to a count that is not a multiple of the current one (the map's maximum) can put
    more than ``bucket_size`` keys in one bucket: with ``trim`` the lowest (pinned last, score,
    key) ones are dropped first; pinned keys (``hit_slots``) that still do not fit are left in
    ``overflow``, for the caller to raise.

    Returns:
        (the new layout, old -> new slot map [C_old] with -1 for dropped keys, keys dropped,
        overflow rows ``(bucket, needed, available)`` as :func:`assign_slots` reports them).
    """
    live = (layout.keys != EMPTY_KEY).nonzero().squeeze(1)  # [L] old slots
    keys, scores = layout.keys[live], layout.scores[live]
    pinned = torch.zeros_like(layout.keys, dtype=torch.bool)
    pinned[hit_slots] = True
    keep = torch.ones_like(keys, dtype=torch.bool)
    if trim:
        keep = keep_per_bucket(keys, scores, pinned[live], num_buckets, bucket_size)
    new = empty_layout(num_buckets, bucket_size, layout.keys.device)
    no_pins = torch.zeros_like(new.keys, dtype=torch.bool)
    slots, _, overflow = assign_slots(
        new.keys, new.scores, no_pins, num_buckets, bucket_size, keys[keep], backend
    )
    if len(overflow):  # pinned keys that do not fit: the caller raises
        return new, torch.full_like(layout.keys, -1), keys[~keep], overflow
    kept = live[keep]
    new.keys[slots], new.scores[slots] = keys[keep], scores[keep]
    new.last_seen[slots] = layout.last_seen[kept]
    slot_map = torch.full_like(layout.keys, -1)
    slot_map[kept] = slots
    return new, slot_map, keys[~keep], overflow


def compose_slot_maps(first: torch.Tensor | None, then: torch.Tensor) -> torch.Tensor:
    """Slot maps old -> mid and mid -> new (-1: gone) composed into old -> new."""
    if first is None:
        return then
    return torch.where(first >= 0, then[first.clamp(min=0)], first)


def check_unique(sorted_keys: torch.Tensor, name: str) -> None:
    """Raise ValueError naming table ``name`` and the key if ``sorted_keys`` repeats one."""
    if len(sorted_keys) > 1 and bool((sorted_keys[1:] == sorted_keys[:-1]).any()):
        key = sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]][0].item()
        raise ValueError(f"table {name!r}: key {key} appears twice; expected distinct keys")


def new_generation() -> int:
    """A generation for a map that takes new tensors: above every one handed out before, to
    any map (``next`` of a counter: atomic, as the tiered prefetch thread grows maps too)."""
    global _latest
    _latest = next(_GENERATIONS)
    return _latest


def latest_generation() -> int:
    """The last :func:`new_generation` handed out: a caller holding views of several maps'
    tensors compares their generations only when this moved."""
    return _latest
