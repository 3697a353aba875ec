"""recsys.EmbeddingBagCollection against torchrec.EmbeddingBagCollection with the same weights."""

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from recsys import EmbeddingBagCollection


def tables(pooling=PoolingType.SUM, shared=True):
    return [
        EmbeddingBagConfig(
            name="user",
            embedding_dim=4,
            num_embeddings=20,
            pooling=pooling,
            feature_names=["user_id", "friend_id"] if shared else ["user_id"],
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=7,
            num_embeddings=1,
            pooling=pooling,  # one-row table
            feature_names=["item_id"],
        ),
        EmbeddingBagConfig(
            name="genre",
            embedding_dim=3,
            num_embeddings=9,
            pooling=pooling,
            feature_names=["genre"],
        ),
    ]


def random_kjt(keys, sizes, batch_size=6, weighted=False, empty=("genre",)):
    lengths = {k: torch.randint(0, 4, (batch_size,)) for k in keys}
    for k in empty:
        if k in lengths:
            lengths[k][::2] = 0  # empty bags
    values = [torch.randint(0, sizes[k], (int(lengths[k].sum()),)) for k in keys]
    values = torch.cat(values)
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=torch.cat([lengths[k] for k in keys]),
        weights=torch.rand(values.numel()) if weighted else None,
    )


SIZES = {"user_id": 20, "friend_id": 20, "item_id": 1, "genre": 9, "unused": 5}


BACKENDS = ["torch", "triton"]


def pair(configs, weighted=False, backend="auto"):
    ours = EmbeddingBagCollection(configs, is_weighted=weighted, backend=backend)
    theirs = torchrec.EmbeddingBagCollection(configs, is_weighted=weighted)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def assert_same_output(ours, theirs, kjt):
    a, b = ours(kjt), theirs(kjt)
    assert a.keys() == b.keys()
    assert a.length_per_key() == b.length_per_key()
    torch.testing.assert_close(a.values(), b.values(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_matches_torchrec(pooling, backend):
    ours, theirs = pair(tables(pooling), backend=backend)
    kjt = random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES)
    assert_same_output(ours, theirs, kjt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torchrec_weighted(backend):
    ours, theirs = pair(tables(PoolingType.SUM), weighted=True, backend=backend)
    kjt = random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES, weighted=True)
    assert_same_output(ours, theirs, kjt)


def test_keys_in_any_order_and_extra_keys_ignored():
    ours, theirs = pair(tables())
    kjt = random_kjt(["genre", "unused", "item_id", "friend_id", "user_id"], SIZES)
    assert_same_output(ours, theirs, kjt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_torchrec(backend):
    ours, theirs = pair(tables(PoolingType.MEAN), backend=backend)
    kjt = random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES)
    upstream = torch.randn(6, 4 + 4 + 7 + 3)
    (ours(kjt).values() * upstream).sum().backward()
    (theirs(kjt).values() * upstream).sum().backward()
    for name in ["user", "item", "genre"]:
        torch.testing.assert_close(
            ours.embedding_bags[name].weight.grad, theirs.embedding_bags[name].weight.grad
        )


def test_state_dict_keys_match_and_load_both_ways():
    ours, theirs = pair(tables())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert list(ours.state_dict()) == [
        "embedding_bags.user.weight",
        "embedding_bags.item.weight",
        "embedding_bags.genre.weight",
    ]
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    assert_same_output(
        ours, theirs, random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES)
    )


def test_default_init_follows_config():
    ebc = EmbeddingBagCollection(tables())
    bound = (1 / 20) ** 0.5  # torchrec's default: uniform in +-sqrt(1 / num_embeddings)
    weight = ebc.embedding_bags["user"].weight
    assert weight.abs().max() <= bound and weight.std() > bound / 4


def test_missing_feature_is_a_clear_error():
    ebc = EmbeddingBagCollection(tables())
    kjt = random_kjt(["user_id", "friend_id", "itemid", "genre"], dict(SIZES, itemid=1))
    with pytest.raises(ValueError, match=r"missing features 'item_id' \(did you mean 'itemid'\?\)"):
        ebc(kjt)


def test_id_out_of_range_names_feature():
    ebc = EmbeddingBagCollection(tables())
    kjt = KeyedJaggedTensor(
        keys=["user_id", "friend_id", "item_id", "genre"],
        values=torch.tensor([3, 4, 0, 2, 9]),  # genre has 9 rows: id 9 is one past the end
        lengths=torch.tensor([1, 1, 1, 2]),
    )
    with pytest.raises(ValueError, match="genre: id 9 is out of range .* 9 rows"):
        ebc(kjt)


def test_weighted_collection_needs_weights():
    ebc = EmbeddingBagCollection(tables(), is_weighted=True)
    with pytest.raises(ValueError, match="has no weights"):
        ebc(random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES))


def test_bad_tables():
    dup = [*tables(), EmbeddingBagConfig(name="user", embedding_dim=2, num_embeddings=2)]
    with pytest.raises(ValueError, match=r"duplicate table names: \['user'\]"):
        EmbeddingBagCollection(dup)
    none_pooled = [
        EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=2, pooling=PoolingType.NONE)
    ]
    with pytest.raises(ValueError, match="pooling"):
        EmbeddingBagCollection(none_pooled)


def test_meta_device_leaves_tables_uninitialized():
    ebc = EmbeddingBagCollection(tables(), device="meta")
    assert ebc.embedding_bags["user"].weight.device.type == "meta"


def test_tables_are_views_of_one_packed_buffer():
    ebc = EmbeddingBagCollection(tables())
    weights = [t.weight for t in ebc.embedding_bags.values()]
    storage = {w.untyped_storage().data_ptr() for w in weights}
    assert len(storage) == 1
    with torch.no_grad():
        weights[2][3] = 7.0  # an in-place write through the parameter is what the op reads
    kjt = KeyedJaggedTensor(keys=["genre"], values=torch.tensor([3]), lengths=torch.tensor([1]))
    ebc_genre = EmbeddingBagCollection([tables()[2]])
    ebc_genre.load_state_dict({"embedding_bags.genre.weight": weights[2].detach()})
    assert torch.equal(ebc_genre(kjt).values(), torch.full((1, 3), 7.0))


def test_replaced_parameters_are_repacked():
    ours, theirs = pair(tables())
    kjt = random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict(), assign=True)  # new tensors, not copies
    assert_same_output(ours, theirs, kjt)
    ours.embedding_bags["genre"].weight.data = torch.zeros(9, 3)
    with torch.no_grad():
        theirs.embedding_bags["genre"].weight.zero_()
    assert_same_output(ours, theirs, kjt)


def test_deepcopy_and_to_keep_training_identically():
    import copy

    from recsys.embedding.optim import RowWiseAdagrad

    ebc = EmbeddingBagCollection(tables(), optimizer=RowWiseAdagrad(lr=0.1))
    kjt = random_kjt(["user_id", "friend_id", "item_id", "genre"], SIZES)
    other = copy.deepcopy(ebc)
    a, b = ebc(kjt).values(), other(kjt).values()
    torch.testing.assert_close(a, b)
    a.sum().backward()
    b.sum().backward()
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
    other.to(torch.float64)
    assert other._views_intact() and other.embedding_bags["user"].weight.dtype == torch.float64
    torch.testing.assert_close(other(kjt).values(), ebc(kjt).values().double())
