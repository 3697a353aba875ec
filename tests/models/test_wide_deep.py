import pytest
import torch
from torchrec import EmbeddingBagConfig

from recsys import EmbeddingBagCollection, WideDeep
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.train.trainer import train
from tests.models.test_deepfm import (
    SHORT_RUN,
    first_order_reference,
    make_collections,
    make_spec,
)
from tests.models.test_dlrm import make_inputs, make_tables


@pytest.mark.parametrize("num_tasks", [1, 3])
def test_shapes_and_gradients_reach_every_parameter(num_tasks):
    model = WideDeep(*make_collections(), 13, [32, 16, num_tasks], dropout=0.1)
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    names = [name for name, _ in model.named_parameters()]
    assert "wide_arch.sparse_arch.embedding_bags.t0_linear.weight" in names
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_matches_the_documented_data_flow_with_tables_of_different_dims():
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=10 + 7 * i, feature_names=[f"f{i}"]
        )
        for i, dim in enumerate([4, 8, 3, 8, 5])
    ]
    model = WideDeep(*make_collections(tables), 13, [16, 2], activation="gelu")
    assert model.over_arch.layers[0].in_features == 13 + 28  # dense + sum of dims
    dense, sparse = make_inputs()
    wide = first_order_reference(model.wide_arch, dense, sparse)
    deep = model.over_arch(torch.cat([dense, model.sparse_arch(sparse).values()], dim=1))
    torch.testing.assert_close(model(dense, sparse), wide + deep, rtol=1e-5, atol=1e-5)


def test_bad_sizes():
    with pytest.raises(
        ValueError, match=r"over_arch_layer_sizes must end with the number of tasks"
    ):
        WideDeep(*make_collections(), 13, [])
    ebc = EmbeddingBagCollection(make_tables())
    with pytest.raises(ValueError, match=r"linear tables must all have embedding_dim 1"):
        WideDeep(ebc, ebc, 13, [16, 1])  # the D-dim tables given as the wide ones


@pytest.mark.parametrize("num_tasks", [1, 2])
def test_registry_builds_it_from_the_config(num_tasks):
    overrides = [
        "--model.name=wide_deep",
        "--model.embedding_dim=8",
        f"--model.over_arch_layer_sizes=[32,{num_tasks}]",
        "--model.activation=silu",
        "--model.dropout=0.2",
    ]
    model = build_model(
        load_config(None, overrides).model, make_spec(num_tasks), torch.device("cpu")
    )
    assert isinstance(model, WideDeep)
    assert model.over_arch.activation == "silu" and model.over_arch.dropout == 0.2
    assert model.over_arch.layers[0].in_features == 13 + 5 * 8
    linear_configs = model.wide_arch.sparse_arch.embedding_bag_configs()
    assert {c.embedding_dim for c in linear_configs} == {1} and len(linear_configs) == 5
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, num_tasks)


def test_short_run_lands_within_003_of_oracle(tmp_path):
    config = load_config(None, [*SHORT_RUN, "--model.name=wide_deep", f"--run.dir={tmp_path}"])
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
