"""The drifting synthetic stream (``SyntheticConfig.drift_days > 0``): ids that are born, peak and
die, and teacher parameters derived from hashes of the ids.

**Id process.** Feature f with cardinality n gets k = max(1, round(new_ids_per_day * n)) new ids
every day and keeps A = ceil(n / k) days of them alive (about n ids). Ids are numbered by birth:
the ids born on day c (c > -A: the stream has been running before day 0) are

    [(c + A - 1) k, (c + A) k)

so day 0 sees ids [0, A k), day d ids [d k, (d + A) k), and days 0..D use (A + D) k ids in all.
A draw on day d picks an age a in [0, A) with P(a) ~ (1 - popularity_drift)^a (popularity moves
to recent ids; an id dies at age A), then a Zipf(zipf_alpha) rank r in [0, k) inside the day
d - a cohort, mapped to id (r * m + s_c) mod k of that cohort (m coprime to k, s_c a hash of
the seed, feature and cohort: the popular ids of a cohort are spread over it). So an id keeps
its popularity rank inside its cohort for life and the cohort's share of the traffic decays
by (1 - popularity_drift) a day; every day looks alike up to the shift of k ids. Sampling is
O(rows): no per-day table over the ids.

**Hashed teacher.** The teacher cannot hold a table of every id of an open-ended stream: an id's
latent vector E_f[id] ~ N(0, 1/K) and first-order weight b_{t,f}[id] ~ N(0, importance_f^2) are
normals drawn from splitmix64 hashes of (seed, stream, feature, id number), Box-Muller. The same
id gets the same parameters on every day, in every chunk and process: a new id has a
well-defined, learnable effect. Stationary data draws the parameters of its features of more
than 2^20 ids the same way (``recsys.data.synthetic``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from recsys.config import SyntheticConfig
from recsys.data.keys import splitmix64

_COHORT_SHIFT_STREAM = 0x5EED_C0
_MULTIPLIER_STREAM = 1_000_037  # seed stream of the cohorts' multipliers: [seed, stream]
_EMBEDDING_STREAM = 1
_BIAS_STREAM = 2  # task t: _BIAS_STREAM + t
_EXACT_PRODUCT = 1 << 31  # below it, rank * multiplier + shift < n^2 fits int64


def coprime_multiplier(n: int, rng: np.random.Generator) -> int:
    """A random m in [1, n) with gcd(m, n) = 1 (1 when n <= 2): r -> r * m mod n is a bijection."""
    if n <= 2:
        return 1
    while True:
        m = int(rng.integers(1, n))
        if math.gcd(m, n) == 1:
            return m


def affine_mod(rank: np.ndarray, multiplier: int, shift: int | np.ndarray, n: int) -> np.ndarray:
    """(rank * multiplier + shift) mod n, exact for ranks, multiplier and shifts in [0, n) and
    n <= 2^40 (int64 [N]). The product may pass int64 above n = 2^31: it is then reduced as
    rank * multiplier - q n with q the float64 quotient (off by at most one below 2^40, so one
    correction each way) in wrapping uint64 arithmetic, where the difference is exact."""
    if n <= _EXACT_PRODUCT:
        return (rank * multiplier + shift) % n
    quotient = np.floor(rank.astype(np.float64) * float(multiplier) / float(n))
    with np.errstate(over="ignore"):
        product = rank.astype(np.uint64) * np.uint64(multiplier)
        remainder = (product - quotient.astype(np.uint64) * np.uint64(n)).view(np.int64)
    remainder = np.where(remainder < 0, remainder + n, remainder)  # in [-n, 2n) before
    remainder = np.where(remainder >= n, remainder - n, remainder)
    return (remainder + shift) % n


def zipf_ranks(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """Ranks in [0, n) with P(r) ~ (r + 1)^-alpha (inverse CDF of the continuous power law)."""
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        x = np.power(n + 1.0, u)
    else:
        top = np.power(n + 1.0, 1.0 - alpha)
        x = np.power(1.0 + u * (top - 1.0), 1.0 / (1.0 - alpha))
    return np.minimum(np.floor(x).astype(np.int64) - 1, n - 1)


class DriftingIds:
    """The id process of the module docstring, for every feature.

    Args:
        config: the ``[data.synthetic]`` section (cardinalities, zipf_alpha, drift options).
        seed: decides how ranks map to ids inside a cohort.

    Example::

        ids = DriftingIds(config, seed=0)
        numbers = ids.sample(rng, feature=0, day=3, size=1000)    # int64 id numbers
        ids.birth_day(0, numbers)                                 # day each was born (<= 3)
    """

    def __init__(self, config: SyntheticConfig, seed: int) -> None:
        self.seed = seed
        self.num_days = config.drift_days + 1  # train days 0..D-1, then day D
        self.zipf_alpha = config.zipf_alpha
        self.new_per_day = [max(1, round(config.new_ids_per_day * n)) for n in config.cardinalities]
        self.alive_days = [
            math.ceil(n / k) for n, k in zip(config.cardinalities, self.new_per_day, strict=True)
        ]
        self.decay = 1.0 - config.popularity_drift
        rng = np.random.default_rng(np.random.SeedSequence([seed, _MULTIPLIER_STREAM]))
        self.multipliers = [coprime_multiplier(k, rng) for k in self.new_per_day]

    def num_ids(self, feature: int) -> int:
        """Ids of ``feature`` over days 0..drift_days: (A + D) k."""
        return (self.alive_days[feature] + self.num_days - 1) * self.new_per_day[feature]

    def birth_day(self, feature: int, id_numbers: np.ndarray) -> np.ndarray:
        """The day each id was born (negative: before day 0)."""
        return np.asarray(id_numbers) // self.new_per_day[feature] - (self.alive_days[feature] - 1)

    def newborn_traffic_share(self, feature: int) -> float:
        """Expected share of a day's draws of ``feature`` that hit ids born that day, P(a = 0)."""
        alive = self.alive_days[feature]
        if self.decay == 1.0:
            return 1.0 / alive
        return (1.0 - self.decay) / (1.0 - self.decay**alive)

    def sample(self, rng: np.random.Generator, feature: int, day: int, size: int) -> np.ndarray:
        """``size`` id numbers of ``feature`` drawn on ``day`` (int64)."""
        k, alive = self.new_per_day[feature], self.alive_days[feature]
        u = rng.random(size)
        if self.decay == 1.0:
            age = np.floor(u * alive)
        else:  # inverse CDF of the geometric law truncated to [0, alive)
            age = np.floor(np.log1p(-u * (1.0 - self.decay**alive)) / math.log(self.decay))
        age = np.clip(age, 0, alive - 1).astype(np.int64)
        rank = zipf_ranks(rng, k, self.zipf_alpha, size)
        cohort = day - age  # birth day, > -alive
        first = (cohort + alive - 1) * k
        shift = self._cohort_shift(feature, cohort)
        return first + affine_mod(rank, self.multipliers[feature], shift, k)

    def _cohort_shift(self, feature: int, cohort: np.ndarray) -> np.ndarray:
        salt = np.uint64(hash_salt(self.seed, _COHORT_SHIFT_STREAM, feature))
        mixed = splitmix64(cohort.astype(np.uint64) ^ salt)
        return (mixed % np.uint64(self.new_per_day[feature])).astype(np.int64)


class HashedTeacherTables:
    """Teacher parameters of any id, from hashes (see module docstring).

    Args:
        seed: the dataset's seed.
        importance: per feature, the std of its first-order weights.
        dim: latent dimension K.
    """

    def __init__(self, seed: int, importance: np.ndarray, dim: int) -> None:
        self.seed = seed
        self.importance = importance
        self.dim = dim

    def tables(
        self, feature: int, id_numbers: torch.Tensor, num_tasks: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Small tables over the distinct ids of a batch: (local ids [L] indexing them, latent
        vectors f32 [U, K], per task the first-order weights f32 [U, 1])."""
        unique, local = torch.unique(id_numbers, return_inverse=True)
        numbers = unique.numpy()
        embedding = hashed_normals(self.seed, _EMBEDDING_STREAM, feature, numbers, self.dim)
        embedding = torch.from_numpy(embedding / math.sqrt(self.dim)).float()
        biases = [
            torch.from_numpy(
                self.importance[feature]
                * hashed_normals(self.seed, _BIAS_STREAM + t, feature, numbers, 1)
            ).float()
            for t in range(num_tasks)
        ]
        return local, embedding, biases


def hash_salt(seed: int, stream: int, feature: int) -> int:
    """A 64-bit salt for the hashes of (seed, stream, feature)."""
    packed = np.array([seed & (2**64 - 1), stream, feature], dtype=np.uint64)
    salt = np.uint64(0)
    for value in packed:
        salt = splitmix64(np.array([salt ^ value], np.uint64))[0]
    return int(salt)


def hashed_normals(
    seed: int, stream: int, feature: int, id_numbers: np.ndarray, width: int
) -> np.ndarray:
    """float64 [N, width] standard normals, a pure function of (seed, stream, feature, id, j)."""
    salt = np.uint64(hash_salt(seed, stream, feature))
    base = splitmix64(np.asarray(id_numbers).astype(np.uint64) ^ salt)  # [N]
    columns = []
    with np.errstate(over="ignore"):
        for j in range(width):
            first = splitmix64(base + np.uint64(2 * j + 1))
            second = splitmix64(base + np.uint64(2 * j + 2))
            u1 = ((first >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # (0, 1)
            u2 = (second >> np.uint64(11)).astype(np.float64) / 2.0**53
            columns.append(np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2))
    return np.stack(columns, axis=1) if columns else np.zeros((len(base), 0))
