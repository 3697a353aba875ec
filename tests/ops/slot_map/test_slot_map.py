"""The slot map op: mix64, find, assign and keep against pure-Python references of the bucket rule,
and the Triton kernels (under the interpreter on CPU) bitwise against the torch path."""

import pytest
import torch

from recsys.ops.slot_map.arena_scan import find_arena_slots
from recsys.ops.slot_map.hash_map import (
    EMPTY_KEY,
    RESERVED_KEY,
    assign_slots,
    bucket_of,
    find_slots,
    find_slots_torch,
    hash_keys,
    keep_per_bucket,
    mix64,
)

BACKENDS = ("torch", "triton")
EXTREMES = [0, 1, -1, 2, 2**63 - 1, -(2**63) + 2, 2**62, -(2**62), 0x5555555555555555]


def mix64_reference(value: int) -> int:
    """splitmix64's finalizer on Python ints, returned as a signed 64-bit value."""
    z = value % 2**64
    z ^= z >> 30
    z = z * 0xBF58476D1CE4E5B9 % 2**64
    z ^= z >> 27
    z = z * 0x94D049BB133111EB % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def bucket_reference(key: int, num_buckets: int) -> int:
    return ((mix64_reference(key) % 2**64) >> 1) % num_buckets


def random_keys(count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Distinct random int64 keys over the whole range (reserved values excluded)."""
    keys = torch.randint(-(2**63) + 2, 2**63 - 1, (count,), dtype=torch.int64, generator=generator)
    return torch.unique(keys)


def random_table(num_buckets, bucket_size, fill, score_range=4, pin=0.3):
    """A consistent map (each key in its own bucket, at random positions) with ``fill`` of the
    slots taken, small scores (ties) and random pins."""
    capacity = num_buckets * bucket_size
    table = torch.full((capacity,), EMPTY_KEY)
    keys = random_keys(4 * capacity)
    taken = [0] * num_buckets
    positions = [torch.randperm(bucket_size).tolist() for _ in range(num_buckets)]
    for key in keys.tolist():
        bucket = bucket_reference(key, num_buckets)
        if taken[bucket] < round(fill * bucket_size):
            table[bucket * bucket_size + positions[bucket][taken[bucket]]] = key
            taken[bucket] += 1
    scores = torch.randint(0, score_range, (capacity,))
    pinned = (torch.rand(capacity) < pin) & (table != EMPTY_KEY)
    return table, scores, pinned


def find_reference(table, num_buckets, bucket_size, keys):
    out = []
    for key in keys.tolist():
        bucket = bucket_reference(key, num_buckets)
        row = table[bucket * bucket_size : (bucket + 1) * bucket_size].tolist()
        out.append(bucket * bucket_size + row.index(key) if key in row else -1)
    return torch.tensor(out, dtype=torch.int64)


def assign_reference(table, scores, pinned, num_buckets, bucket_size, keys):
    """The bucket rule, key by key: (slots, evicted, overflow rows)."""
    slots, evicted, overflow = {}, {}, []
    by_bucket = {}
    for key in sorted(keys.tolist()):
        by_bucket.setdefault(bucket_reference(key, num_buckets), []).append(key)
    for bucket, new in sorted(by_bucket.items()):
        first = bucket * bucket_size
        free = [s for s in range(first, first + bucket_size) if table[s] == EMPTY_KEY]
        taken = [s for s in range(first, first + bucket_size) if table[s] != EMPTY_KEY]
        unpinned = [s for s in taken if not pinned[s]]
        candidates = free + sorted(unpinned, key=lambda s: (int(scores[s]), int(table[s])))
        if len(new) > len(candidates):
            overflow.append([bucket, len(new), len(candidates)])
        for rank, key in enumerate(new):
            slot = candidates[rank] if rank < len(candidates) else -1
            slots[key] = slot
            evicted[key] = int(table[slot]) if slot >= 0 else EMPTY_KEY
    order = keys.tolist()
    return (
        torch.tensor([slots[k] for k in order], dtype=torch.int64),
        torch.tensor([evicted[k] for k in order], dtype=torch.int64),
        torch.tensor(overflow, dtype=torch.int64).reshape(-1, 3),
    )


def absent_keys(table, count):
    keys = random_keys(count)
    return keys[~torch.isin(keys, table)]


# --------------------------------------------------------------------------- hashing


def test_mix64_matches_python_reference_on_random_and_extreme_values():
    values = torch.cat([torch.tensor([*EXTREMES, EMPTY_KEY, RESERVED_KEY]), random_keys(2000)])
    expected = [mix64_reference(v) for v in values.tolist()]
    assert mix64(values).tolist() == expected
    buckets = [bucket_reference(v, 37) for v in values.tolist()]
    assert bucket_of(values, 37).tolist() == buckets


def test_hash_keys_is_seeded_mix64():
    keys = random_keys(100)
    assert torch.equal(hash_keys(keys, 0), mix64(keys))
    salt = mix64_reference(12345)
    expected = [mix64_reference(k ^ salt) for k in keys.tolist()]
    assert hash_keys(keys, 12345).tolist() == expected
    assert not torch.equal(hash_keys(keys, 1), hash_keys(keys, 2))


def test_hash_keys_reads_its_seed_once_not_per_call():
    """The salt of a seed is computed once: routing keys by hash reads nothing per step."""
    from recsys.train.step_audit import StepAudit  # tests may import the train layer

    keys = random_keys(10)
    first = hash_keys(keys, 777)
    with StepAudit() as report:
        again = hash_keys(keys, 777)
    assert report.syncs == [] and torch.equal(again, first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_find_hashes_like_python_on_extremes(backend):
    """Every extreme key stored in its reference bucket is found there by both backends."""
    num_buckets, bucket_size = 5, 4
    table = torch.full((num_buckets * bucket_size,), EMPTY_KEY)
    keys = torch.tensor(EXTREMES)
    for key in keys.tolist():  # at most 4 of them share a bucket: checked below
        bucket = bucket_reference(key, num_buckets)
        row = table[bucket * bucket_size : (bucket + 1) * bucket_size]
        row[(row == EMPTY_KEY).nonzero()[0]] = key
    expected = find_reference(table, num_buckets, bucket_size, keys)
    assert (expected >= 0).all()
    assert torch.equal(find_slots(table, num_buckets, bucket_size, keys, backend), expected)


# --------------------------------------------------------------------------- find


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_buckets", "bucket_size"), [(1, 1), (7, 8), (13, 32), (3, 128)])
def test_find_matches_reference_triton_and_torch(backend, num_buckets, bucket_size):
    table, _, _ = random_table(num_buckets, bucket_size, fill=0.7)
    stored = table[table != EMPTY_KEY]
    keys = torch.cat([stored, stored[:5], random_keys(50)])
    keys = keys[torch.randperm(len(keys))]
    expected = find_reference(table, num_buckets, bucket_size, keys)
    assert torch.equal(find_slots(table, num_buckets, bucket_size, keys, backend), expected)
    assert torch.equal(find_slots_torch(table, num_buckets, bucket_size, keys), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_find_empty_and_reserved_keys(backend):
    table, _, _ = random_table(3, 8, fill=0.5)
    empty = torch.empty(0, dtype=torch.int64)
    assert find_slots(table, 3, 8, empty, backend).shape == (0,)
    for reserved in (EMPTY_KEY, RESERVED_KEY):
        with pytest.raises(ValueError, match=f"{reserved}.*reserved"):
            find_slots(table, 3, 8, torch.tensor([5, reserved]), backend)
    # the export-safe path never matches a free slot
    assert find_slots_torch(table, 3, 8, torch.tensor([EMPTY_KEY])).tolist() == [-1]


def test_find_rejects_bad_layouts_and_dtypes():
    table = torch.full((24,), EMPTY_KEY)
    with pytest.raises(ValueError, match="num_buckets \\* bucket_size"):
        find_slots(table, 4, 8, torch.tensor([1]))
    with pytest.raises(ValueError, match="bucket_size=129"):
        find_slots(torch.full((129,), EMPTY_KEY), 1, 129, torch.tensor([1]))
    with pytest.raises(ValueError, match="torch.int64"):
        find_slots(table, 3, 8, torch.tensor([1], dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bucket_size", [1, 8, 32, 128])
def test_arena_find_looks_each_key_up_in_its_own_map(backend, bucket_size):
    """Maps of 1, 5 and 13 buckets side by side: each key is found in its own map only (a key
    of one map asked of another finds -1), free slots never match."""
    maps = [random_table(n, bucket_size, fill=0.6)[0] for n in (1, 5, 13)]
    arena = torch.cat(maps)
    firsts = torch.tensor([0, 1, 6])
    keys, which, expected = [], [], []
    for table in maps:
        stored = table[table != EMPTY_KEY]
        probe = torch.cat([stored[:20], random_keys(5)])
        for asked, other in enumerate(maps):  # its own keys, and the other maps' (absent)
            keys.append(probe)
            which.append(torch.full_like(probe, asked))
            found = find_reference(other, len(other) // bucket_size, bucket_size, probe)
            expected.append(torch.where(found >= 0, found + firsts[asked] * bucket_size, -1))
    keys.append(torch.tensor([EMPTY_KEY, EMPTY_KEY]))  # never matches a free slot
    which.append(torch.tensor([0, 2]))
    expected.append(torch.tensor([-1, -1]))
    keys, which, expected = torch.cat(keys), torch.cat(which), torch.cat(expected)
    order = torch.randperm(len(keys))
    keys, which, expected = keys[order], which[order], expected[order]
    num_buckets = torch.tensor([len(t) // bucket_size for t in maps])[which]
    out = find_arena_slots(arena, bucket_size, num_buckets, firsts[which], keys, backend)
    assert torch.equal(out, expected)
    assert (expected >= 0).sum() > 0 and (expected < 0).sum() > 0


def test_arena_find_rejects_bad_shapes():
    arena = torch.full((24,), EMPTY_KEY)
    one = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="bucket_size=7"):
        find_arena_slots(arena, 7, one, one, one)
    with pytest.raises(ValueError, match="first_bucket is torch.int64 \\(3,\\); expected"):
        find_arena_slots(arena, 8, one, torch.zeros(3, dtype=torch.int64), one)
    with pytest.raises(ValueError, match="num_buckets is torch.int32"):
        find_arena_slots(arena, 8, one.int(), one, one)


def test_find_slots_torch_exports():
    class Lookup(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            self.register_buffer("table", table)

        def forward(self, keys):
            return find_slots_torch(self.table, 7, 8, keys)

    table, _, _ = random_table(7, 8, fill=0.6)
    keys = torch.cat([table[table != EMPTY_KEY][:10], random_keys(6)])
    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(Lookup(table), (keys,), dynamic_shapes=({0: batch},))
    other = torch.cat([keys[3:], random_keys(3)])
    assert torch.equal(exported.module()(other), find_reference(table, 7, 8, other))


# --------------------------------------------------------------------------- assign


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("num_buckets", "bucket_size", "fill", "new"),
    [(7, 8, 0.5, 20), (7, 8, 1.0, 30), (5, 32, 0.9, 200), (11, 8, 0.0, 150), (1, 1, 1.0, 1)],
)
def test_assign_matches_reference_triton_and_torch(backend, num_buckets, bucket_size, fill, new):
    """Full buckets, pinned slots, ties in score, overflowing buckets, non-power-of-two
    bucket counts."""
    table, scores, pinned = random_table(num_buckets, bucket_size, fill)
    keys = absent_keys(table, new)
    keys = keys[torch.randperm(len(keys))]  # any order: ranks follow ascending key
    expected = assign_reference(table, scores, pinned, num_buckets, bucket_size, keys)
    got = assign_slots(table, scores, pinned, num_buckets, bucket_size, keys, backend)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bucket_size", [8, 32, 20])
def test_triton_assign_bitwise_equals_torch_on_random_tables(bucket_size):
    generator = torch.Generator().manual_seed(bucket_size)
    for trial in range(4):
        num_buckets = [3, 6, 13, 17][trial]
        fill = [0.3, 0.8, 1.0, 0.95][trial]
        table, scores, pinned = random_table(num_buckets, bucket_size, fill, score_range=3)
        keys = absent_keys(table, int(torch.randint(1, 4 * bucket_size, (1,), generator=generator)))
        torch_out = assign_slots(table, scores, pinned, num_buckets, bucket_size, keys, "torch")
        triton_out = assign_slots(table, scores, pinned, num_buckets, bucket_size, keys, "triton")
        for a, b in zip(torch_out, triton_out, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_assign_never_evicts_pinned_and_prefers_free_then_lowest_score(backend):
    bucket_size, num_buckets = 4, 1
    table = torch.tensor([10, EMPTY_KEY, 30, 40])
    scores = torch.tensor([5, 0, 1, 1])
    pinned = torch.tensor([False, False, False, True])
    keys = torch.tensor([7, 3, 9])
    slots, evicted, overflow = assign_slots(
        table, scores, pinned, num_buckets, bucket_size, keys, backend
    )
    # rank by key: 3 -> free slot 1, 7 -> (1, 30) at slot 2, 9 -> (5, 10) at slot 0
    assert slots.tolist() == [2, 1, 0]
    assert evicted.tolist() == [30, EMPTY_KEY, 10]
    assert overflow.shape == (0, 3)
    slots, _, overflow = assign_slots(
        table, scores, pinned, num_buckets, bucket_size, torch.tensor([1, 2, 3, 4]), backend
    )
    assert overflow.tolist() == [[0, 4, 3]]
    assert slots.tolist() == [1, 2, 0, -1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_assign_no_keys_and_bad_shapes(backend):
    table, scores, pinned = random_table(3, 8, 0.5)
    empty = torch.empty(0, dtype=torch.int64)
    slots, evicted, overflow = assign_slots(table, scores, pinned, 3, 8, empty, backend)
    assert slots.shape == evicted.shape == (0,) and overflow.shape == (0, 3)
    with pytest.raises(ValueError, match="scores"):
        assign_slots(table, scores[:-1], pinned, 3, 8, torch.tensor([1]), backend)


@pytest.mark.parametrize("num_buckets, bucket_size", [(1, 1), (3, 4), (7, 5)])
def test_keep_per_bucket_keeps_each_buckets_highest_pinned_score_key(num_buckets, bucket_size):
    keys = random_keys(6 * num_buckets * bucket_size)
    keys = keys[torch.randperm(len(keys))]
    scores = torch.randint(0, 3, keys.shape)  # ties
    pinned = torch.rand(keys.shape) < 0.3
    keep = keep_per_bucket(keys, scores, pinned, num_buckets, bucket_size)
    by_bucket = {}
    for i, key in enumerate(keys.tolist()):
        rank = (bool(pinned[i]), int(scores[i]), key)
        by_bucket.setdefault(bucket_reference(key, num_buckets), []).append((rank, i))
    expected = torch.zeros_like(keep)
    for entries in by_bucket.values():
        for _, i in sorted(entries, reverse=True)[:bucket_size]:
            expected[i] = True
    assert torch.equal(keep, expected)
