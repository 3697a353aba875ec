import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys import PNN, EmbeddingBagCollection
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.train.trainer import train
from tests.train.test_trainer import SMALL


def make_tables(num_features=5, dim=8):
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=10 + 7 * i, feature_names=[f"f{i}"]
        )
        for i in range(num_features)
    ]


def make_inputs(batch_size=9, num_features=5, num_dense=13):
    lengths = torch.randint(1, 3, (num_features * batch_size,))
    values = torch.cat(
        [
            torch.randint(
                0, 10 + 7 * f, (int(lengths[f * batch_size : (f + 1) * batch_size].sum()),)
            )
            for f in range(num_features)
        ]
    )
    kjt = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(num_features)], values=values, lengths=lengths
    )
    return torch.randn(batch_size, num_dense), kjt


@pytest.mark.parametrize("product", ["inner", "outer", "both"])
@pytest.mark.parametrize("num_tasks", [1, 3])
def test_shapes_and_gradients_reach_every_parameter(product, num_tasks):
    model = PNN(
        EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, num_tasks], product=product
    )
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


@pytest.mark.parametrize(
    ("product", "width"),
    # F + 1 = 6 fields of D = 8: z has 48 values, 15 inner products, 36 outer-product entries.
    [("inner", 48 + 15), ("outer", 48 + 36), ("both", 48 + 15 + 36)],
)
def test_product_width_feeds_the_over_arch(product, width):
    model = PNN(EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, 1], product=product)
    assert model.over_arch.layers[0].in_features == width


def test_dense_features_are_a_field_of_the_products():
    model = PNN(EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, 1]).eval()
    dense, sparse = make_inputs()
    seen = {}
    model.inter_arch.register_forward_hook(lambda _m, args, _out: seen.update(fields=args[0]))
    model(dense, sparse)
    torch.testing.assert_close(seen["fields"][:, 0], model.dense_arch(dense))
    pooled = model.sparse_arch(sparse).values().view(9, 5, 8)
    torch.testing.assert_close(seen["fields"][:, 1:], pooled)


def test_bad_sizes():
    with pytest.raises(
        ValueError, match=r"dense_arch_layer_sizes = \[32, 16\] must end with the embedding_dim 8"
    ):
        PNN(EmbeddingBagCollection(make_tables()), 13, [32, 16], [16, 1])
    mixed = [*make_tables(), EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3)]
    with pytest.raises(ValueError, match="PNN needs all tables to have one embedding_dim"):
        PNN(EmbeddingBagCollection(mixed), 13, [32, 8], [16, 1])
    with pytest.raises(ValueError, match="over_arch_layer_sizes must end with the number"):
        PNN(EmbeddingBagCollection(make_tables()), 13, [32, 8], [])
    with pytest.raises(ValueError, match="product 'kernel'; expected one of inner, outer, both"):
        PNN(EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, 1], product="kernel")


def test_registry_builds_it_from_the_config():
    spec = DatasetSpec(
        dense_names=("d0", "d1", "d2"),
        sparse_names=("a", "b"),
        cardinalities=(5, 7),
        label_names=("click", "like", "share"),
    )
    overrides = ["--model.name=pnn", "--model.pnn.product=both", "--model.dropout=0.25"]
    config = load_config(None, [*overrides, "--model.over_arch_layer_sizes=[32,3]"]).model
    model = build_model(config, spec, torch.device("cpu"))
    assert isinstance(model, PNN) and model.inter_arch.product == "both"
    assert model.over_arch.dropout == 0.25 and model.over_arch.out_features == 3
    config = load_config(None, overrides).model  # over_arch ends with 1, the data has 3 tasks
    with pytest.raises(ValueError, match=r"model.over_arch_layer_sizes = \[64, 32, 1\] must end"):
        build_model(config, spec, torch.device("cpu"))


def test_short_run_lands_within_003_of_oracle(tmp_path):
    config = load_config(
        None, [*SMALL, "--model.name=pnn", f"--run.dir={tmp_path}", "--checkpoint.save_final=false"]
    )
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
