import pytest
import torch
import torch.nn.functional as F
import torchrec
import torchrec.models.dlrm as torchrec_dlrm
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys import DLRM, EmbeddingBagCollection
from recsys.embedding.optim import SGD


def make_tables(num_features=5, dim=8):
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=10 + 7 * i, feature_names=[f"f{i}"]
        )
        for i in range(num_features)
    ]


def make_inputs(batch_size=9, num_features=5, num_dense=13):
    lengths = torch.randint(0, 3, (num_features * batch_size,))
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


def test_shapes_and_gradients_reach_every_parameter():
    model = DLRM(EmbeddingBagCollection(make_tables()), 13, [32, 8], [16, 3])
    dense, sparse = make_inputs()
    logits = model(dense, sparse)
    assert logits.shape == (9, 3)
    logits.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_matches_torchrec_dlrm_with_same_weights():
    tables = make_tables()
    ours = DLRM(EmbeddingBagCollection(tables), 13, [32, 8], [16, 4, 1])
    theirs = torchrec_dlrm.DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, 8],
        over_arch_layer_sizes=[16, 4, 1],
    )
    ours_params, theirs_params = list(ours.parameters()), list(theirs.parameters())
    assert [p.shape for p in ours_params] == [p.shape for p in theirs_params]
    with torch.no_grad():
        for a, b in zip(ours_params, theirs_params, strict=True):
            b.copy_(a)
    dense, sparse = make_inputs()
    torch.testing.assert_close(ours(dense, sparse), theirs(dense, sparse), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_recsys_collection_inside_torchrec_dlrm_trains_like_torchrecs(fused):
    """A TorchRec model gets recsys' collection by swapping one constructor: loaded with the
    same weights it gives the same outputs, and trains the same over several SGD steps, with
    dense table gradients or with SGD fused into recsys' backward."""
    tables = make_tables()

    def torchrec_model(collection):
        return torchrec_dlrm.DLRM(
            embedding_bag_collection=collection,
            dense_in_features=13,
            dense_arch_layer_sizes=[32, 8],
            over_arch_layer_sizes=[16, 1],
        )

    theirs = torchrec_model(torchrec.EmbeddingBagCollection(tables))
    collection = EmbeddingBagCollection(tables, optimizer=SGD(lr=0.1) if fused else None)
    ours = torchrec_model(collection)
    assert ours.state_dict().keys() >= theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict(), strict=not fused)  # fused adds optimizer_step

    def sgd(model):
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    optimizers = sgd(ours), sgd(theirs)
    for _ in range(3):
        dense, sparse = make_inputs()
        labels = torch.randint(0, 2, (9, 1)).float()
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    dense, sparse = make_inputs()
    torch.testing.assert_close(ours(dense, sparse), theirs(dense, sparse), rtol=1e-5, atol=1e-6)
    ours_state = ours.state_dict()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours_state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_bad_sizes():
    with pytest.raises(
        ValueError, match=r"dense_arch_layer_sizes = \[32, 16\] must end with the embedding_dim 8"
    ):
        DLRM(EmbeddingBagCollection(make_tables()), 13, [32, 16], [16, 1])
    mixed = [*make_tables(), EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=3)]
    with pytest.raises(ValueError, match="one embedding_dim"):
        DLRM(EmbeddingBagCollection(mixed), 13, [32, 8], [16, 1])
