"""recsys.models.fields: the field handling every model shares (FieldModel's parts and their
order, the stacked fields, the flat width of [dense | pooled])."""

import pytest
import torch
from torchrec import EmbeddingBagConfig

from recsys import EmbeddingBagCollection
from recsys.models import DCN, DLRM, PNN, DeepFM, MMoE, WideDeep, XDeepFM, linear_table_configs
from recsys.models.fields import FieldModel, flat_width
from recsys.models.layers import FactorizationMachine
from tests.models.test_dlrm import make_inputs, make_tables


class FMOnly(FieldModel):
    """A model that is its architecture only: first-order term + FM over the fields."""

    def __init__(self, ebc, linear_ebc, dense_in_features, dense_arch_layer_sizes, num_tasks):
        super().__init__(
            ebc,
            dense_in_features,
            dense_arch_layer_sizes,
            why="the dense vector is one more FM field",
            activation="relu",
            dropout=0.0,
            linear_embedding_bag_collection=linear_ebc,
            num_tasks=num_tasks,
        )
        self.inter_arch = FactorizationMachine(reduce_sum=True)

    def forward(self, dense_features, sparse_features):
        fields = self.fields(dense_features, sparse_features)
        return self.linear_arch(dense_features, sparse_features) + self.inter_arch(fields)


def test_a_new_field_model_gets_the_sparse_linear_and_dense_arch_in_order():
    tables = make_tables()
    ebc, linear = (EmbeddingBagCollection(t) for t in (tables, linear_table_configs(tables)))
    model = FMOnly(ebc, linear, 13, [16, 8], num_tasks=2)
    assert [name for name, _ in model.named_children()] == [
        "sparse_arch",
        "linear_arch",
        "dense_arch",
        "inter_arch",
    ]
    assert (model.embedding_dim, model.num_fields) == (8, 5 + 1)
    dense, sparse = make_inputs()
    fields = model.fields(dense, sparse)  # [B, F+1, D]
    torch.testing.assert_close(fields[:, 0], model.dense_arch(dense))
    torch.testing.assert_close(fields[:, 1:], model.sparse_arch(sparse).values().view(9, 5, 8))
    assert model(dense, sparse).shape == (9, 2)


def test_without_dense_features_the_fields_are_the_embeddings():
    model = FieldModel(
        EmbeddingBagCollection(make_tables()), 0, [], why="-", activation="relu", dropout=0.0
    )
    assert model.dense_arch is None and model.num_fields == 5
    assert not hasattr(model, "linear_arch")
    dense, sparse = make_inputs(num_dense=0)
    torch.testing.assert_close(model.fields(dense, sparse), model.sparse_fields(sparse))


def test_the_models_error_names_their_class():
    tables = make_tables()
    tables[1] = EmbeddingBagConfig(
        name="t1", embedding_dim=4, num_embeddings=17, feature_names=["f1"]
    )
    ebc = EmbeddingBagCollection(tables)
    with pytest.raises(ValueError, match=r"^PNN needs all tables to have one embedding_dim"):
        PNN(ebc, 13, [16, 8], [16, 1])
    with pytest.raises(ValueError, match=r"^DLRM needs all tables to have one embedding_dim"):
        DLRM(ebc, 13, [16, 8], [16, 1])


@pytest.mark.parametrize(
    "make",
    [
        lambda ebc, linear, n: MMoE(ebc, n, [16, 8], [8], 2),
        lambda ebc, linear, n: DCN(ebc, n, [16, 1]),
        lambda ebc, linear, n: WideDeep(ebc, linear, n, [16, 1]),
        lambda ebc, linear, n: DeepFM(ebc, linear, n, [16, 8], [16, 1]),
        lambda ebc, linear, n: XDeepFM(ebc, linear, n, [16, 8], [4, 4], [16, 1]),
    ],
    ids=["mmoe", "dcn", "wide_deep", "deepfm", "xdeepfm"],
)
def test_every_model_rejects_a_negative_number_of_dense_features(make):
    tables = make_tables()
    ebc, linear = (EmbeddingBagCollection(t) for t in (tables, linear_table_configs(tables)))
    with pytest.raises(ValueError, match=r"dense_in_features must be >= 0 \(0: none\), got -1"):
        make(ebc, linear, -1)


def test_flat_width_is_the_dense_features_and_every_pooled_embedding():
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["x", "y"]),
        EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=5, feature_names=["z"]),
    ]
    assert flat_width(EmbeddingBagCollection(tables), 13) == 13 + 2 * 4 + 3
