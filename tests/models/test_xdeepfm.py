import pytest
import torch

from recsys import XDeepFM
from recsys.build.models import build_model
from recsys.config import load_config
from recsys.train.trainer import train
from tests.models.test_deepfm import (
    SHORT_RUN,
    first_order_reference,
    make_collections,
    make_spec,
)
from tests.models.test_dlrm import make_inputs
from tests.models.test_layers_cin import cin_reference


@pytest.mark.parametrize("split_half", [True, False])
@pytest.mark.parametrize("num_tasks", [1, 3])
def test_shapes_and_gradients_reach_every_parameter(num_tasks, split_half):
    model = XDeepFM(
        *make_collections(),
        13,
        [32, 8],
        [6, 4],
        [16, num_tasks],
        dropout=0.1,
        cin_split_half=split_half,
    )
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks)
    assert model.inter_arch.output_size == (3 + 4 if split_half else 6 + 4)
    logits.sum().backward()
    names = [name for name, _ in model.named_parameters()]
    assert "linear_arch.sparse_arch.embedding_bags.t0_linear.weight" in names
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_matches_the_documented_data_flow():
    model = XDeepFM(*make_collections(), 13, [32, 8], [4, 3], [16, 4, 2], activation="gelu")
    dense, sparse = make_inputs()
    embedded_dense = model.dense_arch(dense)  # [B, D]
    pooled = model.sparse_arch(sparse).values().view(9, 5, 8)  # [B, F, D]
    fields = torch.cat([embedded_dense.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
    cin = cin_reference(model.inter_arch, fields)  # [B, 2 + 3]
    expected = (
        first_order_reference(model.linear_arch, dense, sparse)
        + model.inter_head(cin)
        + model.over_arch(fields.flatten(1))
    )
    torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-5, atol=1e-5)


def test_bad_sizes():
    with pytest.raises(ValueError, match=r"dense_arch_layer_sizes = \[32, 16\] must end with the "):
        XDeepFM(*make_collections(), 13, [32, 16], [4], [16, 1])
    with pytest.raises(ValueError, match=r"layer_sizes = \[3, 4\]: with split_half every size"):
        XDeepFM(*make_collections(), 13, [32, 8], [3, 4], [16, 1])
    XDeepFM(*make_collections(), 13, [32, 8], [3, 4], [16, 1], cin_split_half=False)
    with pytest.raises(
        ValueError, match=r"over_arch_layer_sizes must end with the number of tasks"
    ):
        XDeepFM(*make_collections(), 13, [32, 8], [4], [])


@pytest.mark.parametrize("num_tasks", [1, 2])
def test_registry_builds_it_from_the_config(num_tasks):
    overrides = [
        "--model.name=xdeepfm",
        "--model.embedding_dim=8",
        "--model.dense_arch_layer_sizes=[16,8]",
        "--model.xdeepfm.cin_layer_sizes=[10,6,4]",
        f"--model.over_arch_layer_sizes=[32,{num_tasks}]",
        "--model.activation=silu",
        "--model.dropout=0.2",
    ]
    model = build_model(
        load_config(None, overrides).model, make_spec(num_tasks), torch.device("cpu")
    )
    assert isinstance(model, XDeepFM)
    assert model.over_arch.activation == "silu" and model.over_arch.dropout == 0.2
    assert [k.shape for k in model.inter_arch.kernels] == [(10, 6 * 6), (6, 5 * 6), (4, 3 * 6)]
    assert model.inter_arch.output_size == 5 + 3 + 4
    dense, sparse = make_inputs()
    assert model(dense, sparse).shape == (9, num_tasks)


def test_short_run_lands_within_003_of_oracle(tmp_path):
    overrides = [*SHORT_RUN, "--model.name=xdeepfm", "--model.xdeepfm.cin_layer_sizes=[16,16]"]
    result = train(load_config(None, [*overrides, f"--run.dir={tmp_path}"]))
    assert result.test["oracle_auc"] - result.test["auc"] < 0.03
