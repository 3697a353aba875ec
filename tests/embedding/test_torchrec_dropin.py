"""What TorchRec's tooling expects of a collection: FX tracing (torch.fx and torchrec.fx), the meta
device (by argument and by context manager), forward on meta inputs for shape inference, and a
clear refusal of TorchScript."""

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM

from recsys import EmbeddingBagCollection
from recsys.embedding.optim import Adam, RowWiseAdagrad

TRACERS = {"torch.fx": torch.fx.symbolic_trace, "torchrec.fx": torchrec.fx.symbolic_trace}


def tables(dim_b=4):
    """A table shared by two features, and a feature ("c") read by two tables."""
    return [
        EmbeddingBagConfig(name="ab", embedding_dim=4, num_embeddings=11, feature_names=["a", "b"]),
        EmbeddingBagConfig(
            name="c1",
            embedding_dim=dim_b,
            num_embeddings=7,
            feature_names=["c"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="c2", embedding_dim=4, num_embeddings=5, feature_names=["c"]),
    ]


def model_tables():
    """TorchRec's models read pooled vectors by feature name: no feature in two tables."""
    return [
        EmbeddingBagConfig(name="ab", embedding_dim=4, num_embeddings=11, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=7, feature_names=["c"]),
    ]


def kjt(batch_size=3, weighted=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * batch_size,), generator=g)
    lengths[::4] = 0  # empty bags
    n = int(lengths.sum())
    values = torch.randint(0, 5, (n,), generator=g)  # in range of every table
    weights = torch.rand(n, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        ["c", "a", "b"],  # another order than the collection's
        values.to(device),
        lengths.to(device),
        weights=None if weights is None else weights.to(device),
    )


def assert_same_pooled(eager, traced):
    assert traced.keys() == eager.keys()
    assert traced.offset_per_key() == eager.offset_per_key()
    assert torch.equal(traced.values(), eager.values())


@pytest.mark.parametrize("tracer", list(TRACERS))
@pytest.mark.parametrize("weighted", [False, True])
def test_traced_collection_gives_the_eager_output(tracer, weighted):
    ebc = EmbeddingBagCollection(tables(dim_b=3), is_weighted=weighted)
    traced = TRACERS[tracer](ebc)
    assert isinstance(traced, torch.fx.GraphModule)
    for seed in range(3):  # other batch sizes and lengths than anything seen while tracing
        features = kjt(batch_size=2 + seed, weighted=weighted, seed=seed)
        assert_same_pooled(ebc(features), traced(features))


@pytest.mark.parametrize("tracer", list(TRACERS))
def test_traced_fused_collection_still_trains_in_backward(tracer):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables(), optimizer=RowWiseAdagrad(lr=0.1))
    twin = EmbeddingBagCollection(tables(), optimizer=RowWiseAdagrad(lr=0.1))
    twin.load_state_dict(ebc.state_dict())
    traced = TRACERS[tracer](twin)
    for seed in range(2):
        features = kjt(seed=seed)
        eager, out = ebc(features), traced(features)
        assert_same_pooled(eager, out)
        eager.values().square().sum().backward()
        out.values().square().sum().backward()
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, twin.state_dict()[key]), key
    assert int(twin.optimizer_step) == 2


def test_traced_module_still_validates_ids():
    traced = torch.fx.symbolic_trace(EmbeddingBagCollection(tables()))
    bad = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], torch.tensor([3, 11, 0]), torch.tensor([1, 1, 1])
    )
    with pytest.raises(ValueError, match="11"):
        traced(bad)


@pytest.mark.parametrize("tracer", list(TRACERS))
def test_torchrec_models_on_recsys_collections_trace(tracer):
    torch.manual_seed(0)
    dense = torch.randn(3, 5)
    features = kjt()
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(model_tables()),
        dense_in_features=5,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
    )
    deepfm = SimpleDeepFMNN(
        num_dense_features=5,
        embedding_bag_collection=EmbeddingBagCollection(model_tables()),
        hidden_layer_size=8,
        deep_fm_dimension=3,
    )
    for model in (dlrm, deepfm):
        traced = TRACERS[tracer](model)
        torch.testing.assert_close(traced(dense, features), model(dense, features), rtol=0, atol=0)


def test_meta_device_by_argument_and_by_context_manager():
    by_argument = EmbeddingBagCollection(tables(), device=torch.device("meta"))
    with torch.device("meta"):
        by_context = EmbeddingBagCollection(tables(), optimizer=Adam(lr=0.1))
    for ebc in (by_argument, by_context):
        assert ebc.device.type == "meta"
        assert all(t.weight.is_meta for t in ebc.embedding_bags.values())
    assert by_context.embedding_bags["ab"].exp_avg.is_meta and by_context.optimizer_step.is_meta
    assert EmbeddingBagCollection(tables()).device.type == "cpu"  # outside the context


@pytest.mark.parametrize("optimizer", [None, Adam(lr=0.1)])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_on_meta_gives_meta_output_of_the_right_shape(optimizer, weighted):
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(tables(dim_b=3), optimizer=optimizer, is_weighted=weighted)
    # TorchRec's own collection, as the reference (it pools weighted bags by sum only)
    reference = torchrec.EmbeddingBagCollection(tables(dim_b=3), device=torch.device("meta"))
    features = kjt(batch_size=5, weighted=weighted, device="meta")
    out, expected = ebc(features), reference(features)
    assert out.values().is_meta
    assert out.values().shape == expected.values().shape == (5, 4 + 4 + 3 + 4)
    assert out.keys() == expected.keys()
    assert out.offset_per_key() == expected.offset_per_key() == [0, 4, 8, 11, 15]
    # real tables, meta inputs: shape inference too
    real = EmbeddingBagCollection(tables(dim_b=3), is_weighted=weighted)
    assert real(features).values().shape == (5, 15) and real(features).values().is_meta


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_with_a_pointer_to_torch_export():
    with pytest.raises(RuntimeError, match="does not support TorchScript.*torch.export"):
        torch.jit.script(EmbeddingBagCollection(tables()))


def test_a_collection_without_tables_is_refused_when_built():
    with pytest.raises(ValueError, match="needs at least one table"):
        EmbeddingBagCollection([])
