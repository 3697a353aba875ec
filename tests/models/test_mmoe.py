import pytest
import torch
from torchrec import EmbeddingBagConfig

from recsys import EmbeddingBagCollection, MMoE
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.train.trainer import train
from tests.models.test_pnn import make_inputs, make_tables
from tests.train.test_trainer import SMALL


@pytest.mark.parametrize("num_tasks", [1, 3])
@pytest.mark.parametrize("tower_layer_sizes", [[], [6]])
def test_shapes_and_gradients_reach_every_parameter(num_tasks, tower_layer_sizes):
    model = MMoE(EmbeddingBagCollection(make_tables()), 13, [16, 8], tower_layer_sizes, num_tasks)
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_tables_of_different_dims_and_one_tower_per_task():
    narrow = EmbeddingBagConfig(
        name="t5", embedding_dim=3, num_embeddings=52, feature_names=["f5", "f6"]
    )
    model = MMoE(
        EmbeddingBagCollection([*make_tables(), narrow]), 13, [16, 8], [6], 2, num_experts=3
    )
    assert model.moe_arch.experts[0].layers[0].in_features == 13 + 5 * 8 + 2 * 3
    assert len(model.moe_arch.experts) == 3 and len(model.tower_arch) == 2
    dense, sparse = make_inputs(num_features=7)
    logits = model(dense, sparse)
    mixed = model.moe_arch(torch.cat([dense, model.sparse_arch(sparse).values()], dim=1))
    torch.testing.assert_close(logits[:, [1]], model.tower_arch[1](mixed[:, 1]))


def test_bad_sizes():
    ebc = EmbeddingBagCollection(make_tables())
    with pytest.raises(ValueError, match="num_tasks must be >= 1, got 0"):
        MMoE(ebc, 13, [16, 8], [6], 0)
    with pytest.raises(ValueError, match="num_experts must be >= 1, got 0"):
        MMoE(ebc, 13, [16, 8], [6], 2, num_experts=0)
    with pytest.raises(ValueError, match="expert_layer_sizes must name at least one layer"):
        MMoE(ebc, 13, [], [6], 2)
    with pytest.raises(ValueError, match="layer_sizes must be >= 1"):
        MMoE(ebc, 13, [16, 8], [0], 2)


def test_registry_builds_it_from_the_config():
    spec = DatasetSpec(
        dense_names=("d0", "d1", "d2"),
        sparse_names=("a", "b"),
        cardinalities=(5, 7),
        label_names=("click", "like", "share"),
    )
    overrides = ["--model.name=mmoe", "--model.mmoe.num_experts=5", "--model.activation=gelu"]
    model = build_model(load_config(None, overrides).model, spec, torch.device("cpu"))
    assert isinstance(model, MMoE) and len(model.moe_arch.experts) == 5
    assert len(model.tower_arch) == 3 and model.tower_arch[0].activation == "gelu"
    ignored = load_config(None, [*overrides, "--model.over_arch_layer_sizes=[8,3]"]).model
    with pytest.warns(UserWarning, match=r"model.over_arch_layer_sizes = \[8, 3\] is not used"):
        build_model(ignored, spec, torch.device("cpu"))


def test_short_two_task_run_lands_within_003_of_oracle(tmp_path):
    unused_by_mmoe = ("--model.dense_arch_layer_sizes", "--model.over_arch_layer_sizes")
    small = [o for o in SMALL if not o.startswith(unused_by_mmoe)]
    config = load_config(
        None,
        [
            *small,
            "--model.name=mmoe",
            "--data.synthetic.num_tasks=2",
            "--train.task_loss_weights=[2.0,1.0]",
            f"--run.dir={tmp_path}",
            "--checkpoint.save_final=false",
        ],
    )
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
    for task in ("task_0", "task_1"):  # each task is learned, not only their mean
        assert result.test[f"oracle_auc_{task}"] - result.test[f"auc_{task}"] < 0.03
