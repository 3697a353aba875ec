"""Tiered tables train bitwise like the same tables held whole in memory."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.embedding.row_init import initial_rows, table_seed
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.options import StorageOptions

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "rowwise": lambda: RowWiseAdagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.01),
}
ROWS = {"a": 301, "b": 97}
DIM = {"a": 8, "b": 5}
SEED = 7


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=n, embedding_dim=DIM[n], num_embeddings=ROWS[n], feature_names=[f"f_{n}"]
        )
        for n in ROWS
    ]


def batches(steps: int, batch: int = 16, *, keys: bool = False, seed: int = 0):
    """Zipf-ish ids (fixed tables) or raw int64 keys (dynamic)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * batch,), generator=gen)
        values = []
        for t, name in enumerate(ROWS):
            n = int(lengths[t * batch : (t + 1) * batch].sum())
            ranks = torch.multinomial(
                1.0 / torch.arange(1, ROWS[name] + 1, dtype=torch.float64), n, True, generator=gen
            )
            values.append(ranks * 1_000_003 - 5_000_000_000 if keys else ranks)
        out.append(
            KeyedJaggedTensor(keys=["f_a", "f_b"], values=torch.cat(values), lengths=lengths)
        )
    return out


def in_memory_fixed(optimizer) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(configs(), optimizer=optimizer)
    with torch.no_grad():
        for name, rows in ROWS.items():
            seed = table_seed(SEED, name)
            ebc.embedding_bags[name].weight.copy_(
                initial_rows(torch.arange(rows), seed, DIM[name], math.sqrt(1 / rows))
            )
    return ebc


def train(ebc, steps, prefetch: bool = False) -> list[torch.Tensor]:
    pooled = []
    grad_gen = torch.Generator().manual_seed(3)
    for i, kjt in enumerate(steps):
        if prefetch and i == 0:
            ebc.prefetch(kjt)
        out = ebc(kjt).values()
        if prefetch and i + 1 < len(steps):
            ebc.prefetch(steps[i + 1])
            if i % 3 == 2:  # a checkpoint while batch i+1 is prepared: its rows stay dirty
                ebc.flush()
        (out * torch.randn(out.shape, generator=grad_gen)).sum().backward()
        pooled.append(out.detach().clone())
    return pooled


def stored_rows(ebc: TieredEmbeddingBagCollection, name: str):
    """(keys, weights, states...) of every row the tiered table holds, after a flush."""
    ebc.flush()
    cache = ebc.caches[name]
    keys, records = zip(*cache.store.items(1 << 20), strict=True)
    return torch.cat(keys), torch.cat(records)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_fixed_tiered_matches_in_memory(optimizer, tier, tmp_path):
    steps = batches(12)
    reference = in_memory_fixed(OPTIMIZERS[optimizer]())
    storage = StorageOptions(tier=tier, cache_rows=40, path=str(tmp_path), policy="lfu")
    tiered = TieredEmbeddingBagCollection(
        configs(),
        {"a": storage, "b": StorageOptions(tier=tier, cache_rows=33, path=str(tmp_path))},
        OPTIMIZERS[optimizer](),
        seed=SEED,
    )
    expected, got = train(reference, steps), train(tiered, steps, prefetch=True)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    for name in ROWS:
        keys, records = stored_rows(tiered, name)
        bag = reference.embedding_bags[name]
        tensors = [bag.weight.detach()] + [getattr(bag, s) for s in reference.optimizer.states]
        want = tiered.caches[name].codec.encode([t[keys] for t in tensors])
        assert torch.equal(records, want)
    stats = tiered.tiered_stats()["a"]
    assert stats["evicted"] > 0 and stats["written_back"] > 0 and stats["fetched"] > 0


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("admit_after", [0, 2])
def test_dynamic_tiered_matches_in_memory(optimizer, admit_after, tmp_path):
    steps = batches(12, keys=True)
    options = DynamicTableOptions(admit_after=admit_after)
    reference = DynamicEmbeddingBagCollection(
        configs(), options, optimizer=OPTIMIZERS[optimizer](), seed=SEED
    )
    tiered = TieredEmbeddingBagCollection(
        configs(),
        StorageOptions(tier="disk", cache_rows=45, path=str(tmp_path)),
        OPTIMIZERS[optimizer](),
        dynamic={"a": options, "b": options},
        seed=SEED,
    )
    expected, got = train(reference, steps), train(tiered, steps, prefetch=True)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    for name in ROWS:
        keys, records = stored_rows(tiered, name)
        state = reference.table_state(name)
        order = torch.argsort(state[f"dynamic.{name}.keys"])
        assert torch.equal(keys, state[f"dynamic.{name}.keys"][order])
        tensors = [state[f"embedding_bags.{name}.weight"]] + [
            state[f"embedding_bags.{name}.{s}"] for s in reference.optimizer.states
        ]
        want = tiered.caches[name].codec.encode([t[order] for t in tensors])
        assert torch.equal(records, want)
    # Saved and loaded in one process, every key comes back (most keys here are negative).
    (tmp_path / "checkpoint").mkdir()
    tiered.tiered_files().save(tmp_path / "checkpoint")
    loaded = TieredEmbeddingBagCollection(
        configs(),
        StorageOptions(tier="host", cache_rows=45),
        OPTIMIZERS[optimizer](),
        dynamic={"a": options, "b": options},
        seed=SEED,
    )
    loaded.tiered_files().load(tmp_path / "checkpoint")
    for name in ROWS:
        saved_keys, saved = stored_rows(tiered, name)
        keys, records = stored_rows(loaded, name)
        assert bool((saved_keys < 0).any())
        assert torch.equal(keys, saved_keys) and torch.equal(records, saved)


def test_a_checkpoint_of_a_larger_fixed_table_is_refused(tmp_path):
    tiered = TieredEmbeddingBagCollection(
        configs(), StorageOptions(tier="host", cache_rows=60), SGD(lr=0.1), seed=SEED
    )
    train(tiered, batches(3))
    tiered.tiered_files().save(tmp_path)
    smaller = [replace(c, num_embeddings=10) if c.name == "a" else c for c in configs()]
    shrunk = TieredEmbeddingBagCollection(
        smaller, StorageOptions(tier="host", cache_rows=60), SGD(lr=0.1), seed=SEED
    )
    with pytest.raises(ValueError, match="tiered table 'a': the checkpoint holds row \\d+, this"):
        shrunk.tiered_files().load(tmp_path)


def test_a_cache_of_three_rows_grows_and_trains_as_the_table_in_memory(tmp_path):
    tiered = TieredEmbeddingBagCollection(
        configs(), StorageOptions(tier="host", cache_rows=3), SGD(lr=0.1), seed=SEED
    )
    got = train(tiered, batches(4, batch=32), prefetch=True)
    want = train(in_memory_fixed(SGD(lr=0.1)), batches(4, batch=32))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(s["grown"] > 0 for s in tiered.tiered_stats().values())


def test_a_fixed_tables_cache_holds_at_most_its_rows(tmp_path):
    # 256 MiB of cache for tables of 301 and 97 rows: each cache is its table's size, and a
    # cache of every row trains as the table in memory does.
    tiered = TieredEmbeddingBagCollection(
        configs(), StorageOptions(tier="host", cache_mb=256), SGD(lr=0.1), seed=SEED
    )
    assert {name: cache.num_rows for name, cache in tiered.caches.items()} == ROWS
    got = train(tiered, batches(4), prefetch=True)
    want = train(in_memory_fixed(SGD(lr=0.1)), batches(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_prefetch_never_evicts_a_pinned_row(tmp_path):
    """The prefetch of batch i+1 runs while batch i's backward is held open: no row of batch i
    is evicted under it, and training still matches the in-memory table."""
    steps = batches(10)
    unique = [
        max(len(torch.unique(k["f_a"].values())), len(torch.unique(k["f_b"].values())))
        for k in steps
    ]
    rows = max(a + b for a, b in pairwise(unique))  # two batches: the least that works
    tiered = TieredEmbeddingBagCollection(
        configs(),
        StorageOptions(tier="disk", cache_rows=rows, path=str(tmp_path), policy="lfu"),
        RowWiseAdagrad(lr=0.1),
        seed=SEED,
    )
    reference = in_memory_fixed(RowWiseAdagrad(lr=0.1))
    expected = train(reference, steps)
    in_flight: dict[str, torch.Tensor] = {}  # the cache rows of the batch in flight
    for name, cache in tiered.caches.items():
        evict = cache.evict

        def checked(victims, name=name, evict=evict):
            if name in in_flight:
                assert not bool(torch.isin(victims, in_flight[name]).any()), "pinned row evicted"
            evict(victims)

        cache.evict = checked
    got = []
    tiered.prefetch(steps[0])
    grad_gen = torch.Generator().manual_seed(3)
    for i, kjt in enumerate(steps):
        out = tiered(kjt).values()
        for name, cache in tiered.caches.items():
            in_flight[name] = (cache.row_ticket == cache.row_ticket.max()).nonzero().squeeze(1)
        if i + 1 < len(steps):
            tiered.prefetch(steps[i + 1])
        # the next batch's rows are prepared while this batch's rows are still to be updated
        tiered.wait_prefetch()
        (out * torch.randn(out.shape, generator=grad_gen)).sum().backward()
        got.append(out.detach().clone())
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    assert sum(c.stats["evicted"] for c in tiered.caches.values()) > 0


def test_unsupported_dynamic_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'ttl_steps': 5"):
        TieredEmbeddingBagCollection(
            configs(),
            StorageOptions(tier="host", cache_rows=64),
            SGD(lr=0.1),
            dynamic={"a": DynamicTableOptions(ttl_steps=5)},
        )
