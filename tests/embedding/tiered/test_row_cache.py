"""RowCache and the fixed-table store against a full in-memory table: many fills and evictions
through a tiny cache (free-row list, pinning, eviction order, write-back), and the store's
written-row bits (absent rows are never read, after a clear and a checkpoint load too)."""

from __future__ import annotations

import pytest
import torch

from recsys.embedding.tiered.files import TieredFiles
from recsys.embedding.tiered.row_cache import RowCache, RowCodec
from recsys.embedding.tiered.row_store import DiskRecords, FixedStore, HostRecords, RowBits
from recsys.ops.slot_map.hash_map import EMPTY_KEY

NUM_KEYS = 211  # rows of the table
DIM = 3
CACHE_ROWS = 23
RECORD_BYTES = DIM * 4 + 4  # float32 weights, one float32 state


def initial(keys: torch.Tensor) -> list[torch.Tensor]:
    """A key's initial weights [n, DIM] and state [n], distinct per key."""
    keys = keys.cpu().double()
    weights = torch.stack([keys * 0.5 + d for d in range(DIM)], dim=1).float()
    return [weights, (keys * -0.25).float()]


def make_store(tier: str, path) -> FixedStore:
    width = RECORD_BYTES
    if tier == "host":
        return FixedStore(HostRecords(NUM_KEYS, width))
    return FixedStore(DiskRecords(path / "t.rows", NUM_KEYS, width))


def make_cache(store: FixedStore, policy: str) -> tuple[RowCache, list[torch.Tensor]]:
    """A cache of CACHE_ROWS rows over ``store``; its buffers (weights, state)."""
    tensors = [torch.zeros(CACHE_ROWS, DIM), torch.zeros(CACHE_ROWS)]
    codec = RowCodec(lambda: tensors)
    cache = RowCache(
        CACHE_ROWS, store, codec, lambda k: codec.encode(initial(k)), policy=policy, name="t"
    )
    return cache, tensors


def check_rows(cache: RowCache) -> None:
    """The free list is exactly the rows holding no key, ascending; every key has its row."""
    empty = (cache.row_key == EMPTY_KEY).nonzero().squeeze(1)
    assert torch.equal(cache.free, empty)
    held = (cache.row_key != EMPTY_KEY).nonzero().squeeze(1)
    assert torch.equal(cache.rows_of(cache.row_key[held]), held)


def check_evictions(cache: RowCache, before: dict, keys: torch.Tensor) -> None:
    """Rows that lost their key were unpinned, and none scored above a kept row that was a
    candidate (unpinned, not a hit of the batch ``keys``)."""
    pinned = before["ticket"] >= before["oldest_live"]
    evicted = (before["key"] != EMPTY_KEY) & (cache.row_key != before["key"])
    kept = (before["key"] != EMPTY_KEY) & (cache.row_key == before["key"]) & ~pinned
    kept &= ~torch.isin(before["key"], keys)
    assert not bool((evicted & pinned).any())
    if bool(evicted.any()) and bool(kept.any()):
        assert int(before["score"][evicted].max()) <= int(before["score"][kept].min())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_many_evictions_match_a_full_table(policy, tier, tmp_path):
    store = make_store(tier, tmp_path)
    cache, (weights, state) = make_cache(store, policy)
    full_weights, full_state = initial(torch.arange(NUM_KEYS))
    gen = torch.Generator().manual_seed(11)
    trained = torch.zeros(NUM_KEYS, dtype=torch.bool)  # rows the store must hold at the end
    in_flight = None  # (keys, rows, train) of the batch being trained
    for step in range(150):
        keys = torch.randperm(NUM_KEYS, generator=gen)[: int(torch.randint(1, 10, (1,)))]
        keys = torch.where(torch.rand(len(keys), generator=gen) < 0.5, keys % 17, keys).unique()
        counts = torch.randint(1, 4, (len(keys),), generator=gen)
        train = step % 5 != 3
        before = {
            "key": cache.row_key.clone(),
            "score": cache.row_score.clone(),
            "ticket": cache.row_ticket.clone(),
            "oldest_live": cache.oldest_live,
        }
        rows, ticket = cache.prepare(keys, counts, train=train)  # while in_flight trains
        check_evictions(cache, before, keys)
        assert bool((rows >= 0).all())
        assert torch.equal(cache.row_key[rows], keys)
        if in_flight is not None:  # the batch in flight kept its rows
            flight_keys, flight_rows, flight_train = in_flight
            assert torch.equal(cache.row_key[flight_rows], flight_keys)
            if flight_train:
                delta = (step + flight_keys % 7).float()
                weights[flight_rows] += delta.unsqueeze(1)
                state[flight_rows] -= delta
                full_weights[flight_keys] += delta.unsqueeze(1)
                full_state[flight_keys] -= delta
        trained[keys] |= train
        cache.begin(ticket)
        in_flight = (keys, rows, train)
        if step % 37 == 36:  # rows freed from outside the fill path
            idle = (cache.row_ticket < cache.oldest_live) & (cache.row_key != EMPTY_KEY)
            cache.evict(idle.nonzero().squeeze(1)[:4])
        check_rows(cache)
    cache.begin(cache.next_ticket)
    cache.flush()
    records, present = store.read(torch.arange(NUM_KEYS))
    assert torch.equal(present, trained)
    expected = cache.codec.encode([full_weights, full_state])
    assert torch.equal(records[trained], expected[trained])
    assert cache.stats["evicted"] > 100 and cache.stats["fetched"] > 50


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_unwritten_rows_are_never_read(tier, tmp_path):
    store = make_store(tier, tmp_path)
    width = store.records.width
    cache, _ = make_cache(store, "lru")
    first = torch.arange(0, 40, 2)
    cache.prepare(first, torch.ones_like(first), train=True)
    assert store.bytes_read == 0  # every row new: nothing read
    cache.begin(cache.next_ticket)  # done: nothing pinned
    second = torch.arange(1, 41, 2)  # evicts (and writes back) rows of ``first``
    cache.prepare(second, torch.ones_like(second), train=True)
    assert store.bytes_read == 0
    written = int(store.written.get(torch.arange(NUM_KEYS)).sum())
    assert written == cache.stats["written_back"] > 0
    both = torch.cat([first, second])
    records, present = store.read(both)
    assert int(present.sum()) == written
    assert store.bytes_read == written * width
    assert not bool(records[~present].any())
    store.clear()
    _, present = store.read(both)
    assert not bool(present.any()) and store.bytes_read == written * width
    assert list(store.items(8)) == []


def test_written_rows_survive_a_checkpoint(tmp_path):
    source, _ = make_cache(make_store("host", tmp_path), "lru")
    keys = torch.tensor([0, 1, 7, 8, 9, 63, 64, NUM_KEYS - 1])
    records = torch.randint(0, 256, (len(keys), RECORD_BYTES), dtype=torch.uint8)
    source.store.write(keys, records)
    (tmp_path / "ckpt").mkdir()
    TieredFiles({"t": source}, {"t": ["x"]}).save(tmp_path / "ckpt", chunk_rows=5)
    target, _ = make_cache(make_store("disk", tmp_path), "lru")
    target.store.write(torch.tensor([2, 3]), records[:2])  # replaced by the load
    TieredFiles({"t": target}, {"t": ["x"]}).load(tmp_path / "ckpt", chunk_rows=3)
    got, present = target.store.read(torch.arange(NUM_KEYS))
    assert torch.equal(present.nonzero().squeeze(1), keys)
    assert torch.equal(got[keys], records)
    stored = list(target.store.items(10))
    assert torch.equal(torch.cat([k for k, _ in stored]), keys)
    assert torch.equal(torch.cat([r for _, r in stored]), records)


def test_row_bits_set_and_clear():
    bits = RowBits(19)
    rows = torch.tensor([0, 7, 8, 8, 15, 16, 18, 7])  # repeats, neighbours in one byte
    bits.set(rows)
    want = torch.zeros(19, dtype=torch.bool)
    want[rows] = True
    assert torch.equal(bits.get(torch.arange(19)), want)
    bits.set(rows[:3])  # setting again changes nothing
    assert torch.equal(bits.get(torch.arange(19)), want)
    bits.clear()
    assert not bool(bits.get(torch.arange(19)).any())
