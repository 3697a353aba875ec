import pytest
import torch
import torchrec
import torchrec.models.dlrm as torchrec_dlrm
import torchrec.modules.crossnet as torchrec_crossnet
from torchrec import EmbeddingBagConfig

from recsys import DLRM, DLRM_DCN, EmbeddingBagCollection
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.train.trainer import train
from tests.models.test_dcn import make_spec
from tests.models.test_dlrm import make_inputs, make_tables
from tests.train.test_trainer import SMALL


@pytest.mark.parametrize("num_tasks", [1, 3])
@pytest.mark.parametrize("low_rank", [0, 4])
def test_shapes_and_gradients_reach_every_parameter(low_rank, num_tasks):
    model = DLRM_DCN(
        EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, num_tasks], 2, low_rank
    )
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


@pytest.mark.parametrize("low_rank", [0, 5])
def test_matches_torchrec_dlrm_dcn_with_same_weights(low_rank):
    tables = make_tables()
    ours = DLRM_DCN(
        EmbeddingBagCollection(tables),
        13,
        [32, 8],
        [16, 4, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=low_rank,
    )
    theirs = torchrec_dlrm.DLRM_DCN(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, 8],
        over_arch_layer_sizes=[16, 4, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=max(low_rank, 1),
    )
    if low_rank == 0:
        # torchrec's DLRM_DCN is always low rank; its full-rank twin is the same model with
        # torchrec's CrossNet in the interaction, which has our CrossNet's parameters.
        theirs.inter_arch.crossnet = torchrec_crossnet.CrossNet((5 + 1) * 8, num_layers=2)
    ours_params, theirs_params = list(ours.parameters()), list(theirs.parameters())
    assert [p.shape for p in ours_params] == [p.shape for p in theirs_params]
    with torch.no_grad():
        for a, b in zip(ours_params, theirs_params, strict=True):
            b.copy_(a)
    dense, sparse = make_inputs()
    torch.testing.assert_close(ours(dense, sparse), theirs(dense, sparse), rtol=1e-5, atol=1e-6)


def test_bad_sizes():
    ebc = EmbeddingBagCollection(make_tables())
    with pytest.raises(
        ValueError, match=r"dense_arch_layer_sizes = \[32, 16\] must end with the embedding_dim 8"
    ):
        DLRM_DCN(ebc, 13, [32, 16], [16, 1], 2, 4)
    mixed = [*make_tables(), EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3)]
    with pytest.raises(ValueError, match="DLRM_DCN needs all tables to have one embedding_dim"):
        DLRM_DCN(EmbeddingBagCollection(mixed), 13, [32, 8], [16, 1], 2, 4)
    with pytest.raises(ValueError, match="dcn_num_layers must be >= 0, got -1"):
        DLRM_DCN(ebc, 13, [32, 8], [16, 1], -1, 4)
    with pytest.raises(ValueError, match="dcn_low_rank_dim must be >= 0"):
        DLRM_DCN(ebc, 13, [32, 8], [16, 1], 2, -4)


@pytest.mark.parametrize(("name", "cls"), [("dlrm", DLRM), ("dlrm_dcn", DLRM_DCN)])
def test_registry_builds_it_from_the_config(name, cls):
    overrides = [
        f"--model.name={name}",
        "--model.embedding_dim=8",
        "--model.dense_arch_layer_sizes=[32,8]",
        "--model.over_arch_layer_sizes=[32,3]",
        "--model.activation=silu",
        "--model.dropout=0.2",
        "--model.cross.num_layers=4",
        "--model.cross.low_rank=6",
    ]
    config = load_config(None, overrides).model
    model = build_model(config, make_spec(num_tasks=3), torch.device("cpu"))
    assert isinstance(model, cls)
    for mlp in (model.dense_arch, model.over_arch):
        assert (mlp.activation, mlp.dropout) == ("silu", 0.2)
    if cls is DLRM_DCN:
        assert len(model.inter_arch.V_kernels) == 4
        assert model.inter_arch.V_kernels[0].shape == (6, (5 + 1) * 8)
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, 3)


def test_registry_rejects_dcn_only_cross_options():
    config = load_config(None, ["--model.name=dlrm_dcn", "--model.cross.version=v1"]).model
    with pytest.raises(ValueError, match="model.cross.version = 'v1'"):
        build_model(config, make_spec(num_tasks=1), torch.device("cpu"))


def test_short_run_lands_within_003_of_oracle(tmp_path):
    config = load_config(
        None,
        [*SMALL, "--model.name=dlrm_dcn", "--checkpoint.save_final=false", f"--run.dir={tmp_path}"],
    )
    result = train(config)
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
