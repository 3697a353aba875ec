"""How often each row is read (:mod:`recsys.distributed.id_profiles`): the synthetic log's
power law against its sampler and against the exact per-rank sum, uniform rows against the
closed form, and frequencies of seen ids; and what the step cost model makes of them."""

from __future__ import annotations

import numpy as np
import pytest

from recsys.build.sharding import plan_inputs
from recsys.config import load_config
from recsys.data.synthetic_drift import zipf_ranks
from recsys.distributed.id_profiles import IdProfile


def _exact_zipf(n: int, alpha: float) -> np.ndarray:
    """Rank r's mass of the power law on [r + 1, r + 2), normalised over [1, n + 1)."""
    edges = np.arange(1, n + 2, dtype=np.float64) ** (1.0 - alpha) / (1.0 - alpha)
    mass = np.diff(edges)
    return mass / mass.sum()


@pytest.mark.parametrize("n, alpha", [(5, 1.1), (1000, 0.8), (300_000, 1.05), (300_000, 1.0)])
def test_the_zipf_profile_holds_the_whole_mass(n, alpha):
    profile = IdProfile.zipf(n, alpha)
    assert profile.rows.sum() == n
    assert np.dot(profile.rows, profile.p) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("n, alpha", [(300_000, 1.05), (300_000, 1.3)])
def test_bucketed_ranks_give_the_exact_distinct_rows(n, alpha):
    """Past 2**16 ranks the profile holds buckets of ranks: its distinct rows are the per-rank
    sum's within 0.1 %."""
    p = _exact_zipf(n, alpha)
    profile = IdProfile.zipf(n, alpha)
    assert profile.rows.size < n // 3
    for draws in (1_000, 50_000, 2_000_000):
        exact = float(np.sum(-np.expm1(draws * np.log1p(-p))))
        assert profile.distinct(draws) == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("n, alpha, draws", [(10_000, 1.1, 1024), (40, 1.1, 30), (3, 0.5, 5)])
def test_distinct_rows_are_what_the_sampler_touches(n, alpha, draws):
    rng = np.random.default_rng(0)
    touched = [np.unique(zipf_ranks(rng, n, alpha, draws)).size for _ in range(400)]
    mean, error = np.mean(touched), np.std(touched) / np.sqrt(len(touched))
    assert abs(IdProfile.zipf(n, alpha).distinct(draws) - mean) < 4 * error + 1e-9


def test_uniform_rows_and_seen_ids():
    assert IdProfile.uniform(100).distinct(50) == pytest.approx(100 * (1 - 0.99**50))
    assert IdProfile.uniform(100).distinct(0) == 0.0
    seen = IdProfile.from_ids(np.array([7, 7, 7, 3, 9, 9]))  # p: 1/2, 1/6, 1/3
    expected = sum(1 - (1 - p) ** 4 for p in (1 / 2, 1 / 6, 1 / 3))
    assert seen.distinct(4) == pytest.approx(expected)
    assert IdProfile.from_ids(np.array([], dtype=np.int64)).distinct(10) == 0.0
    assert IdProfile(np.array([3]), np.array([1.0])).distinct(1) == 3.0  # rows surely read


def test_plan_inputs_profile_the_synthetic_log_and_read_data():
    """The synthetic log's tables get its power law; without one (a drifting stream), the ids
    of the first train chunk."""
    config = load_config("configs/dlrm_synthetic.toml", [])
    inputs = plan_inputs(config)
    table = next(t for t in inputs.configs["sparse_arch"] if t.name == "t_cat_2")
    assert inputs.id_profiles["t_cat_2"].rows.sum() == table.num_embeddings == 10_000
    assert "power law" in inputs.profile_source and inputs.fused_update
    drifting = load_config(
        "configs/dlrm_synthetic.toml",
        ["--data.synthetic.drift_days=2", "--data.synthetic.num_train_samples=20000"],
    )
    seen = plan_inputs(drifting)
    assert "first train chunk" in seen.profile_source
    assert set(seen.id_profiles) == {t.name for group in seen.configs.values() for t in group}
    # Skewed ids touch fewer rows than uniform ones.
    assert inputs.id_profiles["t_cat_2"].distinct(1024) < IdProfile.uniform(10_000).distinct(1024)
