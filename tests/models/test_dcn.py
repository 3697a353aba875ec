import pytest
import torch
import torch.nn.functional as F
import torchrec.modules.crossnet as torchrec_crossnet
from torchrec import EmbeddingBagConfig

from recsys import DCN, EmbeddingBagCollection
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.train.trainer import train
from tests.models.test_dlrm import make_inputs, make_tables
from tests.train.test_trainer import SMALL

# (version, structure, low_rank): every valid combination; v1 has no low-rank form.
VARIANTS = [
    (version, structure, low_rank)
    for version, ranks in (("v2", (0, 3)), ("v1", (0,)))
    for structure in ("stacked", "parallel")
    for low_rank in ranks
]


def make_dcn(version="v2", structure="stacked", low_rank=0, num_tasks=1, tables=None):
    return DCN(
        EmbeddingBagCollection(tables or make_tables()),
        13,
        [32, 16, num_tasks],
        num_cross_layers=2,
        low_rank=low_rank,
        version=version,
        structure=structure,
    )


@pytest.mark.parametrize("num_tasks", [1, 3])
@pytest.mark.parametrize(("version", "structure", "low_rank"), VARIANTS)
def test_shapes_and_gradients_reach_every_parameter(version, structure, low_rank, num_tasks):
    model = make_dcn(version, structure, low_rank, num_tasks)
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_tables_of_different_dims():
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=10 + 7 * i, feature_names=[f"f{i}"]
        )
        for i, dim in enumerate([4, 8, 3, 8, 5])
    ]
    model = make_dcn(structure="parallel", tables=tables)
    assert model.over_arch.layers[0].in_features == 16 + 13 + 28  # deep + dense + sum of dims
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, 1)


@pytest.mark.parametrize(("version", "structure", "low_rank"), VARIANTS)
def test_matches_torchrec_cross_nets_and_the_documented_data_flow(version, structure, low_rank):
    model = make_dcn(version, structure, low_rank, num_tasks=2)
    if version == "v1":
        cross = torchrec_crossnet.VectorCrossNet(13 + 5 * 8, num_layers=2)
    elif low_rank:
        cross = torchrec_crossnet.LowRankCrossNet(13 + 5 * 8, num_layers=2, low_rank=low_rank)
    else:
        cross = torchrec_crossnet.CrossNet(13 + 5 * 8, num_layers=2)
    cross.load_state_dict(model.cross_arch.state_dict())
    deep = model.deep_arch.layers
    dense, sparse = make_inputs()

    x0 = torch.cat([dense, model.sparse_arch(sparse).values()], dim=1)
    crossed = cross(x0)
    h = F.relu(deep[1](F.relu(deep[0](crossed if structure == "stacked" else x0))))
    top = h if structure == "stacked" else torch.cat([crossed, h], dim=1)
    expected = model.over_arch.layers[0](top)
    torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-5, atol=1e-6)


def test_bad_sizes():
    ebc = EmbeddingBagCollection(make_tables())
    with pytest.raises(ValueError, match=r"over_arch_layer_sizes = \[1\] needs at least one deep"):
        DCN(ebc, 13, [1])
    with pytest.raises(ValueError, match="low_rank = 4 applies to version 'v2' only"):
        DCN(ebc, 13, [16, 1], low_rank=4, version="v1")
    with pytest.raises(ValueError, match="low_rank must be >= 0"):
        DCN(ebc, 13, [16, 1], low_rank=-1)
    with pytest.raises(ValueError, match="num_cross_layers must be >= 0, got -1"):
        DCN(ebc, 13, [16, 1], num_cross_layers=-1)
    with pytest.raises(ValueError, match="version = 'v3'"):
        DCN(ebc, 13, [16, 1], version="v3")
    with pytest.raises(ValueError, match="structure = 'side'"):
        DCN(ebc, 13, [16, 1], structure="side")


def make_spec(num_tasks):
    tables = make_tables()
    return DatasetSpec(
        dense_names=tuple(f"int_{i}" for i in range(13)),
        sparse_names=tuple(t.feature_names[0] for t in tables),
        cardinalities=tuple(t.num_embeddings for t in tables),
        label_names=tuple(f"label_{t}" for t in range(num_tasks)),
    )


def test_registry_builds_it_from_the_config():
    config = load_config(
        None,
        [
            "--model.name=dcn",
            "--model.embedding_dim=8",
            "--model.over_arch_layer_sizes=[32,3]",
            "--model.activation=gelu",
            "--model.dropout=0.1",
            "--model.cross.num_layers=4",
            "--model.cross.low_rank=5",
            "--model.cross.structure=parallel",
        ],
    ).model
    model = build_model(config, make_spec(num_tasks=3), torch.device("cpu"))
    assert isinstance(model, DCN) and model.structure == "parallel"
    assert len(model.cross_arch.W_kernels) == 4 and model.cross_arch.W_kernels[0].shape == (53, 5)
    assert (model.deep_arch.activation, model.deep_arch.dropout) == ("gelu", 0.1)
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, 3)
    config.over_arch_layer_sizes = [32, 1]
    with pytest.raises(ValueError, match="must end with the number of tasks"):
        build_model(config, make_spec(num_tasks=3), torch.device("cpu"))


@pytest.mark.parametrize(
    ("version", "structure"),
    [("v2", "stacked"), pytest.param("v1", "parallel", marks=pytest.mark.slow)],
)
def test_short_run_lands_within_003_of_oracle(tmp_path, version, structure):
    config = load_config(
        None,
        [
            *SMALL,
            "--model.name=dcn",
            f"--model.cross.version={version}",
            f"--model.cross.structure={structure}",
            "--checkpoint.save_final=false",
            f"--run.dir={tmp_path}",
        ],
    )
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
