"""The key arena: a dynamic collection's tables looked up together give bitwise what each
table's own insert path gives (rows, pooled output, trained weights, map state, stats), through
growth, eviction at the cap, admission and LRU / LFU scores; and the all-hits step of a training
run waits on the host at most twice."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.embedding.dynamic import key_arena
from recsys.embedding.dynamic.admission import AdmissionCounter
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.key_arena import joins_arena
from recsys.embedding.dynamic.score_policy import ScorePolicy
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import Adam, RowWiseAdagrad
from recsys.ops.slot_map import key_arena_cpu
from recsys.ops.slot_map.hash_map import EMPTY_KEY, RESERVED_KEY
from recsys.train.step_audit import StepAudit

FEATURES = {"u": "user", "i": "item", "j": "item", "c": "city", "f": "fixed"}


def _collection(
    arena: bool,
    options: dict[str, DynamicTableOptions],
    optimizer,
    validate=True,
    item_dim=8,
    backend="torch",
):
    configs = [
        EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=64, feature_names=["u"]),
        EmbeddingBagConfig(
            name="item", embedding_dim=item_dim, num_embeddings=32, feature_names=["i", "j"]
        ),
        EmbeddingBagConfig(name="city", embedding_dim=4, num_embeddings=32, feature_names=["c"]),
        EmbeddingBagConfig(name="fixed", embedding_dim=4, num_embeddings=16, feature_names=["f"]),
    ]
    torch.manual_seed(0)  # the fixed table's init
    ebc = DynamicEmbeddingBagCollection(
        configs, options, seed=3, backend=backend, optimizer=optimizer, validate=validate
    )
    if not arena:  # every table on its own insert path, as before arenas
        ebc._set_arenas([])
    return ebc


def _batches(steps: int, batch: int, universe: int, seed: int):
    """Batches of raw keys, heavy repeats, new keys in most (growth, then eviction at a cap),
    lengths 0-3, every third batch the one before again (all hits); the fixed feature's ids
    are in its table."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (universe,), generator=generator) * 2 + 1
    batch_before = None
    for step in range(steps):
        if step % 3 == 2:
            yield batch_before
            continue
        values, lengths = [], []
        for feature in FEATURES:
            length = torch.randint(0, 4, (batch,), generator=generator)
            count = int(length.sum())
            if feature == "f":
                ids = torch.randint(0, 16, (count,), generator=generator)
            else:  # a growing vocabulary, hot keys first
                seen = min(universe, 40 + 25 * step)
                ids = keys[(torch.rand(count, generator=generator) ** 2 * seen).long()]
            values.append(ids)
            lengths.append(length)
        batch_before = KeyedJaggedTensor(
            keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)
        )
        yield batch_before


def _map_state(ebc: DynamicEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    out = {}
    for name, table in ebc.dynamic.items():
        keys, slots = table.map.entries()
        out[f"{name}.keys"] = keys
        out[f"{name}.scores"] = table.map.scores[slots]
        out[f"{name}.last_seen"] = table.map.last_seen[slots]
    return out


OPTIONS = {
    "lru_and_lfu": {
        "user": DynamicTableOptions(score="lru"),
        "item": DynamicTableOptions(score="lfu", bucket_size=8),
        "city": DynamicTableOptions(score="lfu"),
    },
    # one bucket size and dim: the arena places new keys itself while they fit (below and at
    # the cap), the tables' own path grows them and evicts
    "one_dim_capped": {
        "user": DynamicTableOptions(max_capacity=48, bucket_size=8),
        "item": DynamicTableOptions(max_capacity=80, bucket_size=8, score="lfu"),
        "city": DynamicTableOptions(bucket_size=8),
    },
    # tables at their cap from the start or after a growth or two (two with tiny buckets,
    # which overflow): from then on every step with new keys evicts, on the arena's path
    "at_the_cap": {
        "user": DynamicTableOptions(max_capacity=64, bucket_size=2),
        "item": DynamicTableOptions(max_capacity=96, bucket_size=2, score="lfu"),
        "city": DynamicTableOptions(max_capacity=40, bucket_size=8),
    },
    # admission counted in the arena: a counter at its cap from the start (it forgets keys
    # and leaves some uncounted), one that grows (its table's own path), a capped table
    "admission": {
        "user": DynamicTableOptions(bucket_size=8, admit_after=2, admission_capacity=16),
        "item": DynamicTableOptions(max_capacity=80, bucket_size=8, score="lfu", admit_after=3),
        "city": DynamicTableOptions(max_capacity=48, bucket_size=8),
    },
    "capped_with_admission": {
        "user": DynamicTableOptions(max_capacity=48, bucket_size=8, admit_after=2),
        "item": DynamicTableOptions(max_capacity=80, bucket_size=8, score="lfu"),
        "city": DynamicTableOptions(max_capacity=48, bucket_size=8),
    },
}


@pytest.mark.parametrize(
    "case, backend",
    [
        *((case, "torch") for case in sorted(OPTIONS)),
        ("at_the_cap", "triton"),
        # the tensor ops the compiled CPU loops replace (where they cannot be compiled)
        ("lru_and_lfu", "tensor ops"),
        ("at_the_cap", "tensor ops"),
    ],
)
def test_arena_trains_bitwise_like_each_tables_own_path(case, backend, monkeypatch):
    loops = backend != "tensor ops" and key_arena_cpu.available()
    if backend == "tensor ops":
        monkeypatch.setattr(key_arena.KeyArena, "cpu_loops", False)
        backend = "torch"
    item_dim = 4 if case in ("one_dim_capped", "at_the_cap", "admission") else 8
    models = {
        arena: _collection(
            arena, OPTIONS[case], RowWiseAdagrad(lr=0.1), item_dim=item_dim, backend=backend
        )
        for arena in (0, 1)
    }
    assert models[1]._arenas and not models[0]._arenas
    for model in models.values():
        model.take_delta()  # from now on, the keys that lose their row are recorded
    placed = []  # (inserts, evictions, overflow) of each table the arena placed keys of
    count_placed = SlotMap.count_placed
    monkeypatch.setattr(
        SlotMap,
        "count_placed",
        lambda m, *counts, **counter: (
            counter or placed.append(counts),  # a table's map (not an admission counter's)
            count_placed(m, *counts, **counter),
        ),
    )
    counted = []  # what the arena counted for each admission counter
    count_arena = AdmissionCounter.count_arena
    monkeypatch.setattr(
        AdmissionCounter,
        "count_arena",
        lambda c, *counts: (counted.append(counts), count_arena(c, *counts)),
    )
    for step, features in enumerate(_batches(14, batch=24, universe=400, seed=5)):
        train = step % 5 != 4  # every fifth batch is only looked up
        outputs = {}
        for arena, model in models.items():
            model.train(train)
            pooled = model(features).values()
            if train:
                pooled.square().sum().backward()
            outputs[arena] = pooled.detach()
        assert torch.equal(outputs[0], outputs[1]), f"step {step}"
    assert all(arena._loops == loops for arena in models[1]._arenas)
    states = [m.state_dict() for m in models.values()]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    maps = [_map_state(m) for m in models.values()]
    for key in maps[0]:
        assert torch.equal(maps[0][key], maps[1][key]), key
    deltas = [m.take_delta() for m in models.values()]
    for name, delta in deltas[0].items():
        for field in ("keys", "weights", "last_seen", "deleted"):
            assert torch.equal(getattr(delta, field), getattr(deltas[1][name], field)), field
        assert len(delta.deleted) or not OPTIONS[case][name].max_capacity or name == "city"
    stats = models[1].dynamic_stats()
    assert models[0].dynamic_stats() == stats
    assert all(stats[name]["hits"] > 0 for name in stats), stats
    grew_or_evicted = "grows" if case == "lru_and_lfu" else "evictions"
    tables = [n for n in stats if case == "lru_and_lfu" or OPTIONS[case][n].max_capacity]
    tables = ("user", "item") if case == "one_dim_capped" else tables
    assert all(stats[name][grew_or_evicted] > 0 for name in tables), stats
    # the arena placed new keys itself, admission included, and evicted
    # at the caps of the tables that had any
    inserts, evictions, overflow = (sum(c[i] for c in placed) for i in (0, 1, 2))
    # (capped_with_admission: tables of two dims, which the arena only finds)
    assert (inserts > 0) == (case != "capped_with_admission"), placed
    if case == "admission":  # the arena admitted, counted, forgot and left keys uncounted
        admitted, _, _, forgotten, uncounted, _ = (sum(c[i] for c in counted) for i in range(6))
        assert admitted and forgotten and uncounted, counted
    if case in ("one_dim_capped", "at_the_cap"):
        assert evictions > 0, placed
    if case == "at_the_cap":  # every eviction and overflow was the arena's
        assert evictions == sum(s["evictions"] for s in stats.values()), (placed, stats)
        assert overflow == sum(s["overflow"] for s in stats.values()) > 0, (placed, stats)


def test_arena_groups_tables_by_bucket_size_and_leaves_ttl_and_custom_scores_out():
    class Newest(ScorePolicy):
        def update(self, old, is_new, counts, step):
            return torch.full_like(old, step)

    options = {
        "user": DynamicTableOptions(bucket_size=8),
        "item": DynamicTableOptions(ttl_steps=3),
        "city": DynamicTableOptions(score=Newest()),
    }
    ebc = _collection(True, options, Adam(lr=0.01))
    assert [a.names for a in ebc._arenas] == [["user"]]
    assert not joins_arena(ebc.dynamic["item"]) and not joins_arena(ebc.dynamic["city"])
    for features in _batches(6, batch=16, universe=200, seed=2):
        ebc(features).values().sum().backward()  # the others on their own path, together
    assert ebc.dynamic_stats()["item"]["hits"] > 0


@pytest.mark.parametrize("loops", [True, False])
def test_all_hits_lookup_waits_at_most_twice_and_a_reserved_key_still_raises(loops, monkeypatch):
    if loops and not key_arena_cpu.available():
        pytest.skip(f"no C compiler: {key_arena_cpu.unavailable_reason()}")
    monkeypatch.setattr(key_arena.KeyArena, "cpu_loops", loops)
    options = {name: DynamicTableOptions(score="lfu") for name in ("user", "city")}
    options["item"] = DynamicTableOptions(score="lru")
    ebc = _collection(True, options, RowWiseAdagrad(lr=0.1))
    features = next(_batches(1, batch=64, universe=300, seed=9))
    for _ in range(2):  # inserts every key, then rebuilds the arena of the grown maps
        ebc(features).values().sum().backward()
    with StepAudit(torch.device("cpu")) as report:
        ebc.lookup_ids(features)
    if loops:  # the compiled loops find every id's slot and list none: nothing read back
        assert report.num_syncs == 0, report.describe()
    else:  # how many ids have no valid hint and, when some do, which tables miss a key (none)
        assert 1 <= report.num_syncs <= 2, report.describe()
        sites = {site.split(":")[0] for _, site in report.syncs}
        assert sites <= {
            "recsys/embedding/dynamic/key_arena.py",
            "recsys/embedding/dynamic/arena_find.py",
        }
    ebc.train(False)
    with StepAudit(torch.device("cpu")) as lookups:
        ebc.lookup_ids(features)
    # the reserved-key check of a lookup, the hint count (and no table's misses read)
    assert 1 <= lookups.num_syncs <= 2, lookups.describe()
    for reserved in (EMPTY_KEY, RESERVED_KEY):
        bad = KeyedJaggedTensor(
            keys=list(FEATURES),
            values=torch.tensor([5, reserved, 7, 8, 1]),
            lengths=torch.ones(5, dtype=torch.int64),
        )
        for training in (False, True):
            ebc.train(training)
            with pytest.raises(ValueError, match="reserved"):
                ebc(bad)


def test_triton_find_of_a_mixed_collection_counts_no_miss_for_fixed_tables(monkeypatch):
    # the Triton arena find (here under the interpreter) scans every id of the batch; the
    # fixed table's ids are no table's of the arena and must not count as misses, or every
    # step of hits would go through the placement of new keys
    options = {name: DynamicTableOptions(bucket_size=8) for name in ("user", "item", "city")}
    ebc = _collection(True, options, RowWiseAdagrad(lr=0.1), item_dim=4, backend="triton")
    assert ebc._arenas[0].backend == "triton"
    features = next(_batches(1, batch=8, universe=50, seed=6))
    for _ in range(2):  # inserts every key, then rebuilds the arena of the grown maps
        ebc(features).values().sum().backward()
    placements = []
    monkeypatch.setattr(key_arena, "place_new", lambda *args: placements.append(args))
    ebc(features).values().sum().backward()
    assert not placements


def test_arena_rebuilds_after_a_table_grows_or_loads():
    ebc = _collection(True, OPTIONS["lru_and_lfu"], RowWiseAdagrad(lr=0.1))
    arena = ebc._arenas[0]
    for features in _batches(8, batch=32, universe=600, seed=4):
        ebc(features).values().sum().backward()
    user = ebc.dynamic["user"].map
    assert user.stats()["grows"] > 0
    # every map is a view of the arena's buffers after the last lookup's rebuild
    features = next(_batches(1, batch=8, universe=20, seed=4))
    ebc(features).values().sum().backward()
    assert user.keys.untyped_storage().data_ptr() == arena.keys.untyped_storage().data_ptr()
    copy = _collection(True, OPTIONS["lru_and_lfu"], RowWiseAdagrad(lr=0.1))
    copy.load_state_dict(ebc.state_dict())
    ebc.train(False)
    copy.train(False)
    assert torch.equal(copy(features).values(), ebc(features).values())


def _held_batch(model: DynamicEmbeddingBagCollection, batch: int = 6) -> KeyedJaggedTensor:
    """A batch of keys the model's tables hold (one id per sample and feature): all hits."""
    values = []
    for table in FEATURES.values():
        if table == "fixed":
            values.append(torch.arange(batch) % 16)
            continue
        keys, _ = model.dynamic[table].map.entries()
        values.append(keys[torch.arange(batch) % len(keys)])
    return KeyedJaggedTensor(
        keys=list(FEATURES),
        values=torch.cat(values),
        lengths=torch.ones(batch * len(FEATURES), dtype=torch.int64),
    )


def test_zero_rows_are_reset_only_after_steps_that_gave_ids_no_row(monkeypatch):
    """At every training lookup each arena table's zero row reads zeros with its optimizer
    state initial, whether the lookup reset it (after a step whose ids at a cap had no row
    and pooled it, or a load) or skipped the reset (the step before gave every id a row)."""
    model = _collection(True, OPTIONS["at_the_cap"], RowWiseAdagrad(lr=0.1), item_dim=4)
    steps, resets = [], []
    reset = DynamicEmbeddingBagCollection._initial_state_at
    monkeypatch.setattr(
        DynamicEmbeddingBagCollection,
        "_initial_state_at",
        lambda m, rows, elements: (resets.append(steps[-1]), reset(m, rows, elements)),
    )
    for batch in _batches(6, batch=24, universe=400, seed=5):
        # new keys at the caps (some overflow), then twice keys all held
        for features in (batch, None, None):
            features = features or _held_batch(model)
            steps.append(len(steps))
            loads = steps[-1] == 11  # a load: the zero rows are reset at the next lookup
            if loads:
                model.load_state_dict(model.state_dict())
            pooled = model(features).values()
            for name, table in model.dynamic.items():
                bag = model.table_modules[name]
                assert not bag.weight[table.zero_row].any(), (steps[-1], name)
                for state in model.optimizer.states:
                    initial = model.optimizer.initial_state(state)
                    zero_row = getattr(bag, state)[table.zero_row]
                    assert (zero_row == initial).all(), (steps[-1], name)
            pooled.square().sum().backward()
    assert sum(s["overflow"] for s in model.dynamic_stats().values()) > 0
    # reset at each step with new keys, the step after it and after the load; else skipped
    assert sorted(set(resets)) == [s for s in steps if s % 3 != 2 or s == 11], resets


def test_a_trained_collection_copies_and_pickles_into_one_of_its_own():
    """deepcopy / torch.save of a collection whose arena has stepped: the copy binds the CPU
    loops to its own buffers, trains as the original does, and leaves the original alone."""
    batches = list(_batches(6, batch=24, universe=400, seed=5))
    model = _collection(True, OPTIONS["lru_and_lfu"], RowWiseAdagrad(lr=0.1))
    for features in batches[:3]:
        model(features).values().square().sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    outputs = []
    for twin in copies:
        for features in batches[3:]:
            pooled = twin(features).values()
            outputs.append(pooled.detach())
            pooled.square().sum().backward()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for features in batches[3:]:
        pooled = model(features).values()
        outputs.append(pooled.detach())
        pooled.square().sum().backward()
    n = len(batches) - 3
    for k in range(n):
        assert torch.equal(outputs[k], outputs[2 * n + k]), k
        assert torch.equal(outputs[n + k], outputs[2 * n + k]), k
    assert all(a._loops == key_arena_cpu.available() for a in copies[0]._arenas)
