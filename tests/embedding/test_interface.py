"""The embedding-collection interface: the walker, the logical state layout every collection
shares, and the checks and vocabulary it shares with its kinds."""

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType

from recsys import EmbeddingBagCollection
from recsys.embedding.inputs import FeatureOrder, input_weights
from recsys.embedding.interface import (
    EmbeddingCollectionInterface,
    embedding_collections,
    is_optimizer_state,
    logical_optimizer_state,
)
from recsys.embedding.optim import Adam, RowWiseAdagrad
from recsys.embedding.tables import (
    check_table_config,
    element_bytes,
    output_keys,
    pooling_mode,
    table_dtype,
)


def configs():
    return [
        EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=10, feature_names=["u"]),
        EmbeddingBagConfig(
            name="item", embedding_dim=3, num_embeddings=7, feature_names=["i", "j"]
        ),
    ]


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.ebc = EmbeddingBagCollection(configs())
        self.linear = EmbeddingBagCollection(configs()[:1])
        self.top = nn.Linear(3, 1)


class Wrapper(EmbeddingCollectionInterface):
    """A collection kind that holds a plain collection inside (as a sharded one does)."""

    def __init__(self):
        super().__init__()
        self.inner = EmbeddingBagCollection(configs())

    def embedding_bag_configs(self):
        return self.inner.embedding_bag_configs()

    def is_weighted(self):
        return False


def test_walker_finds_every_collection_in_module_order_not_their_insides():
    model = Outer()
    found = embedding_collections(model)
    assert list(found) == ["sparse.ebc", "linear"]
    assert found["linear"] is model.linear
    model.linear = Wrapper()
    assert list(embedding_collections(model)) == ["sparse.ebc", "linear"]  # not linear.inner
    assert list(embedding_collections(model.sparse.ebc)) == [""]
    assert embedding_collections(nn.Linear(2, 2)) == {}


def test_logical_keys_are_the_state_dict_keys():
    ebc = EmbeddingBagCollection(configs(), optimizer=Adam(lr=0.1))
    keys = set(ebc.state_dict())
    assert set(ebc.weight_keys()) == {"embedding_bags.user.weight", "embedding_bags.item.weight"}
    state_keys = {k for k in keys if ebc.is_optimizer_state_key(k)}
    assert state_keys == keys - set(ebc.weight_keys())
    assert "optimizer_step" in state_keys and "embedding_bags.item.exp_avg" in state_keys
    # keys of a table it does not have, or of no table, are not its optimizer state
    assert not ebc.is_optimizer_state_key("embedding_bags.other.exp_avg")
    assert not ebc.is_optimizer_state_key("embedding_bags.user.weight")
    assert not ebc.is_optimizer_state_key("top.weight")


def test_trainable_parameters_follow_the_optimizer_and_freezing():
    ebc = EmbeddingBagCollection(configs())
    assert [id(p) for p in ebc.trainable_parameters()] == [id(p) for p in ebc.parameters()]
    assert not ebc.is_frozen()
    ebc.set_optimizer(RowWiseAdagrad(lr=0.1))
    assert ebc.trainable_parameters() == [] and not ebc.is_frozen()
    ebc.set_optimizer(None)
    ebc.requires_grad_(False)
    assert ebc.trainable_parameters() == [] and ebc.is_frozen()
    assert ebc.ddp_parameters() == []


def test_plain_collection_optimizer_state_is_already_logical():
    model = Outer()
    params = [p for c in embedding_collections(model).values() for p in c.parameters()]
    optimizer = torch.optim.Adagrad(params, lr=0.1)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["u", "i", "j"], torch.tensor([1, 2, 0, 6]), torch.tensor([1, 0, 1, 1, 1, 0])
    )
    model.sparse.ebc(kjt).values().sum().backward()
    optimizer.step()
    state = get_optimizer_state_dict(model, [optimizer])["state"]
    assert "sparse.ebc.embedding_bags.item.weight" in state
    assert logical_optimizer_state(model, state) == state


def test_input_checks_name_the_problem():
    kjt = KeyedJaggedTensor.from_lengths_sync(["u"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    assert input_weights(kjt, is_weighted=False) is None
    with pytest.raises(ValueError, match="has no weights"):
        input_weights(kjt, is_weighted=True)
    weighted = KeyedJaggedTensor.from_lengths_sync(
        ["u"], torch.tensor([1, 2]), torch.tensor([1, 1]), weights=torch.tensor([0.5, 2.0])
    )
    torch.testing.assert_close(input_weights(weighted, True), torch.tensor([0.5, 2.0]))
    order = FeatureOrder(["u", "i"])
    assert order.positions(["i", "x", "u"]) == [2, 0]
    assert order.positions(("i", "x", "u")) == [2, 0]  # cached by key tuple
    with pytest.raises(ValueError, match=r"missing features 'i' .*expects \['u', 'i'\]"):
        order.positions(["u", "x"])


def test_table_vocabulary():
    config = EmbeddingBagConfig(
        name="t",
        embedding_dim=2,
        num_embeddings=3,
        feature_names=["a", "b"],
        pooling=PoolingType.MEAN,
        data_type=DataType.BF16,
    )
    assert (table_dtype(config), pooling_mode(config), element_bytes(config)) == (
        torch.bfloat16,
        "mean",
        2,
    )
    other = EmbeddingBagConfig(name="s", embedding_dim=5, num_embeddings=3, feature_names=["a"])
    assert output_keys([config, other]) == (["a@t", "b", "a@s"], [2, 2, 5])
    bad = EmbeddingBagConfig(
        name="q", embedding_dim=2, num_embeddings=3, feature_names=["a"], data_type=DataType.INT8
    )
    with pytest.raises(ValueError, match="table 'q': data_type"):
        check_table_config(bad)


def test_optimizer_state_by_key_shape_for_checkpoint_keys():
    assert is_optimizer_state("sparse.ebc.embedding_bags.gone.exp_avg")
    assert is_optimizer_state("sparse.ebc.optimizer_step") and is_optimizer_state("optimizer_step")
    assert not is_optimizer_state("sparse.ebc.embedding_bags.gone.weight")
    assert not is_optimizer_state("top.weight") and not is_optimizer_state("embedding_bags.sum")


def test_a_kind_that_takes_its_optimizer_when_built_refuses_a_new_one():
    with pytest.raises(ValueError, match="Wrapper takes its fused optimizer when it is built"):
        Wrapper().set_optimizer(RowWiseAdagrad(lr=0.1))
