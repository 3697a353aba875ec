"""DynamicEmbeddingBagCollection: tables keyed by raw int64 ids.

The central check: with a capacity for every key, a dynamic table trains bitwise like a fixed
table whose rows hold the same initial vectors (each backend, every fused optimizer), growing
on the way. Then what only a dynamic table does: eviction with clean re-admission, admission,
expiry, lookups that never insert, checkpoints by key, and the errors.
"""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.interface import state_to_load
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.embedding.row_init import initial_rows, table_seed

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.05),
}
DIM = 4


def _configs(rows: int = 8, pooling=PoolingType.SUM) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user",
            embedding_dim=DIM,
            num_embeddings=rows,
            feature_names=["u"],
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=2 * DIM,
            num_embeddings=rows,
            feature_names=["i", "j"],
            pooling=pooling,
        ),
    ]


def _kjt(values: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> KeyedJaggedTensor:
    keys = list(values)
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([values[k] for k in keys]),
        lengths=torch.cat([lengths[k] for k in keys]),
    )


def _stream(steps: int, batch: int, vocab: torch.Tensor, seed: int = 0):
    """Batches of raw keys drawn (with heavy repeats) from ``vocab``, per feature u, i, j."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        values, lengths = {}, {}
        for key in ("u", "i", "j"):
            length = torch.randint(0, 4, (batch,), generator=generator)
            ranks = (torch.rand(int(length.sum()), generator=generator) ** 3 * len(vocab)).long()
            values[key], lengths[key] = vocab[ranks], length
        yield values, lengths


def _fixed_twin(dynamic: DynamicEmbeddingBagCollection, vocab: torch.Tensor, optimizer, backend):
    """A fixed collection whose row r of each table is the initial row of key vocab[r]."""
    configs = _configs(rows=len(vocab))
    fixed = EmbeddingBagCollection(configs, backend=backend, optimizer=optimizer)
    with torch.no_grad():
        for config in configs:
            table = dynamic.dynamic[config.name]
            fixed.embedding_bags[config.name].weight.copy_(
                initial_rows(vocab, table.seed, config.embedding_dim, table.bound)
            )
    return fixed


def _random_keys(n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=generator, dtype=torch.int64) * 2 + 1
    return keys.unique()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trains_like_a_fixed_table_with_the_same_initial_rows(backend, name):
    vocab = _random_keys(300)
    dynamic = DynamicEmbeddingBagCollection(
        _configs(rows=8),  # grows 8 -> ... -> 512 slots on the way
        DynamicTableOptions(bucket_size=8),
        backend=backend,
        optimizer=OPTIMIZERS[name](),
        seed=3,
    )
    fixed = _fixed_twin(dynamic, vocab, OPTIMIZERS[name](), backend)
    index = {int(k): r for r, k in enumerate(vocab)}
    for values, lengths in _stream(6, 16, vocab):
        rows = {k: torch.tensor([index[int(v)] for v in vals]) for k, vals in values.items()}
        out_dynamic = dynamic(_kjt(values, lengths)).values()
        out_fixed = fixed(_kjt(rows, lengths)).values()
        assert torch.equal(out_dynamic, out_fixed)
        (out_dynamic * torch.arange(out_dynamic.numel()).view_as(out_dynamic)).sum().backward()
        (out_fixed * torch.arange(out_fixed.numel()).view_as(out_fixed)).sum().backward()
    state = dynamic.state_dict()
    assert dynamic.dynamic["item"].map.capacity > 8
    for config in _configs():
        keys = state[f"dynamic.{config.name}.keys"]
        rows = torch.tensor([index[int(k)] for k in keys])
        for suffix in ["weight", *OPTIMIZERS[name]().states]:
            saved = state[f"embedding_bags.{config.name}.{suffix}"]
            expected = getattr(fixed.embedding_bags[config.name], suffix)[rows]
            assert torch.equal(saved, expected), (config.name, suffix)


def test_initial_rows_depend_only_on_seed_table_and_key():
    keys = _random_keys(50)
    seed = table_seed(7, "user")
    rows = initial_rows(keys, seed, DIM, 0.5)
    assert torch.equal(initial_rows(keys.flip(0), seed, DIM, 0.5), rows.flip(0))
    assert torch.equal(initial_rows(keys[10:20], seed, DIM, 0.5), rows[10:20])
    assert not torch.equal(initial_rows(keys, table_seed(7, "item"), DIM, 0.5), rows)
    assert not torch.equal(initial_rows(keys, table_seed(8, "user"), DIM, 0.5), rows)
    assert rows.abs().max() <= 0.5 and rows.std() > 0.2


def _one_table(options: DynamicTableOptions, optimizer=None, **kwargs):
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=4, feature_names=["f"])
    return DynamicEmbeddingBagCollection(
        [config], options, optimizer=optimizer or Adam(lr=0.1), **kwargs
    )


def _bags(ebc, keys: list[int], train: bool = True) -> torch.Tensor:
    """One bag per key; a training step (sum of outputs as the loss) when ``train``."""
    ebc.train(train)
    kjt = KeyedJaggedTensor(
        keys=["f"],
        values=torch.tensor(keys, dtype=torch.int64),
        lengths=torch.ones(len(keys)).long(),
    )
    out = ebc(kjt).values()
    if train:
        out.sum().backward()
    return out.detach()


def _row(ebc, key: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    state = ebc.state_dict()
    keys = state["dynamic.t.keys"].tolist()
    if key not in keys:
        return None
    r = keys.index(key)
    return state["embedding_bags.t.weight"][r], {
        s: state[f"embedding_bags.t.{s}"][r] for s in ebc.optimizer.states
    }


def test_an_evicted_key_comes_back_with_its_initial_row_and_fresh_state():
    # One bucket of 4 slots, capped: the fifth key evicts the least recently seen one.
    ebc = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    table = ebc.dynamic["t"]
    initial = table.fresh_rows(torch.tensor([10]), torch.float32)[0]
    for _ in range(3):
        _bags(ebc, [10, 11])
    trained, state = _row(ebc, 10)
    assert not torch.equal(trained, initial) and state["exp_avg"].abs().sum() > 0
    _bags(ebc, [12, 13])
    _bags(ebc, [14, 15])  # full: evicts 10 and 11 (oldest), never 12 or 13 (this batch's own? no:
    assert _row(ebc, 10) is None and _row(ebc, 14) is not None
    assert ebc.dynamic_stats()["t"]["evictions"] == 2
    out = _bags(ebc, [10], train=False)  # eval: looked up, not inserted: zeros
    assert torch.equal(out, torch.zeros(1, DIM)) and _row(ebc, 10) is None
    out = _bags(ebc, [10])  # back: its initial row, zero moments
    assert torch.equal(out[0], initial)
    weight, state = _row(ebc, 10)
    expected = Adam(lr=0.1).update(
        initial.double().view(1, -1),
        torch.ones(1, DIM, dtype=torch.float64),
        {
            "exp_avg": torch.zeros(1, DIM, dtype=torch.float64),
            "exp_avg_sq": torch.zeros(1, DIM, dtype=torch.float64),
        },
        int(ebc.optimizer_step),
    )
    assert torch.allclose(weight.double(), expected[0], atol=1e-6)


def test_a_batch_never_evicts_its_own_keys():
    ebc = _one_table(DynamicTableOptions(max_capacity=4, bucket_size=4))
    _bags(ebc, [1, 2, 3, 4])
    _bags(ebc, [1, 2, 5, 6])  # 5 and 6 evict 3 and 4, the only keys not in this batch
    keys = ebc.state_dict()["dynamic.t.keys"].sort().values.tolist()
    assert keys == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="5 distinct keys.*at most 4 rows"):
        _bags(ebc, [1, 2, 5, 6, 7])  # five distinct keys for four slots
    assert ebc.state_dict()["dynamic.t.keys"].sort().values.tolist() == [
        1,
        2,
        5,
        6,
    ]  # nothing changed


def test_more_distinct_keys_than_the_cap_is_an_error():
    ebc = _one_table(DynamicTableOptions(max_capacity=8, bucket_size=4))
    with pytest.raises(ValueError, match="'t'.*distinct keys"):
        _bags(ebc, list(range(100, 120)))


def test_admission_after_n_sightings_pools_zeros_until_then():
    ebc = _one_table(DynamicTableOptions(admit_after=3))
    for seen in (1, 2):
        out = _bags(ebc, [42, 7 + seen])
        assert torch.equal(out[0], torch.zeros(DIM)) and _row(ebc, 42) is None
    assert ebc.dynamic_stats()["t"]["rejected"] > 0
    out = _bags(ebc, [42])  # third and fourth sighting: admitted
    assert torch.equal(out[0], ebc.dynamic["t"].fresh_rows(torch.tensor([42]), torch.float32)[0])
    assert _row(ebc, 42) is not None and _row(ebc, 7) is None
    # The zero row stayed zero: rejected keys were trained against it, without effect.
    assert torch.equal(_bags(ebc, [99], train=False), torch.zeros(1, DIM))


def test_rows_not_seen_for_ttl_steps_expire():
    ebc = _one_table(DynamicTableOptions(ttl_steps=2))
    _bags(ebc, [1, 2])
    _bags(ebc, [2])
    _bags(ebc, [2])
    assert _row(ebc, 1) is not None
    _bags(ebc, [2])  # step 4: key 1 last seen at step 1, 3 steps ago
    assert _row(ebc, 1) is None and _row(ebc, 2) is not None
    assert ebc.dynamic_stats()["t"]["expirations"] == 1


def test_eval_and_frozen_lookups_never_insert():
    ebc = _one_table(DynamicTableOptions())
    _bags(ebc, [5])
    before = ebc.dynamic_stats()["t"]["size"]
    out = _bags(ebc, [5, 6], train=False)
    assert torch.equal(out[1], torch.zeros(DIM)) and not torch.equal(out[0], torch.zeros(DIM))
    frozen = _one_table(DynamicTableOptions())
    frozen.set_optimizer(None)
    frozen.requires_grad_(False)
    frozen.train()
    assert torch.equal(frozen(_kjt1([5])).values(), torch.zeros(1, DIM))
    assert ebc.dynamic_stats()["t"]["size"] == before and frozen.dynamic_stats()["t"]["size"] == 0


def _kjt1(keys):
    return KeyedJaggedTensor(
        keys=["f"], values=torch.tensor(keys), lengths=torch.ones(len(keys), dtype=torch.int64)
    )


@pytest.mark.parametrize("admit_after", [0, 2])
def test_state_dict_round_trip_resumes_bitwise(admit_after):
    vocab = _random_keys(200)
    options = DynamicTableOptions(bucket_size=16, max_capacity=128, admit_after=admit_after)

    def build():
        return DynamicEmbeddingBagCollection(
            _configs(rows=8), options, optimizer=RowWiseAdagrad(lr=0.1), backend="torch", seed=1
        )

    def step(ebc, values, lengths):
        out = ebc(_kjt(values, lengths)).values()
        (out * out).sum().backward()
        return out.detach()

    batches = list(_stream(8, 8, vocab, seed=5))
    straight = build()
    outputs = [step(straight, *b) for b in batches]
    first = build()
    for b in batches[:4]:
        step(first, *b)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    shapes = {k: v.shape for k, v in saved.items()}
    resumed = build()
    target = state_to_load(resumed, shapes)
    assert {k: v.shape for k, v in target.items()} == shapes
    resumed.load_state_dict(saved)
    for b, expected in zip(batches[4:], outputs[4:], strict=True):
        assert torch.equal(step(resumed, *b), expected)
    final, other = straight.state_dict(), resumed.state_dict()
    assert final.keys() == other.keys()
    for key in final:
        assert torch.equal(final[key], other[key]), key


def test_bad_keys_and_options_are_clear_errors():
    ebc = _one_table(DynamicTableOptions())
    with pytest.raises(ValueError, match="reserved"):
        _bags(ebc, [-(2**63)])
    with pytest.raises(ValueError, match="ttl_steps=-1"):
        DynamicTableOptions(ttl_steps=-1)
    with pytest.raises(ValueError, match="'usr'.*did you mean 'user'"):
        DynamicEmbeddingBagCollection(_configs(), {"usr": DynamicTableOptions()})
    with pytest.raises(ValueError, match="fused optimizer"):
        DynamicEmbeddingBagCollection(_configs(), DynamicTableOptions()).trainable_parameters()


def test_mixed_fixed_and_dynamic_tables_and_stats():
    ebc = DynamicEmbeddingBagCollection(
        _configs(rows=16), {"item": DynamicTableOptions()}, optimizer=SGD(lr=0.1)
    )
    values = {"u": torch.tensor([1, 15]), "i": torch.tensor([10**15, -3]), "j": torch.tensor([7])}
    lengths = {"u": torch.tensor([1, 1]), "i": torch.tensor([2, 0]), "j": torch.tensor([0, 1])}
    ebc(_kjt(values, lengths)).values().sum().backward()
    stats = ebc.dynamic_stats()
    assert list(stats) == ["item"]
    assert stats["item"]["size"] == 3 and stats["item"]["inserts"] == 3
    assert ebc.state_dict()["embedding_bags.user.weight"].shape == (16, DIM)
    with pytest.raises(ValueError, match="out of range|past|outside"):
        ebc(_kjt({**values, "u": torch.tensor([1, 16])}, lengths))


def test_a_checkpoint_of_another_routing_or_score_policy_is_refused():
    ebc = _one_table(DynamicTableOptions(routing_buckets=16))
    _bags(ebc, [1, 2, 3, 40, -7])
    state = ebc.state_dict()
    # saved in (routing bucket, key) order, with the keys per bucket
    keys, counts = state["dynamic.t.keys"], state["dynamic.t.bucket_counts"]
    assert sorted(keys.tolist()) == [-7, 1, 2, 3, 40] and int(counts.sum()) == 5
    routing = ebc.dynamic["t"].routing
    assert routing.buckets(keys).tolist() == sorted(routing.buckets(keys).tolist())
    other = _one_table(DynamicTableOptions(routing_buckets=32))
    with pytest.raises(ValueError, match="routing_buckets 16 there, 32 here"):
        other.load_state_dict(state_to_load_like(other, state))
    lfu = _one_table(DynamicTableOptions(routing_buckets=16, score="lfu"))
    with pytest.raises(ValueError, match="score 'lru' there, 'lfu' here"):
        lfu.load_state_dict(state_to_load_like(lfu, state))
    same = _one_table(DynamicTableOptions(routing_buckets=16))
    same.load_state_dict(state_to_load_like(same, state))
    assert torch.equal(same.state_dict()["dynamic.t.keys"], keys)


def state_to_load_like(ebc, state: dict) -> dict:
    """``state`` as a checkpoint would hand it to ``ebc`` (its own sizes)."""
    target = state_to_load(ebc, {k: v.shape for k, v in state.items()})
    for key, value in state.items():
        target[key] = value
    return target
