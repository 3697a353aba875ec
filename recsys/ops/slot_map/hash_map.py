"""Id -> slot map of a dynamic embedding table: hashing, lookup and the assignment of new keys.

Layout. A map of ``capacity = num_buckets * bucket_size`` slots holds int64 keys
(``EMPTY_KEY`` where a slot is free); slot s belongs to bucket ``s // bucket_size``. A key lives
only in its bucket

    bucket_of(k) = (mix64(k) >>> 1) mod num_buckets        (num_buckets: any integer >= 1)

with ``mix64`` the splitmix64 finalizer on the 64 bits of k:

    z ^= z >>> 30;  z *= 0xbf58476d1ce4e5b9;  z ^= z >>> 27;  z *= 0x94d049bb133111eb;
    z ^= z >>> 31                              (>>> logical shift, multiplies wrap mod 2**64)

There is no probing outside the bucket and no tombstone: removing a key writes ``EMPTY_KEY``.
``EMPTY_KEY = -2**63`` and ``RESERVED_KEY = -2**63 + 1`` are never valid keys.

Find (:func:`find_slots`): the slot of each key [N] in its bucket's row, or -1.

Arena find: :mod:`recsys.ops.slot_map.arena_scan`.

Assign (:func:`assign_slots`): M new keys (distinct, absent from the map). Per bucket b that
receives n_b of them, ranked r = 0..n_b-1 by ascending key, the bucket's candidate slots are
ordered

    free slots by slot index ascending, then occupied unpinned slots by (score, key) ascending

(pinned occupied slots are not candidates; keys of a bucket are distinct, so the order of the
occupied ones does not depend on their positions). The key of rank r takes the r-th candidate,
evicting its key if it held one. A bucket with n_b > candidates overflows: its first
``available`` keys still get their candidates, the rest get -1, and the bucket is reported
(``(bucket, needed, available)``) so the caller can grow or raise. The op only reads the map:
the caller writes keys, scores and positions itself.

Shape letters: C capacity, S bucket_size (<= 128), N looked-up keys, M new keys, Bt buckets that
receive new keys.

Backends: the torch path gathers the [N, S] bucket rows and compares (find), and ranks the
candidates of the [Bt, S] touched rows with three stable sorts (assign). The Triton path runs a
block of keys per program (find), and one program per touched bucket that ranks its slots by an
[S, S] pairwise comparison (assign). Both compute the same order, so their results are bitwise
equal. Deterministic: no atomics; results depend only on the inputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from recsys.ops._triton import resolve_backend

__all__ = [
    "EMPTY_KEY",
    "MAX_BUCKET_SIZE",
    "RESERVED_KEY",
    "assign_slots",
    "bucket_of",
    "check_keys",
    "find_slots",
    "find_slots_torch",
    "hash_keys",
    "keep_per_bucket",
    "mix64",
]

EMPTY_KEY = -(2**63)
RESERVED_KEY = -(2**63) + 1
# registers of the assign kernel hold an [S, S] comparison
MAX_BUCKET_SIZE = 128
# the torch find gathers [chunk, S] rows at a time
FIND_CHUNK = 1 << 16
# keys x slots compared per find program (64 keys of a 32-slot bucket): more spills at S = 128
FIND_TILE = 2048

_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_EMPTY = tl.constexpr(EMPTY_KEY)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 value with the same bits."""
    return value - 2**64 if value >= 2**63 else value


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >>> bits`` on the 64 bits of an int64 tensor."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on the 64 bits of each int64 key: a bijection of int64 whose
    output bits each depend on every input bit.

    Args:
        keys: int64 tensor, any shape.

    Returns:
        int64 tensor of ``keys``' shape (the 64 output bits, read as int64).

    Example::

        mix64(torch.tensor([0, 1]))  # tensor([0, 6238072747940578789])
    """
    z = keys.to(torch.int64)
    z = z ^ _shift_right_logical(z, 30)
    z = z * _signed(_MIX1)
    z = z ^ _shift_right_logical(z, 27)
    z = z * _signed(_MIX2)
    return z ^ _shift_right_logical(z, 31)


def hash_keys(keys: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A seeded 64-bit hash of int64 keys: ``mix64(keys ^ mix64(seed))``. Two seeds give
    independent hashes (e.g. routing keys to ranks with one seed while the map buckets them
    with :func:`bucket_of`, seed 0).

    Args:
        keys: int64 tensor, any shape.
        seed: any integer (its low 64 bits count).

    Returns:
        int64 tensor of ``keys``' shape. ``hash_keys(k, 0) == mix64(k)``.
    """
    return mix64(keys.to(torch.int64) ^ _salt(seed))


@functools.lru_cache(maxsize=64)
def _salt(seed: int) -> int:
    """``mix64(seed)`` as a host int, once per seed (not a device read per call)."""
    return mix64(torch.tensor(_signed(seed % 2**64), dtype=torch.int64)).item()


def bucket_of(keys: torch.Tensor, num_buckets: int | torch.Tensor) -> torch.Tensor:
    """Bucket of each key: ``(mix64(k) >>> 1) mod num_buckets``, int64 in [0, num_buckets)
    (``num_buckets``: one count, or one per key)."""
    return _shift_right_logical(mix64(keys), 1) % num_buckets


def check_keys(keys: torch.Tensor, what: str = "keys") -> None:
    """Raise ValueError if ``keys`` holds ``EMPTY_KEY`` or ``RESERVED_KEY`` (the two smallest
    int64 values, so one ``min`` finds them) or is not int64."""
    if keys.dtype != torch.int64:
        raise ValueError(f"{what} have dtype {keys.dtype}; expected torch.int64")
    if keys.numel() and keys.min().item() <= RESERVED_KEY:
        bad = keys[keys <= RESERVED_KEY][0].item()
        raise ValueError(
            f"{what} contain {bad}: the values {EMPTY_KEY} (EMPTY_KEY) and {RESERVED_KEY} "
            "(RESERVED_KEY) are reserved and cannot be keys"
        )


def _check_layout(table_keys: torch.Tensor, num_buckets: int, bucket_size: int) -> None:
    if not 1 <= bucket_size <= MAX_BUCKET_SIZE:
        raise ValueError(f"bucket_size={bucket_size}; expected 1 <= bucket_size <= 128")
    if num_buckets < 1 or table_keys.numel() != num_buckets * bucket_size:
        raise ValueError(
            f"table_keys has {table_keys.numel()} slots; expected num_buckets * bucket_size = "
            f"{num_buckets} * {bucket_size} with num_buckets >= 1"
        )


# --------------------------------------------------------------------------- torch path


def find_slots_torch(
    table_keys: torch.Tensor,
    num_buckets: int | torch.Tensor,
    bucket_size: int,
    keys: torch.Tensor,
    first_bucket: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch find, with no validation, sync or data-dependent shape: usable inside
    ``torch.export`` (inference maps keys to rows with it). Reserved keys find -1.

    Args:
        table_keys: [C] int64, C = (buckets of every map) * bucket_size.
        num_buckets: buckets of the map, or [N] int64 per key (an arena's maps).
        bucket_size: slots per bucket.
        keys: [N] int64.
        first_bucket: None (one map), or [N] int64 the first bucket of each key's map.

    Returns:
        [N] int64: the slot holding each key, -1 where absent.
    """
    bucket = bucket_of(keys, num_buckets)  # [N]
    if first_bucket is not None:
        bucket = bucket + first_bucket
    rows = table_keys.view(-1, bucket_size).index_select(0, bucket)  # [N, S]
    match = (rows == keys.unsqueeze(1)) & (keys != EMPTY_KEY).unsqueeze(1)  # [N, S]
    position = match.to(torch.int8).argmax(dim=1)  # [N]; 0 where no match
    slot = bucket * bucket_size + position
    return torch.where(match.any(dim=1), slot, torch.full_like(slot, -1))


def _group_by_bucket(
    keys: torch.Tensor, num_buckets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order of ``keys`` by (bucket, key), the touched buckets [Bt] ascending, how many keys
    each receives [Bt] and each sorted key's rank within its bucket [M]."""
    _, by_key = torch.sort(keys, stable=True)
    bucket_sorted, by_bucket = torch.sort(bucket_of(keys, num_buckets)[by_key], stable=True)
    order = by_key[by_bucket]  # [M]
    buckets, counts = torch.unique_consecutive(bucket_sorted, return_counts=True)  # [Bt]
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(len(buckets), device=keys.device), counts)
    rank = torch.arange(len(keys), device=keys.device) - starts[group]  # [M]
    return order, buckets, counts, rank


def _candidate_order_torch(
    table_keys: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor,
    buckets: torch.Tensor,
    bucket_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the touched buckets in candidate order [Bt, S] and how many are candidates
    [Bt]: stable sorts by the least significant criterion first (position, then key, score
    and class), free slots all tying on key and score so they stay in slot order."""
    slots = buckets.unsqueeze(1) * bucket_size + torch.arange(bucket_size, device=buckets.device)
    key = table_keys[slots]  # [Bt, S]
    free = key == EMPTY_KEY
    candidate = free | ~pinned[slots]
    score = torch.where(free, torch.zeros_like(key), scores[slots])
    klass = torch.where(free, 0, torch.where(candidate, 1, 2))
    order = torch.sort(key, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(score.gather(1, order), dim=1, stable=True).indices)
    order = order.gather(1, torch.sort(klass.gather(1, order), dim=1, stable=True).indices)
    return slots.gather(1, order), candidate.sum(dim=1)


def _assign_torch(
    table_keys: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor,
    bucket_size: int,
    buckets: torch.Tensor,
    counts: torch.Tensor,
    rank: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the keys sorted by (bucket, key) [M] (-1 past a bucket's candidates) and how
    many candidates each touched bucket has [Bt]."""
    ordered, available = _candidate_order_torch(table_keys, scores, pinned, buckets, bucket_size)
    group = torch.repeat_interleave(torch.arange(len(buckets), device=buckets.device), counts)
    position = rank.clamp(max=bucket_size - 1)
    slots = ordered[group, position]
    return torch.where(rank < available[group], slots, torch.full_like(slots, -1)), available


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _mix64_bits(keys):
    """mix64 of int64 ``keys`` as uint64 bits."""
    z = keys.to(tl.uint64, bitcast=True)
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _bucket_of(keys, num_buckets):
    """bucket_of(keys) as int64."""
    return (_mix64_bits(keys) >> 1).to(tl.int64, bitcast=True) % num_buckets


@triton.jit
def find_slots_kernel(
    table_ptr,
    keys_ptr,
    num_buckets_ptr,
    first_bucket_ptr,
    out_ptr,
    num_keys,
    num_buckets,
    PER_KEY: tl.constexpr,
    BUCKET_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The slot of each key in its bucket's row, -1 if none. ``PER_KEY``: each key's map has
    its own bucket count and first bucket (``num_buckets_ptr``, ``first_bucket_ptr``: an
    arena, :mod:`recsys.ops.slot_map.arena_scan`); else one map of ``num_buckets`` buckets."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < num_keys
    key = tl.load(keys_ptr + n, mask=n_mask, other=_EMPTY)  # [BLOCK_N]
    if PER_KEY:
        buckets = tl.load(num_buckets_ptr + n, mask=n_mask, other=1)
        first_bucket = tl.load(first_bucket_ptr + n, mask=n_mask, other=0)
        bucket = first_bucket + _bucket_of(key, buckets)
    else:
        bucket = _bucket_of(key, num_buckets)
    s = tl.arange(0, BLOCK_S)
    first = bucket * BUCKET_SIZE  # int64 slot of the bucket's first slot
    row_mask = n_mask[:, None] & (s < BUCKET_SIZE)[None, :]
    row = tl.load(table_ptr + first[:, None] + s[None, :], mask=row_mask, other=_EMPTY)
    match = (row == key[:, None]) & (key != _EMPTY)[:, None]  # [BLOCK_N, BLOCK_S]
    position = tl.min(tl.where(match, s[None, :], BLOCK_S), axis=1)
    slot = tl.where(position < BLOCK_S, first + position, -1)
    tl.store(out_ptr + n, slot, mask=n_mask)


@triton.jit
def _candidate_ranks(key, score, pinned, s, BUCKET_SIZE: tl.constexpr):
    """Each slot's rank in its bucket's candidate order [BLOCK_S] (pinned slots: unused) and
    which slots are candidates: slot j precedes slot i when its class (0 free, 1 unpinned,
    2 pinned) is lower, or both are free and j < i, or both are unpinned and (score, key) of
    j is lower."""
    valid = s < BUCKET_SIZE
    free = (key == _EMPTY) & valid
    candidate = free | ((pinned == 0) & valid)
    klass = tl.where(free, 0, tl.where(candidate, 1, 2))
    ki = klass[:, None]
    kj = klass[None, :]
    free_before = (ki == 0) & (kj == 0) & (s[None, :] < s[:, None])
    lower = (score[None, :] < score[:, None]) | (
        (score[None, :] == score[:, None]) & (key[None, :] < key[:, None])
    )
    before = ((kj < ki) | free_before | ((ki == 1) & (kj == 1) & lower)) & valid[None, :]
    return tl.sum(before.to(tl.int32), axis=1), candidate


@triton.jit
def _assign_slots_kernel(
    table_ptr,
    scores_ptr,
    pinned_ptr,
    buckets_ptr,
    offsets_ptr,
    slots_ptr,
    available_ptr,
    BUCKET_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    g = tl.program_id(0)
    first = tl.load(buckets_ptr + g) * BUCKET_SIZE  # int64
    start = tl.load(offsets_ptr + g)
    num_new = tl.load(offsets_ptr + g + 1) - start
    s = tl.arange(0, BLOCK_S)
    valid = s < BUCKET_SIZE
    key = tl.load(table_ptr + first + s, mask=valid, other=_EMPTY)
    score = tl.load(scores_ptr + first + s, mask=valid, other=0)
    pinned = tl.load(pinned_ptr + first + s, mask=valid, other=1).to(tl.int32)
    rank, candidate = _candidate_ranks(key, score, pinned, s, BUCKET_SIZE)
    tl.store(available_ptr + g, tl.sum(candidate.to(tl.int64)))
    for r0 in range(0, num_new, BLOCK_S):
        r = r0 + tl.arange(0, BLOCK_S)  # ranks of new keys
        take = (rank[None, :] == r[:, None]) & candidate[None, :]  # [keys, slots]
        position = tl.sum(tl.where(take, s[None, :], 0), axis=1)
        found = tl.sum(take.to(tl.int32), axis=1) > 0
        tl.store(slots_ptr + start + r, tl.where(found, first + position, -1), mask=r < num_new)


def _assign_triton(
    table_keys: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor,
    bucket_size: int,
    buckets: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of :func:`_assign_torch`."""
    offsets = torch.zeros(len(buckets) + 1, dtype=torch.int64, device=buckets.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    slots = torch.empty(int(counts.sum()), dtype=torch.int64, device=buckets.device)
    available = torch.empty(len(buckets), dtype=torch.int64, device=buckets.device)
    block_s = triton.next_power_of_2(bucket_size)
    # the [S, S] int64 comparison spills past 4 warps at S = 128 (sm_90)
    _assign_slots_kernel[(len(buckets),)](
        table_keys,
        scores,
        pinned,
        buckets,
        offsets,
        slots,
        available,
        BUCKET_SIZE=bucket_size,
        BLOCK_S=block_s,
        num_warps=4 if block_s <= 32 else 8,
    )
    return slots, available


def _find_triton(
    table_keys: torch.Tensor, num_buckets: int, bucket_size: int, keys: torch.Tensor
) -> torch.Tensor:
    out = torch.empty_like(keys)
    block_s = triton.next_power_of_2(bucket_size)
    block_n = FIND_TILE // block_s
    if len(keys):
        find_slots_kernel[(triton.cdiv(len(keys), block_n),)](
            table_keys,
            keys,
            keys,  # no per-key map parameters (PER_KEY=False): not read
            keys,
            out,
            len(keys),
            num_buckets,
            PER_KEY=False,
            BUCKET_SIZE=bucket_size,
            BLOCK_N=block_n,
            BLOCK_S=block_s,
        )
    return out


# --------------------------------------------------------------------------- public ops


def find_slots(
    table_keys: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    keys: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """The slot of each key, or -1 where the map does not hold it. Read-only; duplicates
    allowed.

    Args:
        table_keys: [C] int64 keys of the map (``EMPTY_KEY`` where free).
        num_buckets: buckets of the map (C = num_buckets * bucket_size).
        bucket_size: slots per bucket, 1..128.
        keys: [N] int64 keys to look up.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        [N] int64 slots (-1 where absent).

    Raises:
        ValueError: a reserved key, a non-int64 key tensor, a layout that does not match
            ``table_keys``, or an unknown backend.

    Example::

        slots = find_slots(table_keys, num_buckets, 32, torch.tensor([7, 2**40]))
    """
    _check_layout(table_keys, num_buckets, bucket_size)
    check_keys(keys)
    keys = keys.contiguous()
    chosen = resolve_backend(backend, keys.device, op="find_slots", has_triton=True)
    if chosen == "triton":
        return _find_triton(table_keys.contiguous(), num_buckets, bucket_size, keys)
    parts = [
        find_slots_torch(table_keys, num_buckets, bucket_size, chunk)
        for chunk in keys.split(FIND_CHUNK)
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def assign_slots(
    table_keys: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    keys: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots for new keys by the bucket rule of the module docstring. Only reads the map.

    Args:
        table_keys: [C] int64 keys of the map (``EMPTY_KEY`` where free).
        scores: [C] int64 score of each slot (ignored where free).
        pinned: [C] bool, True for slots that must not be evicted.
        num_buckets: buckets of the map.
        bucket_size: slots per bucket, 1..128.
        keys: [M] int64 new keys: distinct, not reserved and absent from the map (not
            checked); any order (ranks within a bucket follow ascending key).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``(slots, evicted, overflow)``: slots [M] int64 of each key (-1 for a key past its
        bucket's candidates), evicted [M] int64 the key that held that slot (``EMPTY_KEY`` if
        the slot was free or the key got none), overflow [K, 3] int64 rows ``(bucket, needed,
        available)`` of every bucket with more new keys than candidates, by bucket ascending.

    Raises:
        ValueError: a layout that does not match the tensors, or an unknown backend.
    """
    _check_layout(table_keys, num_buckets, bucket_size)
    if not scores.shape == pinned.shape == table_keys.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and pinned {tuple(pinned.shape)}; expected the "
            f"shape of table_keys {tuple(table_keys.shape)}"
        )
    device = keys.device
    chosen = resolve_backend(backend, device, op="assign_slots", has_triton=True)
    order, buckets, counts, rank = _group_by_bucket(keys, num_buckets)
    inputs = (table_keys.contiguous(), scores.contiguous(), pinned.contiguous(), bucket_size)
    if chosen == "triton" and len(keys):
        slots_sorted, available = _assign_triton(*inputs, buckets, counts)
    else:
        slots_sorted, available = _assign_torch(*inputs, buckets, counts, rank)
    slots = torch.empty_like(slots_sorted).index_copy_(0, order, slots_sorted)
    held = table_keys[slots.clamp(min=0)]
    evicted = torch.where(slots >= 0, held, torch.full_like(held, EMPTY_KEY))
    short = counts > available
    overflow = torch.stack([buckets[short], counts[short], available[short]], dim=1)
    return slots, evicted, overflow


def keep_per_bucket(
    keys: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
) -> torch.Tensor:
    """Which keys a map of ``num_buckets`` buckets keeps when some buckets get more keys than
    their ``bucket_size`` slots: in each bucket, the ``bucket_size`` highest by (pinned, score,
    key), pinned first. Three stable sorts, like the torch assign; deterministic.

    Args:
        keys: [L] int64 distinct keys.
        scores: [L] int64 score of each key.
        pinned: [L] bool, True for keys kept before any unpinned one.
        num_buckets: buckets of the map the keys go to.
        bucket_size: slots per bucket.

    Returns:
        [L] bool, True where the key is kept.
    """
    order = torch.sort(keys, descending=True, stable=True).indices
    order = order[torch.sort(scores[order], descending=True, stable=True).indices]
    order = order[torch.sort(pinned[order].to(torch.int8), descending=True, stable=True)[1]]
    buckets = bucket_of(keys, num_buckets)[order]
    order = order[torch.sort(buckets, stable=True).indices]
    _, counts = torch.unique_consecutive(buckets.sort().values, return_counts=True)
    rank = torch.arange(len(keys), device=keys.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    keep = torch.empty_like(pinned)
    keep[order] = rank < bucket_size
    return keep
