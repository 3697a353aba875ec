"""DynamicEmbeddingBagCollection.take_delta: the keys trained since the previous delta with their
rows, and the keys that lost their row (evicted, expired) since; a load is the new baseline.

The central check: a replica that starts empty and applies every delta (deletions, then
upserts) holds exactly the table's keys and rows, through growth, evictions and expiry.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import Adam, RowWiseAdagrad

DIM = 4


def _one_table(options: DynamicTableOptions) -> DynamicEmbeddingBagCollection:
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=4, feature_names=["f"])
    return DynamicEmbeddingBagCollection([config], options, optimizer=Adam(lr=0.1))


def _train(ebc: DynamicEmbeddingBagCollection, keys: list[int]) -> None:
    """One training step, one bag per key."""
    ebc.train()
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor(keys), lengths=torch.ones(len(keys), dtype=torch.int64)
    )
    (ebc(kjt).values() ** 2).sum().backward()


def _rows(ebc: DynamicEmbeddingBagCollection, name: str = "t") -> dict[int, torch.Tensor]:
    """The table's live keys and their rows, from its checkpoint state."""
    state = ebc.state_dict()
    keys = state[f"dynamic.{name}.keys"].tolist()
    return dict(zip(keys, state[f"embedding_bags.{name}.weight"], strict=True))


def _last_seen(ebc: DynamicEmbeddingBagCollection, name: str = "t") -> dict[int, int]:
    state = ebc.state_dict()
    keys, last_seen = state[f"dynamic.{name}.keys"], state[f"dynamic.{name}.last_seen"]
    return dict(zip(keys.tolist(), last_seen.tolist(), strict=True))


def test_a_delta_holds_the_keys_trained_since_the_previous_one():
    ebc = _one_table(DynamicTableOptions())
    _train(ebc, [3, 1, 2])
    _train(ebc, [2])
    delta = ebc.take_delta()["t"]
    assert delta.keys.tolist() == [1, 2, 3] and delta.deleted.tolist() == []
    assert delta.last_seen.tolist() == [1, 2, 1]
    rows = _rows(ebc)
    assert torch.equal(delta.weights, torch.stack([rows[k] for k in (1, 2, 3)]))
    _train(ebc, [4, 2])
    _train(ebc, [4])
    delta = ebc.take_delta()["t"]
    assert delta.keys.tolist() == [2, 4] and delta.last_seen.tolist() == [3, 4]
    rows = _rows(ebc)
    assert torch.equal(delta.weights, torch.stack([rows[2], rows[4]]))
    empty = ebc.take_delta()["t"]  # nothing trained since
    assert empty.keys.tolist() == [] and empty.weights.shape == (0, DIM)
    assert empty.deleted.tolist() == []


def test_evicted_and_expired_keys_are_deleted():
    capped = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    capped.take_delta()  # starts recording deletions
    _train(capped, [1, 2, 3, 4])
    assert capped.take_delta()["t"].keys.tolist() == [1, 2, 3, 4]
    _train(capped, [5, 6])  # full: evicts the two lowest (last seen, key): 1 and 2
    delta = capped.take_delta()["t"]
    assert delta.keys.tolist() == [5, 6] and delta.deleted.tolist() == [1, 2]
    expiring = _one_table(DynamicTableOptions(ttl_steps=1))
    expiring.take_delta()
    _train(expiring, [1, 2])
    expiring.take_delta()
    _train(expiring, [2])
    _train(expiring, [2])  # step 3: key 1, last seen at step 1, expires
    delta = expiring.take_delta()["t"]
    assert delta.keys.tolist() == [2] and delta.deleted.tolist() == [1]
    assert expiring.dynamic_stats()["t"]["expirations"] == 1


def test_a_key_evicted_and_back_before_the_delta_is_an_update():
    ebc = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    ebc.take_delta()
    _train(ebc, [1, 2, 3, 4])
    ebc.take_delta()
    _train(ebc, [5])  # evicts 1
    _train(ebc, [1])  # back (a fresh row), evicting 2
    delta = ebc.take_delta()["t"]
    assert delta.keys.tolist() == [1, 5] and delta.deleted.tolist() == [2]
    assert torch.equal(delta.weights[0], _rows(ebc)[1])
    assert ebc.dynamic_stats()["t"]["evictions"] == 2


def _stream_batches(steps: int, seed: int):
    """Batches of raw keys per feature u, i, j: a heavy head and a long tail of new keys."""
    generator = torch.Generator().manual_seed(seed)
    vocab = torch.randint(-(2**62), 2**62, (400,), generator=generator)
    for _ in range(steps):
        values, lengths = [], []
        for _ in ("u", "i", "j"):
            length = torch.randint(0, 4, (12,), generator=generator)
            ranks = (torch.rand(int(length.sum()), generator=generator) ** 2 * len(vocab)).long()
            values.append(vocab[ranks])
            lengths.append(length)
        yield KeyedJaggedTensor(
            keys=["u", "i", "j"], values=torch.cat(values), lengths=torch.cat(lengths)
        )


def _apply(replica: dict[int, torch.Tensor], delta) -> None:
    for key in delta.deleted.tolist():
        replica.pop(key, None)  # absent: a key that got its row after the previous delta
    for key, row in zip(delta.keys.tolist(), delta.weights, strict=True):
        replica[key] = row.clone()


@pytest.mark.filterwarnings("ignore:table .* is at its maximum")
@pytest.mark.parametrize("every", [1, 3])
def test_a_replica_applying_every_delta_holds_the_tables(every):
    configs = [
        EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=8, feature_names=["u"]),
        EmbeddingBagConfig(
            name="item", embedding_dim=2 * DIM, num_embeddings=8, feature_names=["i", "j"]
        ),
    ]
    options = {
        "user": DynamicTableOptions(max_capacity=32, bucket_size=8, ttl_steps=2),
        "item": DynamicTableOptions(max_capacity=64, bucket_size=8, score="lfu"),
    }
    ebc = DynamicEmbeddingBagCollection(configs, options, optimizer=RowWiseAdagrad(lr=0.1))
    ebc.take_delta()
    replicas = {"user": {}, "item": {}}
    for step, kjt in enumerate(_stream_batches(12, seed=every), start=1):
        ebc.train()
        ebc(kjt).values().sum().backward()
        if step % every == 0:
            for name, delta in ebc.take_delta().items():
                assert delta.keys.tolist() == sorted(delta.keys.tolist())
                assert not set(delta.keys.tolist()) & set(delta.deleted.tolist())
                _apply(replicas[name], delta)
    stats = ebc.dynamic_stats()
    assert stats["user"]["expirations"] > 0 and stats["item"]["evictions"] > 0
    for name, replica in replicas.items():
        rows = _rows(ebc, name)
        assert sorted(replica) == sorted(rows)
        for key, row in rows.items():
            assert torch.equal(replica[key], row)


def test_a_load_is_the_baseline_of_the_next_delta():
    ebc = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    ebc.take_delta()
    _train(ebc, [1, 2, 3])
    _train(ebc, [4])
    saved = {k: v.clone() for k, v in ebc.state_dict().items()}
    loaded = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    loaded.load_state_dict(saved)
    delta = loaded.take_delta()["t"]  # starts from the loaded state: nothing changed
    assert delta.keys.tolist() == [] and delta.deleted.tolist() == []
    _train(loaded, [4, 5])  # evicts 1
    delta = loaded.take_delta()["t"]
    assert delta.keys.tolist() == [4, 5] and delta.deleted.tolist() == [1]
    assert _last_seen(loaded)[5] == 3
    # Loading again resets a collection that was taking deltas: what it recorded is dropped.
    _train(loaded, [6])  # evicts 2
    loaded.load_state_dict(saved)
    delta = loaded.take_delta()["t"]
    assert delta.keys.tolist() == [] and delta.deleted.tolist() == []


def test_nothing_is_recorded_before_the_first_delta():
    fresh = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    _train(fresh, [1, 2, 3, 4])
    _train(fresh, [5, 6])  # evicts 1 and 2, unrecorded: no delta was taken
    delta = fresh.take_delta()["t"]  # since the build: the base is empty, nothing to delete
    assert delta.keys.tolist() == [3, 4, 5, 6] and delta.deleted.tolist() == []
    saved = {k: v.clone() for k, v in fresh.state_dict().items()}
    loaded = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    loaded.load_state_dict(saved)
    _train(loaded, [7])  # evicts 3, a key of the loaded state, before any delta: unrecorded
    with pytest.warns(UserWarning, match="'t': 1 key.*lost their row after it was loaded"):
        delta = loaded.take_delta()["t"]
    assert delta.keys.tolist() == [7] and delta.deleted.tolist() == []
    _train(loaded, [8])  # recorded from now on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded.take_delta()["t"].deleted.tolist() == [4]
