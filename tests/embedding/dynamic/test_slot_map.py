"""SlotMap and AdmissionCounter against a Python-dict reference model of the same rules (bucket
rule, growth, LRU / LFU scores, (score, key) tie-break, admission, TTL) on random key streams
with heavy duplicates."""

import math

import pytest
import torch

from recsys.embedding.dynamic.admission import AdmissionCounter
from recsys.embedding.dynamic.slot_map import (
    LFU,
    LRU,
    ScorePolicy,
    SlotMap,
    score_policy,
)
from recsys.ops.slot_map.hash_map import EMPTY_KEY, RESERVED_KEY, bucket_of
from tests.ops.slot_map.test_slot_map import bucket_reference


class ReferenceMap:
    """The map's rules key by key: ``slots`` is a list of [key, score, last_seen] or None."""

    def __init__(self, capacity, max_capacity, bucket_size, policy, load_factor=0.75):
        self.bucket_size, self.policy, self.load_factor = bucket_size, policy, load_factor
        self.num_buckets = math.ceil(capacity / bucket_size)
        self.max_buckets = math.ceil(max_capacity / bucket_size)
        self.slots = [None] * (self.num_buckets * bucket_size)

    def bucket_range(self, bucket):
        return range(bucket * self.bucket_size, (bucket + 1) * self.bucket_size)

    def find(self, key, slots=None, num_buckets=None):
        slots, num_buckets = slots or self.slots, num_buckets or self.num_buckets
        for s in self.bucket_range(bucket_reference(key, num_buckets)):
            if slots[s] is not None and slots[s][0] == key:
                return s
        return -1

    def live(self):
        return {e[0]: e for e in self.slots if e is not None}

    def score(self, old, is_new, count, step):
        return step if self.policy == "lru" else (count if is_new else old + count)

    def assign(self, slots, num_buckets, pinned, new_keys):
        """{key: slot or -1}, evicted keys, overflowing buckets."""
        out, evicted, overflow, by_bucket = {}, [], [], {}
        for key in sorted(new_keys):
            by_bucket.setdefault(bucket_reference(key, num_buckets), []).append(key)
        for bucket, keys in by_bucket.items():
            span = self.bucket_range(bucket)
            free = [s for s in span if slots[s] is None]
            taken = [s for s in span if slots[s] is not None and slots[s][0] not in pinned]
            taken.sort(key=lambda s: (slots[s][1], slots[s][0]))
            candidates = free + taken
            if len(keys) > len(candidates):
                overflow.append(bucket)
            for key, slot in zip(keys, candidates + [-1] * len(keys), strict=False):
                out[key] = slot
                if slot >= 0 and slots[slot] is not None:
                    evicted.append(slots[slot][0])
        return out, evicted, overflow

    def rehash(self, num_buckets, pinned):
        """New slot list and dropped keys (only at the maximum: doubling never overflows)."""
        slots, dropped, by_bucket = [None] * (num_buckets * self.bucket_size), [], {}
        for entry in self.live().values():
            by_bucket.setdefault(bucket_reference(entry[0], num_buckets), []).append(entry)
        for bucket, entries in by_bucket.items():
            assert len(entries) <= self.bucket_size or num_buckets == self.max_buckets
            entries.sort(key=lambda e: (e[0] in pinned, e[1], e[0]), reverse=True)
            dropped += [e[0] for e in entries[self.bucket_size :]]
            kept = sorted(entries[: self.bucket_size], key=lambda e: e[0])
            for position, entry in enumerate(kept):
                slots[bucket * self.bucket_size + position] = list(entry)
        return slots, dropped

    def target(self, live):
        buckets = self.num_buckets
        while live > self.load_factor * buckets * self.bucket_size and buckets < self.max_buckets:
            buckets = min(self.max_buckets, 2 * buckets)
        return buckets

    def insert(self, keys, counts, step, admit, skip_overflow=False):
        """Returns ({key: slot}, inserted keys, evicted keys); raises ValueError on overflow."""
        pinned = {k for k in keys if self.find(k) >= 0}
        new = [k for k, a in zip(keys, admit, strict=True) if k not in pinned and a]
        slots, num_buckets, dropped = self.slots, self.num_buckets, []
        target = self.target(len(self.live()) + len(new))
        while True:
            if target > num_buckets:
                rehashed, gone = self.rehash(target, pinned)
                slots, num_buckets, dropped = rehashed, target, dropped + gone
                self.slots, self.num_buckets = rehashed, target  # later rehashes start here
            assigned, evicted, overflow = self.assign(slots, num_buckets, pinned, new)
            if (overflow or evicted) and num_buckets < self.max_buckets:
                target = min(self.max_buckets, 2 * num_buckets)
                continue
            break
        if overflow and not skip_overflow:
            raise ValueError("overflow")
        self.slots, self.num_buckets = slots, num_buckets
        result = {}
        for key, count in zip(keys, counts, strict=True):
            slot = self.find(key) if key in pinned else assigned.get(key, -1)
            if slot >= 0:
                entry = self.slots[slot]
                is_new = key not in pinned
                old = 0 if is_new else entry[1]
                self.slots[slot] = [key, self.score(old, is_new, count, step), step]
            result[key] = slot
        inserted = [k for k in new if assigned[k] >= 0]
        return result, inserted, dropped + evicted


def zipf_stream(num_steps, batch, vocabulary, generator):
    """Batches of ids with heavy duplicates: a Zipf-like draw over a vocabulary."""
    for _ in range(num_steps):
        ranks = (torch.rand(batch, generator=generator) ** 3 * vocabulary).long()
        yield ranks * 0x9E3779B97F4A7C15 % (2**61) - 2**60  # spread over the int64 range


def check_insert(slot_map, reference, keys, counts, step, admit=None):
    """One insert on both; compare slots, inserted, evicted, moved and the whole state."""
    before = slot_map.keys.clone()
    admit_list = admit.tolist() if admit is not None else [True] * len(keys)
    ref_slots, ref_inserted, ref_evicted = reference.insert(
        keys.tolist(), counts.tolist(), step, admit_list
    )
    insertion = slot_map.insert(keys, counts, step, admit)
    assert insertion.slots.tolist() == [ref_slots[k] for k in keys.tolist()]
    assert sorted(keys[insertion.inserted].tolist()) == sorted(ref_inserted)
    assert sorted(insertion.evicted.tolist()) == sorted(ref_evicted)
    if insertion.moved is not None:  # each row moves with its key, unless evicted meanwhile
        old, new = insertion.moved
        kept = slot_map.keys[new] == before[old]
        assert (kept | torch.isin(before[old], insertion.evicted)).all()
    check_state(slot_map, reference)
    return insertion


def check_state(slot_map, reference):
    expected = [e if e is not None else [EMPTY_KEY, 0, 0] for e in reference.slots]
    ours = torch.stack([slot_map.keys, slot_map.scores, slot_map.last_seen], 1).tolist()
    assert slot_map.num_buckets == reference.num_buckets
    assert ours == expected
    assert slot_map.size == len(reference.live())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("bucket_size", [8, 5])
def test_stream_matches_reference_with_growth_and_eviction(policy, bucket_size):
    """Start small, grow to the maximum, then evict there; remove and expire on the way."""
    generator = torch.Generator().manual_seed(bucket_size)
    slot_map = SlotMap(8, 240, bucket_size=bucket_size, policy=policy, name="t")
    reference = ReferenceMap(8, 240, bucket_size, policy)
    grew = []
    for step, ids in enumerate(zipf_stream(40, 32, 800, generator)):
        keys, counts = torch.unique(ids, return_counts=True)
        check_insert(slot_map, reference, keys, counts, step)
        grew.append(slot_map.num_buckets)
        if step % 7 == 3:
            victims = keys[::5]
            freed = slot_map.remove(torch.cat([victims, victims[:1]]))
            assert (freed[:-1] >= 0).all()
            for key in victims.tolist():
                reference.slots[reference.find(key)] = None
            check_state(slot_map, reference)
        if step % 10 == 9:
            stale = [s for s, e in enumerate(reference.slots) if e and step - e[2] > 4]
            assert slot_map.expire(step, ttl=4).tolist() == stale
            for s in stale:
                reference.slots[s] = None
            check_state(slot_map, reference)
    assert grew[0] < grew[-1] == slot_map.max_buckets
    stats = slot_map.stats()
    assert stats["evictions"] > 0 and stats["grows"] >= 2 and stats["expirations"] > 0
    assert stats["misses"] == stats["inserts"] and stats["rejected"] == 0


def test_admission_and_find_match_reference():
    """Misses not admitted get no row and are counted as rejected; find is read-only."""
    generator = torch.Generator().manual_seed(3)
    slot_map = SlotMap(16, 64, bucket_size=8, policy="lfu")
    reference = ReferenceMap(16, 64, 8, "lfu")
    rejected = 0
    for step, ids in enumerate(zipf_stream(12, 30, 200, generator)):
        keys, counts = torch.unique(ids, return_counts=True)
        admit = torch.rand(len(keys), generator=generator) < 0.6
        insertion = check_insert(slot_map, reference, keys, counts, step, admit)
        rejected += int(((insertion.slots < 0) & ~admit).sum())
        probe = torch.cat([keys, ids[:7]])
        expected = [reference.find(k) for k in probe.tolist()]
        assert slot_map.find(probe).tolist() == expected
    assert slot_map.stats()["rejected"] == rejected > 0


def test_both_backends_give_the_same_map():
    generator = torch.Generator().manual_seed(5)
    maps = [SlotMap(8, 96, bucket_size=8, policy="lru", backend=b) for b in ("torch", "triton")]
    for step, ids in enumerate(zipf_stream(12, 40, 400, generator)):
        keys, counts = torch.unique(ids, return_counts=True)
        results = [m.insert(keys, counts, step) for m in maps]
        assert torch.equal(results[0].slots, results[1].slots)
        assert torch.equal(results[0].evicted, results[1].evicted)
    for name in ("keys", "scores", "last_seen"):
        assert torch.equal(getattr(maps[0], name), getattr(maps[1], name))
    assert maps[1].stats()["evictions"] > 0


def test_keys_in_any_order_and_moved_rows():
    """Unsorted keys give the same map as sorted ones; moved carries rows across a rehash."""
    keys = torch.unique(torch.randint(0, 10**6, (40,)))
    counts = torch.ones_like(keys)
    first, second = SlotMap(8, 256, bucket_size=4), SlotMap(8, 256, bucket_size=4)
    first.insert(keys[:6], counts[:6], 0)
    second.insert(keys[:6].flip(0), counts[:6], 0)
    rows = torch.full((first.capacity,), -1)
    rows[first.find(keys[:6])] = keys[:6]  # a row buffer holding each key
    permutation = torch.randperm(len(keys))
    insertion = first.insert(keys[permutation], counts, 1)
    second.insert(keys, counts, 1)
    assert torch.equal(first.keys, second.keys)
    assert insertion.moved is not None
    grown = torch.full((first.capacity,), -1)
    grown[insertion.moved[1]] = rows[insertion.moved[0]]
    assert torch.equal(grown[first.find(keys[:6])], keys[:6])
    assert insertion.inserted.sum() == len(keys) - 6


def test_restore_round_trip_continues_identically():
    generator = torch.Generator().manual_seed(9)
    stream = list(zipf_stream(16, 40, 300, generator))
    original = SlotMap(8, 128, bucket_size=8, policy="lfu")
    for step, ids in enumerate(stream[:8]):
        original.insert(*torch.unique(ids, return_counts=True), step)
    keys, slots = original.entries()
    assert torch.equal(keys, torch.sort(original.keys[original.keys != EMPTY_KEY]).values)
    restored = SlotMap(8, 128, bucket_size=8, policy="lfu")
    shuffle = torch.randperm(len(keys))
    new_slots = restored.restore(
        original.num_buckets,
        keys[shuffle],
        original.scores[slots][shuffle],
        original.last_seen[slots][shuffle],
    )
    assert torch.equal(restored.keys[new_slots], keys[shuffle])
    for step, ids in enumerate(stream[8:], start=8):
        unique, counts = torch.unique(ids, return_counts=True)
        a, b = original.insert(unique, counts, step), restored.insert(unique, counts, step)
        assert torch.equal(a.inserted, b.inserted)
        assert torch.equal(torch.sort(a.evicted).values, torch.sort(b.evicted).values)
    assert all(torch.equal(x, y) for x, y in zip(entries(original), entries(restored), strict=True))


def entries(slot_map):
    keys, slots = slot_map.entries()
    return keys, slot_map.scores[slots], slot_map.last_seen[slots]


def test_restore_errors_leave_the_map_unchanged():
    slot_map = SlotMap(4, 16, bucket_size=2)
    slot_map.insert(torch.tensor([1, 2]), torch.ones(2, dtype=torch.int64), 0)
    before = slot_map.keys.clone()
    with pytest.raises(ValueError, match="num_buckets=9; expected 1..8"):
        slot_map.restore(9, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    many = torch.arange(1, 40)
    with pytest.raises(ValueError, match="restore puts"):
        slot_map.restore(1, many, torch.zeros_like(many), torch.zeros_like(many))
    with pytest.raises(ValueError, match="appears twice"):
        slot_map.restore(8, torch.tensor([3, 3]), torch.zeros(2), torch.zeros(2))
    assert torch.equal(slot_map.keys, before) and slot_map.size == 2


def test_errors_batch_too_big_overflow_reserved_and_duplicates():
    slot_map = SlotMap(8, 16, bucket_size=4, name="items")
    ones = torch.ones(17, dtype=torch.int64)
    with pytest.raises(ValueError, match="'items': this batch has 17 distinct keys.*at most 16"):
        slot_map.insert(torch.arange(17), ones, 0)
    with pytest.raises(ValueError, match=f"{RESERVED_KEY}.*reserved"):
        slot_map.insert(torch.tensor([1, RESERVED_KEY]), ones[:2], 0)
    with pytest.raises(ValueError, match="key 5 appears twice"):
        slot_map.insert(torch.tensor([5, 1, 5]), ones[:3], 0)
    # fill the map at its maximum, then a batch that pins a whole bucket and adds a key to it
    for start in range(0, 80, 4):
        slot_map.insert(torch.arange(start, start + 4), ones[:4], start)
    assert slot_map.size == 16 and slot_map.num_buckets == 4
    held = slot_map.keys[:4]  # bucket 0
    new = next(k for k in range(5000, 6000) if bucket_reference(k, 4) == 0)
    batch = torch.cat([held, torch.tensor([new])])
    keys_before = slot_map.keys.clone()
    with pytest.warns(UserWarning, match="'items' is at its maximum.*1 new key"):
        insertion = slot_map.insert(batch, torch.ones_like(batch), 2000)
    # The new key gets no row (its bucket holds only keys of this batch), counted, not raised.
    assert insertion.slots[-1] == -1 and not insertion.inserted[-1]
    assert torch.equal(insertion.slots[:4], torch.arange(4)) and len(insertion.evicted) == 0
    assert torch.equal(slot_map.keys, keys_before) and slot_map.stats()["overflow"] == 1
    assert slot_map.stats()["rejected"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0, "max_capacity": 8}, "capacity=0"),
        ({"capacity": 16, "max_capacity": 8}, "max_capacity=8"),
        ({"capacity": 8, "max_capacity": 8, "bucket_size": 129}, "bucket_size=129"),
        ({"capacity": 8, "max_capacity": 8, "bucket_size": 0}, "bucket_size=0"),
        ({"capacity": 8, "max_capacity": 8, "load_factor": 0.0}, "load_factor=0.0"),
        ({"capacity": 8, "max_capacity": 8, "policy": "mru"}, "'mru'.*lru, lfu"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlotMap(**kwargs)


def test_sizes_round_up_to_buckets():
    slot_map = SlotMap(10, 100, bucket_size=32)
    assert (slot_map.num_buckets, slot_map.capacity) == (1, 32)
    assert (slot_map.max_buckets, slot_map.max_capacity) == (4, 128)
    assert slot_map.keys.shape == slot_map.scores.shape == slot_map.last_seen.shape == (32,)


def test_custom_score_policy_orders_evictions():
    class Oldest(ScorePolicy):
        """Keeps the first-seen step: the newest keys go first."""

        name = "oldest"

        def update(self, old, is_new, counts, step):
            return torch.where(is_new, -step, old)

    assert isinstance(score_policy("lru"), LRU) and isinstance(score_policy("lfu"), LFU)
    policy = Oldest()
    assert score_policy(policy) is policy
    slot_map = SlotMap(1, 1, bucket_size=1, policy=policy)
    one = torch.ones(1, dtype=torch.int64)
    slot_map.insert(torch.tensor([7]), one, 1)
    insertion = slot_map.insert(torch.tensor([8]), one, 2)  # evicts 7: the only slot
    assert insertion.evicted.tolist() == [7]
    assert slot_map.scores.tolist() == [-2]


class ReferenceCounter:
    """AdmissionCounter's rule on a ReferenceMap (LFU, fixed size, uncounted on overflow)."""

    def __init__(self, threshold, capacity, bucket_size):
        self.threshold = threshold
        self.map = ReferenceMap(capacity, capacity, bucket_size, "lfu", load_factor=1.0)

    def admit(self, keys, counts, step):
        seen = {}
        for key, count in zip(keys, counts, strict=True):
            slot = self.map.find(key)
            seen[key] = (self.map.slots[slot][1] if slot >= 0 else 0) + count
        admitted = [seen[k] >= self.threshold for k in keys]
        for key, yes in zip(keys, admitted, strict=True):
            if yes and self.map.find(key) >= 0:
                self.map.slots[self.map.find(key)] = None
        pending = [(k, c) for k, c, a in zip(keys, counts, admitted, strict=True) if not a]
        self.map.insert(
            [k for k, _ in pending], [c for _, c in pending], step, [True] * len(pending), True
        )
        return admitted


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_admission_counter_matches_reference(backend):
    generator = torch.Generator().manual_seed(11)
    counter = AdmissionCounter(3, 24, bucket_size=4, backend=backend)
    reference = ReferenceCounter(3, 24, 4)
    admitted_total = 0
    for step, ids in enumerate(zipf_stream(15, 30, 120, generator)):
        keys, counts = torch.unique(ids, return_counts=True)
        admitted = counter.admit(keys, counts, step)
        assert admitted.tolist() == reference.admit(keys.tolist(), counts.tolist(), step)
        admitted_total += int(admitted.sum())
        keys_now, counts_now = counter.state()
        live = sorted(reference.map.live().values())
        assert keys_now.tolist() == [e[0] for e in live]
        assert counts_now.tolist() == [e[1] for e in live]
    stats = counter.stats()
    assert stats["admitted"] == admitted_total > 0
    assert stats["counted"] == len(keys_now) and stats["capacity"] == 24
    assert stats["forgotten"] > 0 and stats["uncounted"] > 0


def test_admission_counter_bigger_batch_than_capacity_and_restore():
    counter = AdmissionCounter(2, 8, bucket_size=4)
    keys = torch.arange(100)
    admitted = counter.admit(keys, torch.ones_like(keys), 0)  # never raises
    assert not admitted.any() and counter.stats()["counted"] == 8
    keys_now, counts_now = counter.state()
    again = counter.admit(keys_now, torch.ones_like(keys_now), 1)
    assert again.all() and counter.stats()["counted"] == 0
    fresh = AdmissionCounter(2, 8, bucket_size=4)
    fresh.restore(keys_now, counts_now)
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.state(), (keys_now, counts_now), strict=True)
    )
    assert AdmissionCounter(1, 8).admit(keys, torch.ones_like(keys), 0).all()


def keys_with_buckets(wanted, start=1):
    """The first keys from ``start`` whose buckets for each (num_buckets, bucket) rule of
    ``wanted`` hold."""
    found, key = [], start
    while len(found) < len(wanted):
        if all(bucket_reference(key, n) == b for n, b in wanted[len(found)]):
            found.append(key)
        key += 1
    return torch.tensor(found)


def test_growth_below_the_maximum_never_evicts():
    """Doubling splits each bucket in two, so a rehash below the maximum always fits; a new key
    whose bucket is full makes the map grow rather than evict."""
    keys = keys_with_buckets([[(2, 0)]] * 3)
    slot_map = SlotMap(4, 64, bucket_size=2, load_factor=1.0)
    reference = ReferenceMap(4, 64, 2, "lru", load_factor=1.0)
    check_insert(slot_map, reference, keys[:2], torch.ones(2).long(), 0)
    insertion = check_insert(slot_map, reference, keys[2:], torch.ones(1).long(), 1)
    assert slot_map.num_buckets > 2 and len(insertion.evicted) == 0
    assert sorted(slot_map.keys[insertion.moved[1]].tolist()) == keys[:2].tolist()


def test_rehash_to_the_maximum_drops_the_lowest_unpinned_keys_of_a_full_bucket():
    """Four keys that share bucket 0 at the maximum of 3 buckets of 2: the rehash keeps the
    pinned key and the highest score, and the other two are evicted."""
    rules = [[(2, b), (3, 0)] for b in (0, 0, 1, 1)] + [[(3, 2)]]
    keys = keys_with_buckets(rules)
    slot_map = SlotMap(4, 6, bucket_size=2, load_factor=1.0, policy="lru")
    reference = ReferenceMap(4, 6, 2, "lru", load_factor=1.0)
    for step, key in enumerate(keys[:4].tolist()):
        check_insert(slot_map, reference, torch.tensor([key]), torch.ones(1).long(), step)
    batch = torch.stack([keys[0], keys[4]])  # keys[0] is pinned, with the oldest step
    insertion = check_insert(slot_map, reference, batch, torch.ones(2).long(), 9)
    assert slot_map.num_buckets == 3
    assert sorted(insertion.evicted.tolist()) == sorted(keys[1:3].tolist())
    assert sorted(slot_map.entries()[0].tolist()) == sorted([keys[0], keys[3], keys[4]])


def test_restore_with_grow_at_the_cap_keeps_each_buckets_highest_scored_keys():
    """Keys saved by several maps (a table over more ranks) land unevenly in one map at its
    cap: the cap holds, each bucket keeps its highest-scored keys, the others are dropped."""
    slot_map = SlotMap(8, 8, bucket_size=4, name="t")  # 2 buckets: at most 8 keys
    keys = torch.arange(1, 9, dtype=torch.int64)
    while int(torch.bincount(bucket_of(keys, 2), minlength=2).max()) <= 4:
        keys = keys * 3 + 1  # until the 8 keys fall 5 / 3 into the 2 buckets
    scores = torch.randperm(8) + 10
    zeros = torch.zeros_like(keys)
    with pytest.raises(ValueError, match="restore to more buckets"):
        slot_map.restore(2, keys, scores, zeros)
    slots = slot_map.restore(2, keys, scores, zeros, grow=True)
    buckets = bucket_of(keys, 2)
    kept = torch.zeros_like(keys, dtype=torch.bool)
    for bucket in range(2):  # the 4 highest-scored keys of each bucket
        mine = (buckets == bucket).nonzero().squeeze(1)
        kept[mine[torch.argsort(scores[mine], descending=True)[:4]]] = True
    assert slot_map.max_capacity == 8 and slot_map.size == int(kept.sum()) < 8
    assert sorted(slot_map.dropped.tolist()) == sorted(keys[~kept].tolist())
    assert torch.equal(slot_map.find(keys[kept]), slots[kept])
    assert (slots[~kept] == -1).all() and (slot_map.find(keys[~kept]) == -1).all()
