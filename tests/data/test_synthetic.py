from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from recsys.config import SyntheticConfig, load_config
from recsys.data.synthetic import CHUNK_SIZE, SyntheticDataset

REPO = Path(__file__).resolve().parents[2]


def small_config(**overrides) -> SyntheticConfig:
    fields = dict(
        cardinalities=[50, 1000, 7, 20000, 1],
        bag_sizes=[1, 4, 1, 2, 1],
        num_train_samples=3 * CHUNK_SIZE + 100,
        num_valid_samples=1000,
        num_test_samples=2 * CHUNK_SIZE,
    )
    fields.update(overrides)
    return SyntheticConfig(**fields)


def assert_batches_equal(a, b):
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())


def test_same_seed_same_data_any_order():
    a = SyntheticDataset(small_config(), seed=3)
    b = SyntheticDataset(small_config(), seed=3)
    later = b.chunk("train", 2)  # chunks are independent of the order they are built in
    assert_batches_equal(a.chunk("train", 2), later)
    assert_batches_equal(a.chunk("test", 1), b.chunk("test", 1))


def test_seeds_and_splits_differ():
    a = SyntheticDataset(small_config(), seed=0)
    b = SyntheticDataset(small_config(), seed=1)
    assert not torch.equal(a.chunk("train", 0).dense, b.chunk("train", 0).dense)
    assert not torch.equal(a.chunk("train", 0).dense, a.chunk("test", 0).dense)
    assert not torch.equal(a.chunk("train", 0).dense, a.chunk("train", 1).dense)


def test_shapes_sizes_and_ids_in_range():
    config = small_config(num_tasks=2)
    data = SyntheticDataset(config, seed=0)
    assert data.num_chunks("train") == 4
    assert [data.chunk_rows("train", i) for i in range(4)] == [CHUNK_SIZE] * 3 + [100]
    chunk = data.chunk("train", 3)
    assert chunk.dense.shape == (100, 13) and chunk.dense.dtype == torch.float32
    assert chunk.labels.shape == (100, 2)
    assert chunk.sparse.keys() == list(data.spec.sparse_names)
    for name, n in zip(data.spec.sparse_names, config.cardinalities, strict=True):
        ids = chunk.sparse[name].values()
        assert ids.numel() == 0 or (ids.min() >= 0 and ids.max() < n)
    assert set(torch.unique(chunk.labels).tolist()) <= {0.0, 1.0}
    assert data.spec.label_names == ("task_0", "task_1")


def test_bag_lengths_one_hot_and_multi_hot():
    data = SyntheticDataset(small_config(), seed=0)
    chunk = data.chunk("train", 0)
    one_hot = chunk.sparse["cat_0"].lengths()
    assert torch.all(one_hot == 1)
    multi = chunk.sparse["cat_1"].lengths()
    assert multi.min() == 0 and multi.max() == 4  # empty bags occur, never more than 4
    assert 1.7 < multi.float().mean() < 2.3  # uniform on 0..4


def test_fixed_bag_lengths_hold_exactly_the_bag_size():
    data = SyntheticDataset(small_config(bag_lengths="fixed"), seed=0)
    sparse = data.chunk("train", 0).sparse
    for feature, size in zip(sparse.keys(), [1, 4, 1, 2, 1], strict=True):
        assert torch.all(sparse[feature].lengths() == size)
    # The teacher still separates the classes (its oracle AUC is the data's).
    chunk = data.chunk("test", 0)
    oracle = binary_auroc(data.click_probability(chunk)[:, 0], chunk.labels[:, 0].long())
    assert float(oracle) > 0.75


def test_ids_are_zipf_skewed():
    data = SyntheticDataset(small_config(zipf_alpha=1.2), seed=0)
    ids = data.chunk("train", 0).sparse["cat_3"].values().numpy()
    counts = np.sort(np.bincount(ids, minlength=20000))[::-1]
    assert counts[0] > 0.05 * ids.size  # the hottest id takes a large share
    assert np.count_nonzero(counts) > 500  # and there is a long tail


def test_teacher_calibration_and_oracle_auc():
    config = small_config(click_rate=0.3)
    data = SyntheticDataset(config, seed=0)
    chunk = data.chunk("test", 0)
    probability = data.click_probability(chunk)
    assert probability.shape == (CHUNK_SIZE, 1)
    assert abs(float(probability.mean()) - 0.3) < 0.03
    assert abs(float(chunk.labels.mean()) - 0.3) < 0.03
    oracle = float(binary_auroc(probability[:, 0], chunk.labels[:, 0].long()))
    assert oracle > 0.75  # real signal to learn
    noise = float(binary_auroc(torch.rand(CHUNK_SIZE), chunk.labels[:, 0].long()))
    assert abs(noise - 0.5) < 0.05


def test_teacher_logit_std_controls_difficulty():
    def oracle(std: float) -> float:
        data = SyntheticDataset(small_config(teacher_logit_std=std), seed=0)
        chunk = data.chunk("test", 0)
        return float(binary_auroc(data.click_probability(chunk)[:, 0], chunk.labels[:, 0].long()))

    assert oracle(0.5) + 0.1 < oracle(3.0)


# Recorded from the generator before tasks got streams of their own: one-task data must not
# move (every single-task recipe, test and README number depends on it). Ids and labels are
# exact; float sums to 1e-9 and probabilities to 1e-6, as libm / BLAS may round the last bit
# differently on another CPU (a change of draws or formula moves them far more).
SINGLE_TASK_REFERENCE = [
    # seed, split, chunk, label sum, index sum of the clicks, dense sum, id sum, length sum, p[:4]
    (
        0, "train", 3, 21, 1114, 2349.0298429727554, 1239736, 592,
        [0.11713927984237671, 0.07166267186403275, 0.05015488341450691, 0.2692714035511017],
    ),
    (
        3, "test", 1, 2077, 8504198, 149612.54206442833, 86089081, 49346,
        [0.05583349987864494, 0.010979044251143932, 0.08622758835554123, 0.005151012446731329],
    ),
]  # fmt: skip


@pytest.mark.parametrize("reference", SINGLE_TASK_REFERENCE, ids=lambda r: f"{r[1]}{r[2]}")
def test_single_task_chunks_are_the_recorded_ones(reference):
    seed, split, index, clicks, click_rows, dense_sum, id_sum, length_sum, first = reference
    data = SyntheticDataset(small_config(), seed=seed)
    chunk = data.chunk(split, index)
    labels = chunk.labels[:, 0]
    assert int(labels.sum()) == clicks
    assert int(labels.nonzero().sum()) == click_rows
    assert float(chunk.dense.double().sum()) == pytest.approx(dense_sum, rel=1e-9, abs=0)
    assert int(chunk.sparse.values().sum()) == id_sum
    assert int(chunk.sparse.lengths().sum()) == length_sum
    probability = data.click_probability(chunk)[:4, 0].tolist()
    assert probability == pytest.approx(first, rel=1e-6, abs=0)


@pytest.mark.parametrize("num_dense", [13, 0])
def test_a_task_does_not_depend_on_how_many_tasks_there_are(num_dense):
    datasets = {
        num_tasks: SyntheticDataset(small_config(num_tasks=num_tasks, num_dense=num_dense), seed=5)
        for num_tasks in (1, 2, 3)
    }
    chunks = {num_tasks: data.chunk("train", 3) for num_tasks, data in datasets.items()}
    probability = {n: datasets[n].click_probability(chunk) for n, chunk in chunks.items()}
    assert torch.equal(probability[2][:, :1], probability[1])
    assert torch.equal(chunks[2].labels[:, :1], chunks[1].labels)
    assert torch.equal(probability[3][:, :2], probability[2])
    assert torch.equal(chunks[3].labels[:, :2], chunks[2].labels)
    assert torch.equal(chunks[3].dense, chunks[1].dense)
    assert not torch.equal(probability[3][:, 1], probability[3][:, 2])  # tasks differ


def test_categorical_only_data_has_a_learnable_teacher():
    data = SyntheticDataset(small_config(num_dense=0, num_tasks=2), seed=0)
    assert data.spec.dense_names == () and data.spec.num_dense == 0
    chunk = data.chunk("test", 0)
    assert chunk.dense.shape == (CHUNK_SIZE, 0) and chunk.dense.dtype == torch.float32
    probability = data.click_probability(chunk)
    for t in range(2):
        assert abs(float(probability[:, t].mean()) - 0.25) < 0.03
        assert float(binary_auroc(probability[:, t], chunk.labels[:, t].long())) > 0.75


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(cardinalities=[]), "cardinalities is empty"),
        (dict(cardinalities=[5, 0]), r"cardinalities\[1\] = 0"),
        (dict(bag_sizes=[1, 2]), "bag_sizes has 2 entries but there are 5"),
        (dict(click_rate=1.5), "click_rate = 1.5"),
        (dict(num_dense=-1), r"num_dense = -1; expected >= 0 \(0: categorical only\)"),
        (dict(num_test_samples=0), "num_test_samples = 0"),
    ],
)
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        SyntheticDataset(small_config(**overrides))


def test_bad_split_and_chunk():
    data = SyntheticDataset(small_config())
    with pytest.raises(ValueError, match="unknown split 'tets'"):
        data.num_samples("tets")
    with pytest.raises(IndexError, match="chunk 9"):
        data.chunk("train", 9)


def _digest(batch) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in (batch.dense, batch.sparse.values(), batch.sparse.lengths(), batch.labels):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_stationary_data_is_bitwise_what_it_was_before_drift_existed():
    """Digests taken before the drift options existed: drift_days = 0 changes nothing."""
    config = SyntheticConfig(
        num_dense=3,
        cardinalities=[50, 1000, 7],
        bag_sizes=[1, 3, 2],
        num_tasks=2,
        num_train_samples=10000,
        num_valid_samples=100,
        num_test_samples=100,
    )
    data = SyntheticDataset(config, seed=3)
    digests = [_digest(data.chunk(s, i)) for s, i in (("train", 0), ("train", 1), ("valid", 0))]
    assert digests == ["a47f559a3e93ab12", "c5ee87433926e8e7", "53b66c2cedfaf5e1"]
    data = SyntheticDataset(SyntheticConfig(num_train_samples=20000), seed=3)
    assert _digest(data.chunk("train", 1)) == "66ccb453aa55e5b5"
    assert data.spec.id_encoding == "index" and data.drift is None


@pytest.mark.parametrize(
    ("recipe", "digests"),
    [
        ("dlrm_synthetic", ["23ada395459d36d7", "5724b42bebf049ba", "cf2562e588d4d103"]),
        ("mmoe_synthetic", ["6bc59fc102f7454e", "3cf2b0fc333dcc12", "14668d08babb91b6"]),
    ],
)
def test_recipe_data_is_bitwise_what_it_was_before_large_tables(recipe, digests):
    """Digests taken before features above MAX_TABLE_IDS got hashed teacher parameters: the
    recipes' tables are small, so `make train` sees the same samples and labels."""
    config = load_config(REPO / "configs" / f"{recipe}.toml")
    data = SyntheticDataset(config.data.synthetic, seed=config.run.seed)
    chunks = (("train", 0), ("train", 243), ("test", 15))
    assert [_digest(data.chunk(split, index)) for split, index in chunks] == digests
