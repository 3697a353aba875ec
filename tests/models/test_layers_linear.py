import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from recsys import EmbeddingBagCollection
from recsys.models import linear_table_configs
from recsys.models.layers import LinearArch

CARDINALITIES = [4, 1, 9]


def make_tables(dim=1, pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(
            name=f"t{f}",
            embedding_dim=dim,
            num_embeddings=n,
            feature_names=[f"f{f}"],
            pooling=pooling,
        )
        for f, n in enumerate(CARDINALITIES)
    ]


def make_sparse(batch_size):
    lengths = torch.randint(0, 4, (len(CARDINALITIES) * batch_size,))
    lengths[0] = 0  # an empty bag
    per_feature = lengths.view(len(CARDINALITIES), batch_size).sum(1)
    values = torch.cat(
        [torch.randint(0, n, (int(k),)) for n, k in zip(CARDINALITIES, per_feature, strict=True)]
    )
    keys = [f"f{f}" for f in range(len(CARDINALITIES))]
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def reference(arch, dense, sparse):
    """sum_f sum over the bag of w_f[id] (mean for MEAN pooling) + dense linear + bias."""
    if arch.dense_arch is None:
        out = arch.bias.double().expand(dense.shape[0], -1).clone()  # [B, T]
    else:
        weight, bias = arch.dense_arch.weight, arch.dense_arch.bias
        out = dense.double() @ weight.double().T + bias.double()  # [B, T]
    features = sparse.to_dict()
    for config in arch.sparse_arch.embedding_bag_configs():
        table = arch.sparse_arch.embedding_bags[config.name].weight.double()
        jt = features[config.feature_names[0]]
        for b, ids in enumerate(jt.to_dense()):
            if len(ids):
                rows = table[ids]
                out[b] += rows.mean(0) if config.pooling == PoolingType.MEAN else rows.sum(0)
    return out


@pytest.mark.parametrize(("dim", "num_tasks"), [(1, 1), (1, 3), (3, 3)])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_matches_the_sum_of_per_id_weights(dim, num_tasks, pooling):
    arch = LinearArch(EmbeddingBagCollection(make_tables(dim, pooling)), 5, num_tasks)
    dense, sparse = torch.randn(7, 5), make_sparse(7)
    out = arch(dense, sparse)
    assert out.shape == (7, num_tasks)
    torch.testing.assert_close(out.double(), reference(arch, dense, sparse), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for name, p in arch.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


@pytest.mark.parametrize("num_tasks", [1, 3])
def test_without_dense_features_only_a_bias_remains(num_tasks):
    arch = LinearArch(EmbeddingBagCollection(make_tables()), 0, num_tasks)
    assert arch.dense_arch is None
    assert [name for name, _ in arch.named_parameters() if "embedding_bags" not in name] == ["bias"]
    assert torch.equal(arch.bias, torch.zeros(num_tasks))  # as nn.Linear(0, T) would start
    with torch.no_grad():
        arch.bias.copy_(torch.randn(num_tasks))
    dense, sparse = torch.randn(7, 0), make_sparse(7)
    out = arch(dense, sparse)
    assert out.shape == (7, num_tasks)
    torch.testing.assert_close(out.double(), reference(arch, dense, sparse), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for name, p in arch.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_linear_table_configs_twins_and_a_subset_of_the_features():
    tables = linear_table_configs(make_tables(dim=8))
    assert [(t.name, t.embedding_dim) for t in tables] == [
        ("t0_linear", 1),
        ("t1_linear", 1),
        ("t2_linear", 1),
    ]
    arch = LinearArch(EmbeddingBagCollection(tables[1:]), 5, 1)  # the input also holds f0
    assert arch(torch.randn(6, 5), make_sparse(6)).shape == (6, 1)


def test_bad_table_dims():
    with pytest.raises(ValueError, match=r"embedding_dim 1 \(or num_tasks = 2\), got \[3\]"):
        LinearArch(EmbeddingBagCollection(make_tables(dim=3)), 5, 2)
    mixed = [*make_tables(dim=1), EmbeddingBagConfig(name="x", embedding_dim=2, num_embeddings=3)]
    with pytest.raises(ValueError, match=r"got \[1, 2\]"):
        LinearArch(EmbeddingBagCollection(mixed), 5, 2)
    with pytest.raises(ValueError, match=r"dense_in_features must be >= 0 \(0: none\), got -1"):
        LinearArch(EmbeddingBagCollection(make_tables()), -1, 1)
