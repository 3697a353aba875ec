"""Categorical-only data (no dense feature: Avazu-like logs, rating logs): every model builds
without a bottom MLP and trains on dense features [B, 0]; with dense features nothing moves."""

import pytest
import torch

from recsys import DLRM, EmbeddingBagCollection
from recsys.build.models import MODELS, build_model
from recsys.config import load_config
from recsys.data.batch import DatasetSpec
from recsys.ops.interaction.dot import dot_interaction_reference
from tests.models.test_dlrm import make_inputs, make_tables

CLICK_MODELS = [name for name, entry in MODELS.items() if entry.family == "click"]


def build(name, num_dense, num_tasks=1, num_features=5):
    spec = DatasetSpec(
        dense_names=tuple(f"int_{i}" for i in range(num_dense)),
        sparse_names=tuple(f"f{i}" for i in range(num_features)),
        cardinalities=tuple(10 + 7 * i for i in range(num_features)),
        label_names=tuple(f"label_{t}" for t in range(num_tasks)),
    )
    overrides = [
        f"--model.name={name}",
        "--model.embedding_dim=8",
        "--model.xdeepfm.cin_layer_sizes=[4,4]",
        "--model.cross.low_rank=4",
    ]
    if name != "mmoe":  # mmoe takes its sizes from [model.mmoe] and the data
        overrides.append(f"--model.over_arch_layer_sizes=[16,{num_tasks}]")
        if num_dense:
            overrides.append("--model.dense_arch_layer_sizes=[16,8]")
    # Otherwise model.dense_arch_layer_sizes keeps its default [64, 16], which does not end
    # with the embedding_dim 8: without dense features it is unused, so that is no error.
    return build_model(load_config(None, overrides).model, spec, torch.device("cpu"))


@pytest.mark.parametrize(("num_features", "num_tasks"), [(5, 1), (5, 2), (1, 1)])
@pytest.mark.parametrize("name", CLICK_MODELS)
def test_every_model_trains_without_dense_features(name, num_features, num_tasks):
    model = build(name, num_dense=0, num_tasks=num_tasks, num_features=num_features)
    assert not [n for n, _ in model.named_parameters() if "dense_arch" in n]
    dense, sparse = make_inputs(num_features=num_features, num_dense=0)
    logits = model(dense, sparse)
    assert logits.shape == (9, num_tasks) and torch.isfinite(logits).all()
    logits.sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, n


# With dense features, the parameters that read them keep their names and shapes (checkpoints,
# TorchRec's state_dicts): 13 dense features, 5 embeddings of dim 8, a bottom MLP [16, 8].
DENSE_PARAMETERS = {
    "dlrm": {"dense_arch.layers.0.weight": (16, 13)},
    "dlrm_dcn": {"dense_arch.layers.0.weight": (16, 13), "inter_arch.V_kernels.0": (4, 48)},
    "dcn": {"deep_arch.layers.0.weight": (16, 13 + 40)},
    "pnn": {"dense_arch.layers.0.weight": (16, 13), "over_arch.layers.0.weight": (16, 48 + 15)},
    "mmoe": {"moe_arch.gates.weight": (4, 13 + 40)},
    "deepfm": {"dense_arch.layers.0.weight": (16, 13), "linear_arch.dense_arch.weight": (1, 13)},
    "wide_deep": {"wide_arch.dense_arch.weight": (1, 13), "over_arch.layers.0.weight": (16, 53)},
    "xdeepfm": {"dense_arch.layers.0.weight": (16, 13), "linear_arch.dense_arch.weight": (1, 13)},
}


@pytest.mark.parametrize("name", CLICK_MODELS)
def test_with_dense_features_the_parameters_stay(name):
    shapes = {n: tuple(p.shape) for n, p in build(name, num_dense=13).named_parameters()}
    assert {n: shapes.get(n) for n in DENSE_PARAMETERS[name]} == DENSE_PARAMETERS[name]
    assert not {"bias", "linear_arch.bias", "wide_arch.bias"} & set(shapes)


def _inter_arch_input(model):
    """What the interaction layer of a dense-free model reads, and the embeddings [B, F, D]."""
    seen = {}
    model.inter_arch.register_forward_hook(lambda _m, args, _out: seen.update(args=args))
    dense, sparse = make_inputs(num_dense=0)
    model(dense, sparse)
    return seen["args"], model.sparse_arch(sparse).values().view(9, 5, 8)  # [B, F, D]


def test_dlrm_dot_products_of_the_embeddings_alone():
    model = build("dlrm", num_dense=0).eval()
    assert model.over_arch.layers[0].in_features == 8 + 5 * 4 // 2  # [e_1 | 10 pairs]
    (first, others), embedded = _inter_arch_input(model)
    torch.testing.assert_close(torch.cat([first.unsqueeze(1), others], dim=1), embedded)
    interaction = dot_interaction_reference(embedded[:, 0].double(), embedded[:, 1:].double())
    torch.testing.assert_close(model.inter_arch(first, others).double(), interaction)


@pytest.mark.parametrize("name", ["dlrm_dcn", "deepfm", "xdeepfm", "pnn"])
def test_the_fields_are_the_embeddings_alone(name):
    model = build(name, num_dense=0).eval()
    (fields,), embedded = _inter_arch_input(model)
    torch.testing.assert_close(fields.view(9, 5, 8), embedded)


def test_dense_arch_layer_sizes_are_unused_without_dense_features():
    ebc = EmbeddingBagCollection(make_tables())
    for sizes in ([], [32, 16], [16, 8]):
        assert DLRM(ebc, 0, sizes, [16, 1]).dense_arch is None
    with pytest.raises(ValueError, match=r"dense_in_features must be >= 0 \(0: none\), got -1"):
        DLRM(ebc, -1, [16, 8], [16, 1])
