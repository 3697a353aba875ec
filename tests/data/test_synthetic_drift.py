"""The drifting synthetic stream: ids born and fading day by day, a hashed teacher, raw keys."""

import numpy as np
import pytest
import torch

from recsys.config import SyntheticConfig
from recsys.data.keys import synthetic_keys
from recsys.data.synthetic import CHUNK_SIZE, SyntheticDataset
from recsys.data.synthetic_drift import HashedTeacherTables


def drift_config(**overrides) -> SyntheticConfig:
    fields = dict(
        num_dense=2,
        cardinalities=[50, 2000],
        bag_sizes=[1, 3],
        drift_days=4,
        new_ids_per_day=0.2,
        popularity_drift=0.0,
        num_train_samples=2 * CHUNK_SIZE + 1000,
        num_valid_samples=3000,
        num_test_samples=3000,
    )
    fields.update(overrides)
    return SyntheticConfig(**fields)


def test_days_layout_of_the_splits():
    data = SyntheticDataset(drift_config(), seed=0)
    days = data.chunk_days("train")
    rows = [data.chunk_rows("train", i) for i in range(data.num_chunks("train"))]
    assert days == sorted(days) and set(days) == {0, 1, 2, 3}  # train: days 0..D-1 in order
    per_day = [sum(r for r, d in zip(rows, days, strict=True) if d == day) for day in range(4)]
    assert sum(per_day) == data.config.num_train_samples and max(per_day) - min(per_day) <= 1
    assert all(0 < r <= CHUNK_SIZE for r in rows)
    assert data.chunk_days("valid") == data.chunk_days("test") == [4]
    assert len(data.chunk("train", 1)) == rows[1]
    assert data.spec.cardinalities == tuple(data.num_ids) == (90, 3600)  # (A + D) k
    batch = data.chunk("valid", 0)  # day 4: ids [4k, (4 + A) k)
    assert data.drift.birth_day(0, batch.sparse["cat_0"].values().numpy()).min() >= 0


def test_new_ids_share_and_they_never_appear_earlier():
    data = SyntheticDataset(drift_config(), seed=1)
    seen: set[int] = set()
    for day in range(5):
        ids = data.day(day, 20_000).sparse["cat_0"].values().numpy()
        born = data.drift.birth_day(0, ids)
        assert born.max() == day and born.min() > day - data.drift.alive_days[0]
        assert not set(ids[born == day].tolist()) & seen  # new ids did not exist before
        distinct = np.unique(ids)
        if day:  # every living id shows up in 20k draws: unseen share = new_ids_per_day exactly
            assert len(np.setdiff1d(distinct, list(seen))) / len(distinct) == pytest.approx(0.2)
        assert np.mean(born == day) == pytest.approx(data.drift.newborn_traffic_share(0), abs=0.02)
        seen |= set(distinct.tolist())


def test_popularity_moves_to_recent_ids():
    data = SyntheticDataset(drift_config(popularity_drift=0.5), seed=2)
    assert data.drift.newborn_traffic_share(1) == pytest.approx(0.5 / (1 - 0.5**5))
    cohort_share = []  # share of each day's traffic on the ids born on day 1
    mean_birth = []
    for day in range(5):
        ids = data.day(day, 20_000).sparse["cat_1"].values().numpy()
        born = data.drift.birth_day(1, ids)
        cohort_share.append(np.mean(born == 1))
        mean_birth.append(born.mean())
        if day:
            assert np.mean(born == day) == pytest.approx(0.516, abs=0.02)
    assert cohort_share[0] == 0 and cohort_share[1] > cohort_share[2] > cohort_share[3] > 0
    np.testing.assert_allclose(np.diff(mean_birth), 1.0, atol=0.05)  # the window moves a day a day


def test_teacher_scores_an_id_the_same_on_every_day():
    data = SyntheticDataset(drift_config(), seed=3)
    early, late = data.day(1, 4000), data.day(3, 4000)
    both = type(early).concat([early, late])
    # a row's probability does not depend on the day or on the rows beside it
    p = data.click_probability(both)
    torch.testing.assert_close(
        p, torch.cat([data.click_probability(early), data.click_probability(late)]), rtol=0, atol=0
    )
    tables = HashedTeacherTables(3, np.array([0.5, 1.0]), 4)
    local, vectors, biases = tables.tables(1, torch.tensor([7, 99, 7, 1234]), 2)
    assert torch.equal(vectors[local[0]], vectors[local[2]])
    alone = tables.tables(1, torch.tensor([7]), 2)
    assert torch.equal(alone[1][0], vectors[local[0]]) and torch.equal(
        alone[2][1][0], biases[1][local[0]]
    )
    # ids born on later days are scored too: labels follow the teacher on the test day
    test = data.chunk("test", 0)
    born = data.drift.birth_day(1, test.sparse["cat_1"].values().numpy())
    assert (born == 4).any()
    assert abs(test.labels.mean().item() - data.click_probability(test).mean().item()) < 0.03


def test_raw_and_index_agree_up_to_the_id_mapping():
    index = SyntheticDataset(drift_config(), seed=4)
    raw = SyntheticDataset(drift_config(id_encoding="raw"), seed=4)
    assert raw.spec.id_encoding == "raw" and raw.spec.cardinalities == (0, 0)
    for a, b in (
        (index.chunk("train", 2), raw.chunk("train", 2)),
        (index.day(4, 500), raw.day(4, 500)),
    ):
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
        assert torch.equal(raw.id_numbers(b.sparse.values()), a.sparse.values())
        keys = np.concatenate(
            [synthetic_keys(f, a.sparse[k].values().numpy()) for f, k in enumerate(a.sparse.keys())]
        )
        assert np.array_equal(keys, b.sparse.values().numpy()) and keys.min() > 2**40
        torch.testing.assert_close(
            index.click_probability(a), raw.click_probability(b), rtol=0, atol=0
        )
    stationary = SyntheticDataset(drift_config(drift_days=0, id_encoding="raw"), seed=4)
    plain = SyntheticDataset(drift_config(drift_days=0), seed=4)
    a, b = plain.chunk("valid", 0), stationary.chunk("valid", 0)
    assert torch.equal(stationary.id_numbers(b.sparse.values()), a.sparse.values())
    assert torch.equal(a.labels, b.labels)


def test_day_draws_are_prefix_stable_and_independent():
    data = SyntheticDataset(drift_config(), seed=5)
    long, short = data.day(2, CHUNK_SIZE + 10), data.day(2, 100)
    assert torch.equal(long.slice(0, 100).sparse.values(), short.sparse.values())
    assert not torch.equal(data.day(2, 100, draw=1).dense, short.dense)
    with pytest.raises(ValueError, match="day 5 outside"):
        data.day(5, 10)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(new_ids_per_day=0.0), "new_ids_per_day = 0.0; expected in"),
        (dict(popularity_drift=1.0), "popularity_drift = 1.0; expected in"),
        (dict(num_train_samples=3), "every train day needs samples"),
        (dict(id_encoding="hashed"), "id_encoding = 'hashed'"),
    ],
)
def test_bad_drift_options(overrides, message):
    with pytest.raises(ValueError, match=message):
        SyntheticDataset(drift_config(**overrides))
