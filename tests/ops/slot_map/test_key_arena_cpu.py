"""The key arena's compiled CPU loops: bitwise the tensor ops they replace (hint check, slot
update with hit counts, LRU / LFU / mixed scores), and a clear reason where they cannot load."""

from __future__ import annotations

import pytest
import torch

from recsys.ops.slot_map import key_arena_cpu
from recsys.ops.slot_map.hash_map import EMPTY_KEY, bucket_of, find_slots_torch

FIBONACCI = -0x61C8864680B583EB

pytestmark = pytest.mark.skipif(
    not key_arena_cpu.available(), reason=f"no C compiler: {key_arena_cpu.unavailable_reason()}"
)


NUM_BUCKETS, FIRST_BUCKET = [10, 5, 10, 1], [0, 10, 15, 0]  # per table, then ids of no table
HINT_SIZES, HINT_BASES = [64, 128, 256, 1], [0, 64, 192, 448]


def _hint_case(seed: int, n: int = 3000, every_id: bool = False):
    """An arena of 3 tables of 10, 5 and 10 buckets of 8 slots (200 slots, then the scratch),
    hint regions of 64 / 128 / 256 entries (collisions), random hints (most invalid, some made
    valid); ids: held keys of their table, absent keys, EMPTY_KEY, ids of no table (unless
    ``every_id``). Returns the per-id and arena tensors the loop takes."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.full((201,), EMPTY_KEY, dtype=torch.int64)
    held = torch.randint(-(2**62), 2**62, (150,), generator=g)
    held_table = torch.arange(150) % 3
    bucket = bucket_of(held, torch.tensor(NUM_BUCKETS)[held_table])
    bucket += torch.tensor(FIRST_BUCKET)[held_table]
    for k, (key, b) in enumerate(zip(held.tolist(), bucket.tolist(), strict=True)):
        row = keys[b * 8 : b * 8 + 8]
        free = (row == EMPTY_KEY).nonzero()
        if len(free):
            row[free[0]] = key
        else:
            held_table[k] = -1  # its bucket is full: not held
    pick = torch.randint(0, 150, (n,), generator=g)
    table = torch.where(
        torch.rand(n, generator=g) < 0.6,
        held_table[pick],
        torch.randint(0, 3 if every_id else 4, (n,), generator=g),
    )
    ids = torch.where(
        table == held_table[pick], held[pick], torch.randint(-(2**40), 2**40, (n,), generator=g)
    )
    table = table.clamp(min=0)
    ids[torch.randint(0, n, (20,), generator=g)] = EMPTY_KEY
    hint_mask = torch.tensor([s - 1 for s in HINT_SIZES])[table]
    hint_base = torch.tensor(HINT_BASES)[table]
    hints = torch.randint(0, 200, (449,), generator=g)
    hints[448] = 200  # ids of no table: the scratch
    hint_at = (((ids * FIBONACCI) >> 32) & hint_mask) + hint_base
    slot_of = {key: i for i, key in enumerate(keys.tolist()) if key != EMPTY_KEY}
    for i in torch.randint(0, n, (n // 3,), generator=g).tolist():
        if table[i] < 3 and int(ids[i]) in slot_of:
            hints[hint_at[i]] = slot_of[int(ids[i])]
    mine = None if every_id else table < 3
    num_buckets = torch.tensor(NUM_BUCKETS)[table]
    first_bucket = torch.tensor(FIRST_BUCKET)[table]
    return ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys


@pytest.mark.parametrize("every_id", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_find_is_the_tensor_ops(seed, every_id):
    ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys = _hint_case(
        seed, every_id=every_id
    )
    # the arena's tensor ops: hints, then a scan of the ids without a valid one
    hint_at = (((ids * FIBONACCI) >> 32) & hint_mask) + hint_base
    slot = hints.index_select(0, hint_at)
    unsure = (keys.index_select(0, slot) != ids) | (ids == EMPTY_KEY)
    if mine is not None:
        unsure &= mine
    scan = unsure.nonzero().squeeze(1)
    scanned = find_slots_torch(keys[:-1], num_buckets[scan], 8, ids[scan], first_bucket[scan])
    slot.index_put_((scan,), scanned)
    missing = scan[scanned < 0]
    before = hints.clone()
    got_slot, got_where, got_hints = key_arena_cpu.find(
        ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys, 8, EMPTY_KEY
    )
    assert torch.equal(got_slot, slot)
    assert torch.equal(got_where, missing)
    assert torch.equal(got_hints, hint_at.index_select(0, missing))
    # the found keys' entries now name a slot holding one of the keys that hash there
    found = scan[scanned >= 0]
    for entry in (hints != before).nonzero().squeeze(1).tolist():
        wrote = found[hint_at[found] == entry]  # the found ids of this entry; one's slot
        assert len(wrote) and int(keys[hints[entry]]) in ids[wrote].tolist(), entry
    # every outcome occurred: valid hints, failed hints whose scan found the key, no slot
    assert len(found) and len(missing) and len(scan) < len(ids)


def _touch_reference(target, live, table, hits, last_seen, scores, lfu, scratch, step):
    """The arena's tensor ops (arena_find.touch_tensor_ops)."""
    if hits is not None:
        positions = torch.arange(len(target))
        last_seen.index_put_((target,), positions)
        won = last_seen.index_select(0, target) == positions
        if live is not None:
            won &= live
        hits.index_add_(0, table, won.long())
    last_seen.index_fill_(0, target, step)
    flags = lfu.tolist()[:-1]
    if not any(flags):
        scores.index_fill_(0, target, step)
    elif all(flags):
        scores.index_put_((target,), torch.ones((), dtype=torch.int64), accumulate=True)
    else:
        per_id = lfu.index_select(0, table)
        scores.index_put_(
            (torch.where(per_id, target, scratch),), torch.ones((), dtype=torch.int64),
            accumulate=True,
        )  # fmt: skip
        scores.index_fill_(0, torch.where(per_id, scratch, target), step)


@pytest.mark.parametrize("lfu_flags", [(0, 0, 0), (1, 1, 1), (1, 0, 1)])
@pytest.mark.parametrize("with_live, count", [(False, True), (True, True), (True, False)])
def test_touch_is_the_tensor_ops(lfu_flags, with_live, count):
    g = torch.Generator().manual_seed(sum(lfu_flags) + 2 * with_live + 7 * count)
    n, capacity = 4000, 500
    table = torch.randint(0, 3, (n,), generator=g)
    found = table * 150 + torch.randint(0, 150, (n,), generator=g) ** 2 // 150  # hot slots
    scratch = capacity
    live = torch.rand(n, generator=g) < 0.8 if with_live else None
    target = found if live is None else torch.where(live, found, scratch)
    lfu = torch.tensor([*map(bool, lfu_flags), False])
    mode = 0 if not any(lfu_flags) else 1 if all(lfu_flags) else 2
    state = {
        "hits": torch.randint(0, 9, (4,), generator=g) if count else None,
        "last_seen": torch.randint(0, 40, (capacity + 1,), generator=g),
        "scores": torch.randint(0, 40, (capacity + 1,), generator=g),
    }
    expected = {k: None if v is None else v.clone() for k, v in state.items()}
    _touch_reference(target, live, table, *expected.values(), lfu, scratch, 41)
    key_arena_cpu.touch(target, live, table, *state.values(), lfu, mode, scratch, 41)
    for name, value in expected.items():
        assert (value is None) == (state[name] is None)
        if value is not None:
            assert torch.equal(state[name], value), name


@pytest.mark.parametrize("every_id", [False, True])
@pytest.mark.parametrize("lfu_flags", [(0, 0, 0), (1, 0, 1)])
def test_bound_lookup_is_find_then_touch(every_id, lfu_flags):
    """ArenaLoops.lookup: where every id has a slot, find then touch (hits counted, live =
    the arena's ids) and the rows; where some id has none, find alone (nothing touched)."""
    case = _hint_case(3, every_id=every_id)
    ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys = case
    table = torch.searchsorted(torch.tensor(HINT_BASES), hint_base, right=True) - 1
    base = torch.tensor(FIRST_BUCKET)[table] * 8
    slot, _, _ = key_arena_cpu.find(*case[:6], hints.clone(), keys, 8, EMPTY_KEY)
    hit = slot >= 0 if mine is None else (slot >= 0) | ~mine
    lfu = torch.tensor([*map(bool, lfu_flags), False])
    mode = 0 if not any(lfu_flags) else 1 if all(lfu_flags) else 2
    g = torch.Generator().manual_seed(5)
    for keep in (hit, torch.ones_like(hit)):  # a batch of hits, then one with misses
        columns = [c[keep] for c in (ids, hint_mask, hint_base, num_buckets, first_bucket)]
        mask = None if mine is None else mine[keep]
        state = {
            "hints": hints.clone(),
            "hits": torch.randint(0, 9, (4,), generator=g),
            "last_seen": torch.randint(0, 40, (201,), generator=g),
            "scores": torch.randint(0, 40, (201,), generator=g),
        }
        expected = {k: v.clone() for k, v in state.items()}
        want = key_arena_cpu.find(*columns, mask, expected["hints"], keys, 8, EMPTY_KEY)
        loops = key_arena_cpu.ArenaLoops(
            state["hints"], keys, state["last_seen"], state["scores"], state["hits"], lfu, mode,
            8, EMPTY_KEY, 200,
        )  # fmt: skip
        bound = loops.columns(*columns[1:], mask, table[keep], base[keep])
        got_slot, rows, got_where, got_hints = loops.lookup(columns[0], bound, 41)
        assert torch.equal(got_where, want[1]) and torch.equal(got_hints, want[2])
        if len(want[1]):
            assert rows is None and torch.equal(got_slot, want[0])
        else:
            assert got_slot is None
            assert torch.equal(rows, want[0] - base[keep])
            _touch_reference(want[0], mask, table[keep], expected["hits"],
                             expected["last_seen"], expected["scores"], lfu, 200, 41)  # fmt: skip
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
    with pytest.raises(ValueError, match="10 ids for per-id columns of"):
        loops.lookup(ids[:10], bound, 42)


def test_a_tensor_of_the_wrong_kind_is_refused_with_its_name():
    ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys = _hint_case(0, 50)
    args = [ids, hint_mask, hint_base, num_buckets, first_bucket, mine, hints, keys, 8, EMPTY_KEY]
    with pytest.raises(ValueError, match="hints is a torch.int32 tensor"):
        key_arena_cpu.find(*args[:6], hints.int(), *args[7:])
    with pytest.raises(ValueError, match=r"ids .*contiguous: False"):
        key_arena_cpu.find(torch.stack([ids, ids], 1)[:, 0], *args[1:])
    with pytest.raises(ValueError, match="lfu_mode is 3"):
        key_arena_cpu.touch(hints, None, hints, None, hints, hints, mine, 3, 0, 1)


def test_loops_that_cannot_load_say_why(monkeypatch, tmp_path):
    monkeypatch.setattr(key_arena_cpu, "_TRIED", False)
    monkeypatch.setattr(key_arena_cpu, "_LIB", None)
    monkeypatch.setenv("RECSYS_CPU_OPS", "0")
    assert not key_arena_cpu.available()
    assert key_arena_cpu.unavailable_reason() == "turned off by RECSYS_CPU_OPS=0"
    with pytest.raises(RuntimeError, match="RECSYS_CPU_OPS=0"):
        key_arena_cpu.find(*_hint_case(0, n=10), 8, EMPTY_KEY)
    monkeypatch.setattr(key_arena_cpu, "_TRIED", False)
    monkeypatch.setenv("RECSYS_CPU_OPS", "1")
    monkeypatch.setenv("RECSYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="no-such-compiler.*tensor ops instead"):
        assert not key_arena_cpu.available()
    assert "no-such-compiler" in key_arena_cpu.unavailable_reason()
    assert not list((tmp_path / "cpu_ops").glob("*.so"))  # nothing half-written left


def test_the_loops_compile_into_the_cache_dir_once(monkeypatch, tmp_path):
    monkeypatch.setattr(key_arena_cpu, "_TRIED", False)
    monkeypatch.setattr(key_arena_cpu, "_LIB", None)
    monkeypatch.setenv("RECSYS_CACHE_DIR", str(tmp_path))
    assert key_arena_cpu.available()
    (built,) = (tmp_path / "cpu_ops").glob("key_arena_cpu-*.so")
    assert [p.name for p in (tmp_path / "cpu_ops").iterdir()] == [built.name]  # no scratch
    stamp = built.stat().st_mtime_ns
    monkeypatch.setattr(key_arena_cpu, "_TRIED", False)
    monkeypatch.setattr(key_arena_cpu, "_LIB", None)
    assert key_arena_cpu.available() and built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
