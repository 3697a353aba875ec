import pytest
import torch
from torchrec import EmbeddingBagConfig

from recsys import DeepFM, EmbeddingBagCollection
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.models import linear_table_configs
from recsys.train.trainer import train
from tests.models.test_dlrm import make_inputs, make_tables
from tests.train.test_trainer import SMALL

# SMALL trains DLRM on 300k samples; these models get there on 200k with faster learning rates.
SHORT_RUN = [
    *SMALL,
    "--data.synthetic.num_train_samples=200000",
    "--train.dense_lr=0.003",
    "--train.embedding_lr=0.1",
    "--train.eval_every_steps=0",
    "--checkpoint.save_final=false",
]


def make_collections(tables=None):
    """The embeddings and their dimension-1 twins, the first-order weights."""
    tables = tables or make_tables()
    return EmbeddingBagCollection(tables), EmbeddingBagCollection(linear_table_configs(tables))


def make_spec(num_tasks, tables=None):
    tables = tables or make_tables()
    return DatasetSpec(
        dense_names=tuple(f"int_{i}" for i in range(13)),
        sparse_names=tuple(t.feature_names[0] for t in tables),
        cardinalities=tuple(t.num_embeddings for t in tables),
        label_names=tuple(f"label_{t}" for t in range(num_tasks)),
    )


def first_order_reference(arch, dense, sparse):
    """A LinearArch by its definition: sum over the features of the pooled 1-dim weights, plus
    the dense linear term and the bias: [B, T]."""
    weights = arch.sparse_arch(sparse).values()  # [B, F]
    return weights.sum(1, keepdim=True) + dense @ arch.dense_arch.weight.T + arch.dense_arch.bias


def pairwise_fm(fields):
    """sum over field pairs i < j of <v_i, v_j>: [B, 1]."""
    num_fields = fields.shape[1]
    pairs = [(fields[:, i] * fields[:, j]).sum(1) for i in range(num_fields) for j in range(i)]
    return torch.stack(pairs, dim=1).sum(1, keepdim=True)


@pytest.mark.parametrize("num_tasks", [1, 3])
def test_shapes_and_gradients_reach_every_parameter(num_tasks):
    model = DeepFM(*make_collections(), 13, [32, 8], [16, num_tasks], dropout=0.1)
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    names = [name for name, _ in model.named_parameters()]
    assert "linear_arch.sparse_arch.embedding_bags.t0_linear.weight" in names
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_matches_the_documented_data_flow():
    model = DeepFM(*make_collections(), 13, [32, 8], [16, 4, 2], activation="gelu")
    dense, sparse = make_inputs()
    embedded_dense = model.dense_arch(dense)  # [B, D]
    pooled = model.sparse_arch(sparse).values().view(9, 5, 8)  # [B, F, D]
    fields = torch.cat([embedded_dense.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
    expected = (
        first_order_reference(model.linear_arch, dense, sparse)
        + pairwise_fm(fields)
        + model.over_arch(fields.flatten(1))
    )
    torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-5, atol=1e-5)


def test_bad_sizes():
    with pytest.raises(ValueError, match=r"dense_arch_layer_sizes = \[32, 16\] must end with the "):
        DeepFM(*make_collections(), 13, [32, 16], [16, 1])
    mixed = [*make_tables(), EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3)]
    with pytest.raises(ValueError, match=r"one embedding_dim, got \[4, 8\]"):
        DeepFM(*make_collections(mixed), 13, [32, 8], [16, 1])
    with pytest.raises(
        ValueError, match=r"over_arch_layer_sizes must end with the number of tasks"
    ):
        DeepFM(*make_collections(), 13, [32, 8], [])
    ebc, _ = make_collections()
    with pytest.raises(ValueError, match=r"linear tables must all have embedding_dim 1"):
        DeepFM(ebc, ebc, 13, [32, 8], [16, 1])  # the D-dim tables given as the linear ones


@pytest.mark.parametrize("num_tasks", [1, 2])
def test_registry_builds_it_from_the_config(num_tasks):
    overrides = [
        "--model.name=deepfm",
        "--model.embedding_dim=8",
        "--model.dense_arch_layer_sizes=[16,8]",
        f"--model.over_arch_layer_sizes=[32,{num_tasks}]",
        "--model.activation=silu",
        "--model.dropout=0.2",
    ]
    model = build_model(
        load_config(None, overrides).model, make_spec(num_tasks), torch.device("cpu")
    )
    assert isinstance(model, DeepFM)
    assert model.over_arch.activation == "silu" and model.over_arch.dropout == 0.2
    linear_configs = model.linear_arch.sparse_arch.embedding_bag_configs()
    assert [(c.name, c.embedding_dim) for c in linear_configs[:2]] == [
        ("t_f0_linear", 1),
        ("t_f1_linear", 1),
    ]
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, num_tasks)
    with pytest.raises(ValueError, match="must end with the number of tasks"):
        build_model(load_config(None, overrides).model, make_spec(3), torch.device("cpu"))


def test_short_run_lands_within_003_of_oracle(tmp_path):
    config = load_config(None, [*SHORT_RUN, "--model.name=deepfm", f"--run.dir={tmp_path}"])
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
