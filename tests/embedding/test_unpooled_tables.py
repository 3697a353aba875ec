"""Dynamic and tiered tables in the unpooled EmbeddingCollection: each trains bitwise like a
fixed EmbeddingCollection holding the same initial rows (every fused optimizer), growing /
evicting on the way, and a saved state resumes bitwise."""

from __future__ import annotations

import math

import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.interface import state_to_load
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.embedding.row_init import initial_rows, table_seed
from recsys.embedding.tiered.options import StorageOptions
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.embedding.unpooled_tables import DynamicEmbeddingCollection, TieredEmbeddingCollection

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.05),
}
SEED = 3
ROWS = 150  # distinct keys / rows per table


def _configs(rows: int) -> list[EmbeddingConfig]:
    """Two tables of other dims; "item" serves two features (as a sequence model's does)."""
    return [
        EmbeddingConfig(
            name="item", embedding_dim=8, num_embeddings=rows, feature_names=["h", "c"]
        ),
        EmbeddingConfig(name="user", embedding_dim=5, num_embeddings=rows, feature_names=["u"]),
    ]


def _vocab() -> torch.Tensor:
    """ROWS distinct raw keys, negative ones among them."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randint(-(2**62), 2**62, (4 * ROWS,), generator=generator).unique()
    return keys[torch.randperm(len(keys), generator=generator)[:ROWS]]


def _stream(steps: int, batch: int = 6, seed: int = 0):
    """(rows per feature, lengths per feature) with heavy repeats: rows index the vocab."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 7, (3 * batch,), generator=generator)
        lengths[::4] = 0  # empty sequences
        ranks = (torch.rand(int(lengths.sum()), generator=generator) ** 3 * ROWS).long()
        yield ranks, lengths


def _kjt(values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["h", "c", "u"], values=values, lengths=lengths)


def _fixed_twin(optimizer, key_of_row: torch.Tensor, bound) -> EmbeddingCollection:
    """A fixed collection whose row r of each table is the initial row of key key_of_row[r]."""
    fixed = EmbeddingCollection(_configs(ROWS), optimizer=optimizer, backend="torch")
    with torch.no_grad():
        for config in _configs(ROWS):
            seed = table_seed(SEED, config.name)
            fixed.embeddings[config.name].weight.copy_(
                initial_rows(key_of_row, seed, config.embedding_dim, bound(config.name))
            )
    return fixed


def _train(collection, batches, to_ids, first_step: int = 0) -> list[torch.Tensor]:
    """Each batch's rows (flat), after a backward of random weights drawn by step."""
    out = []
    for step, (ranks, lengths) in enumerate(batches, first_step):
        generator = torch.Generator().manual_seed(step)
        looked_up = collection(_kjt(to_ids(ranks), lengths))
        rows = torch.cat([looked_up[name].values().flatten() for name in ("h", "c", "u")])
        (rows * torch.randn(rows.shape, generator=generator)).sum().backward()
        out.append(rows.detach().clone())
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_dynamic_trains_like_a_fixed_collection_with_the_same_initial_rows(name):
    vocab = _vocab()
    dynamic = DynamicEmbeddingCollection(
        _configs(8),  # grows 8 -> 256 slots on the way
        DynamicTableOptions(bucket_size=8),
        optimizer=OPTIMIZERS[name](),
        backend="torch",
        seed=SEED,
    )
    tables = dynamic.dynamic
    fixed = _fixed_twin(OPTIMIZERS[name](), vocab, lambda t: tables[t].bound)
    batches = list(_stream(8))
    got = _train(dynamic, batches, lambda ranks: vocab[ranks])
    expected = _train(fixed, batches, lambda ranks: ranks)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert dynamic.dynamic["item"].map.capacity > 8
    state = dynamic.state_dict()
    index = {int(k): r for r, k in enumerate(vocab)}
    for config in _configs(ROWS):
        keys = state[f"dynamic.{config.name}.keys"]
        rows = torch.tensor([index[int(k)] for k in keys])
        for suffix in ["weight", *OPTIMIZERS[name]().states]:
            saved = state[f"embeddings.{config.name}.{suffix}"]
            want = getattr(fixed.embeddings[config.name], suffix)[rows]
            assert torch.equal(saved, want), (config.name, suffix)
    seen = torch.cat([vocab[r[: int(n[: 2 * len(n) // 3].sum())]] for r, n in batches]).unique()
    assert torch.equal(dynamic.live_keys("item"), seen)  # ascending: every key trained


def test_live_keys_are_listed_again_only_after_the_map_changes(monkeypatch):
    """A training step that inserts nothing leaves live_keys as it was (the same tensor, the
    live slots not listed again); new keys and a load list them again."""
    dynamic = DynamicEmbeddingCollection(
        _configs(8), DynamicTableOptions(), optimizer=Adam(lr=0.1), backend="torch", seed=SEED
    )
    vocab = _vocab()
    listed = []
    entries = SlotMap.entries
    monkeypatch.setattr(SlotMap, "entries", lambda m: (listed.append(m.name), entries(m))[1])

    def step(keys: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([len(keys), 0, 0])
        dynamic(KeyedJaggedTensor(keys=["h", "c", "u"], values=keys, lengths=lengths))
        return dynamic.live_keys("item")

    first = step(vocab[:5])
    assert step(vocab[:3]) is first and step(vocab[1:4]) is first and listed == ["item"]
    grown = step(vocab[3:8])  # new keys
    assert torch.equal(grown, vocab[:8].sort().values) and len(listed) == 2
    dynamic.load_state_dict(dynamic.state_dict())
    listed.clear()
    assert torch.equal(dynamic.live_keys("item"), grown) and listed == ["item"]


def test_dynamic_lookups_outside_training_read_the_zero_row_and_insert_nothing():
    dynamic = DynamicEmbeddingCollection(
        _configs(8), DynamicTableOptions(), optimizer=Adam(lr=0.1), backend="torch", seed=SEED
    )
    vocab = _vocab()
    trained = vocab[:5]
    lengths = torch.tensor([5, 0, 0])
    dynamic(KeyedJaggedTensor(keys=["h", "c", "u"], values=trained, lengths=lengths))
    dynamic.eval()
    asked = torch.cat([trained[:2], vocab[10:12]])
    out = dynamic(
        KeyedJaggedTensor(keys=["h", "c", "u"], values=asked, lengths=torch.tensor([4, 0, 0]))
    )
    rows = out["h"].values()
    assert rows[:2].abs().sum() > 0 and torch.equal(rows[2:], torch.zeros(2, 8))
    assert torch.equal(dynamic.live_keys("item"), trained.sort().values)
    assert dynamic.live_keys("user").numel() == 0


def test_dynamic_state_dict_resumes_bitwise():
    vocab = _vocab()

    def build():
        return DynamicEmbeddingCollection(
            _configs(8),
            DynamicTableOptions(bucket_size=16, max_capacity=64),  # evicts on the way
            optimizer=RowWiseAdagrad(lr=0.1),
            backend="torch",
            seed=SEED,
        )

    batches = list(_stream(8, seed=2))
    to_ids = lambda ranks: vocab[ranks]  # noqa: E731
    straight = build()
    expected = _train(straight, batches, to_ids)
    first = build()
    _train(first, batches[:4], to_ids)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = build()
    target = state_to_load(resumed, {k: v.shape for k, v in saved.items()})
    assert {k: v.shape for k, v in target.items()} == {k: v.shape for k, v in saved.items()}
    resumed.load_state_dict(saved)
    got = _train(resumed, batches[4:], to_ids, 4)
    for g, e in zip(got, expected[4:], strict=True):
        assert torch.equal(g, e)
    assert straight.dynamic_stats()["item"]["evictions"] > 0
    final, other = straight.state_dict(), resumed.state_dict()
    assert final.keys() == other.keys()
    for key in final:
        assert torch.equal(final[key], other[key]), key


@pytest.mark.parametrize(
    ("name", "tier"),
    [("sgd", "host"), ("adagrad", "disk"), ("rowwise_adagrad", "host"), ("adam", "disk")],
)
def test_tiered_trains_like_a_fixed_collection_with_the_same_initial_rows(name, tier, tmp_path):
    storage = StorageOptions(tier=tier, cache_rows=48, path=str(tmp_path))
    tiered = TieredEmbeddingCollection(
        _configs(ROWS), storage, OPTIMIZERS[name](), backend="torch", seed=SEED
    )
    fixed = _fixed_twin(OPTIMIZERS[name](), torch.arange(ROWS), lambda t: math.sqrt(1 / ROWS))
    batches = list(_stream(10))
    got = _train(tiered, batches, lambda ranks: ranks)
    expected = _train(fixed, batches, lambda ranks: ranks)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    stats = tiered.tiered_stats()["item"]
    assert stats["evicted"] > 0 and stats["fetched"] > 0
    # Outside training, more distinct ids than the cache holds: looked up in runs that fit.
    tiered.eval()
    every = torch.arange(ROWS)
    out = tiered(
        KeyedJaggedTensor(keys=["h", "c", "u"], values=every, lengths=torch.tensor([0, ROWS, 0]))
    )
    assert torch.equal(out["c"].values(), fixed.embeddings["item"].weight.detach())
    # The stored rows (after a flush) are the fixed collection's.
    tiered.flush()
    keys, records = zip(*tiered.caches["item"].store.items(1 << 20), strict=True)
    keys = torch.cat(keys)
    table = fixed.embeddings["item"]
    tensors = [table.weight.detach()] + [getattr(table, s) for s in fixed.optimizer.states]
    want = tiered.caches["item"].codec.encode([t[keys] for t in tensors])
    assert torch.equal(torch.cat(records), want)
    assert "embeddings.item.weight" not in tiered.state_dict()  # streamed, not in the state


def test_tiered_checkpoint_resumes_bitwise(tmp_path):
    def build(path):
        storage = StorageOptions(tier="disk", cache_rows=48, path=str(path))
        return TieredEmbeddingCollection(
            _configs(ROWS), storage, Adam(lr=0.05), backend="torch", seed=SEED
        )

    batches = list(_stream(8, seed=4))
    same = lambda ranks: ranks  # noqa: E731
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    straight = build(tmp_path / "a")
    expected = _train(straight, batches, same)
    first = build(tmp_path / "b")
    _train(first, batches[:4], same)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    first.tiered_files().save(checkpoint)
    state = first.state_dict()
    resumed = build(tmp_path / "c")
    resumed.load_state_dict(state)
    resumed.tiered_files().load(checkpoint)
    got = _train(resumed, batches[4:], same, 4)
    for g, e in zip(got, expected[4:], strict=True):
        assert torch.equal(g, e)


def test_keys_without_a_row_read_zeros_after_a_step_that_updated_the_zero_row():
    """Keys not admitted yet train the zero row until the next training lookup resets it: a
    lookup outside training right after that step still reads zeros for keys without a row."""
    dynamic = DynamicEmbeddingCollection(
        _configs(8),
        DynamicTableOptions(admit_after=2),
        optimizer=Adam(lr=0.1),
        backend="torch",
        seed=SEED,
    )
    vocab = _vocab()
    lengths = torch.tensor([4, 0, 0])
    kjt = KeyedJaggedTensor(keys=["h", "c", "u"], values=vocab[:4], lengths=lengths)
    dynamic(kjt)["h"].values().sum().backward()  # seen once: not admitted, the zero row read
    assert dynamic.embeddings["item"].weight[-1].abs().sum() > 0  # the update moved it
    dynamic.eval()
    out = dynamic(kjt)["h"].values()
    assert torch.equal(out, torch.zeros(4, 8))


@pytest.mark.parametrize(
    ("name", "tier"), [pytest.param("adagrad", "host", marks=pytest.mark.slow), ("adam", "disk")]
)
def test_tiered_dynamic_trains_like_a_fixed_collection_with_the_same_initial_rows(
    name, tier, tmp_path
):
    """Tables both tiered and dynamic: raw keys behind a cache smaller than the keys trained,
    bitwise the fixed collection whose row r is key vocab[r]'s initial row; ``live_keys`` is
    every key trained (in the store or the cache); a key without a row reads zeros."""
    storage = StorageOptions(tier=tier, cache_rows=48, path=str(tmp_path))
    dynamic = dict.fromkeys(["item", "user"], DynamicTableOptions())
    tiered = TieredEmbeddingCollection(
        _configs(ROWS), storage, OPTIMIZERS[name](), dynamic, backend="torch", seed=SEED
    )
    vocab = _vocab()
    fixed = _fixed_twin(OPTIMIZERS[name](), vocab, lambda t: math.sqrt(1 / ROWS))
    batches = list(_stream(10))
    got = _train(tiered, batches, lambda ranks: vocab[ranks])
    expected = _train(fixed, batches, lambda ranks: ranks)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert tiered.tiered_stats()["item"]["evicted"] > 0
    seen = torch.cat([vocab[r[: int(n[: 2 * len(n) // 3].sum())]] for r, n in batches]).unique()
    assert torch.equal(tiered.live_keys("item"), seen)
    tiered.eval()
    unknown = torch.tensor([123456789])
    asked = torch.cat([seen, unknown])
    lengths = torch.tensor([0, len(asked), 0])
    out = tiered(KeyedJaggedTensor(keys=["h", "c", "u"], values=asked, lengths=lengths))["c"]
    index = {int(k): r for r, k in enumerate(vocab)}
    rows = torch.tensor([index[int(k)] for k in seen])
    assert torch.equal(out.values()[:-1], fixed.embeddings["item"].weight.detach()[rows])
    assert torch.equal(out.values()[-1], torch.zeros(8))
    assert torch.equal(tiered.live_keys("item"), seen)  # the lookup inserted nothing
    assert tiered.live_keys("nothing") is None
