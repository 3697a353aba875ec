"""How often each row of a table is read, for the step cost model's distinct rows
(:mod:`recsys.distributed.step_cost`): a batch of n ids drawn from a table touches
``sum_i 1 - (1 - p_i)^n`` distinct rows in expectation, p_i the chance that an id is row i.
The distinct rows size a replicated table's gradient exchange (bytes on the wire) and the
fused optimizer's row updates, so a skewed table (a few hot rows) moves far fewer bytes than
uniform ids would.

An :class:`IdProfile` holds the p_i as groups of rows of one probability (``rows[k]`` rows of
probability ``p[k]`` each), compact for a table of millions of rows:

- :meth:`IdProfile.uniform`: every row alike (the model's assumption without data);
- :meth:`IdProfile.zipf`: the synthetic log's power law (``data.synthetic.zipf_alpha``,
  :func:`~recsys.data.synthetic_drift.zipf_ranks`), exact per rank up to ``2**16`` ranks and in
  geometric buckets of ranks past that (each bucket's mean probability: within 0.1 % of the
  exact sum);
- :meth:`IdProfile.from_ids`: the frequencies of ids seen (a sample of the training data).

Example::

    profile = IdProfile.zipf(10_000, alpha=1.1)
    profile.distinct(1024)   # distinct rows 1,024 draws touch, in expectation
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["IdProfile"]

_EXACT_RANKS = 1 << 16  # ranks given one by one; past them, geometric buckets
_BUCKET_RATIO = 1.001


@dataclass(frozen=True)
class IdProfile:
    """``rows[k]`` rows of a table are each drawn with probability ``p[k]`` (see the module
    docstring). The probabilities need not sum to 1 over a table's rows: ids outside the
    profile (e.g. never seen in a sample) count as touching no row."""

    rows: np.ndarray  # [K] int64
    p: np.ndarray  # [K] float64

    @classmethod
    def uniform(cls, num_rows: int) -> IdProfile:
        num_rows = max(int(num_rows), 1)
        return cls(np.array([num_rows], dtype=np.int64), np.array([1.0 / num_rows]))

    @classmethod
    def zipf(cls, num_rows: int, alpha: float) -> IdProfile:
        """Ranks 0..n-1 drawn as :func:`~recsys.data.synthetic_drift.zipf_ranks` draws them:
        x from the power law x^-alpha on [1, n + 1), rank floor(x) - 1, so rank r has the
        law's mass on [r + 1, r + 2)."""
        n = max(int(num_rows), 1)
        exact = np.arange(1, min(n, _EXACT_RANKS) + 1, dtype=np.float64)  # r + 1
        starts = [exact]
        if n > _EXACT_RANKS:
            edges = np.unique(
                np.geomspace(
                    _EXACT_RANKS + 1,
                    n + 1,
                    int(math.log((n + 1) / (_EXACT_RANKS + 1)) / math.log(_BUCKET_RATIO)) + 2,
                ).round()
            )
            starts.append(edges[:-1])
        lower = np.concatenate(starts)  # each group's first r + 1
        upper = np.append(lower[1:], n + 1.0)  # and the next group's
        mass = _power_integral(lower, upper, alpha) / _power_integral(1.0, n + 1.0, alpha)
        rows = (upper - lower).astype(np.int64)
        return cls(rows, mass / rows)

    @classmethod
    def from_ids(cls, ids: np.ndarray) -> IdProfile:
        """The frequencies of ``ids`` (one table's ids of a sample): a row seen c times of N
        has probability c / N; rows never seen, 0."""
        ids = np.asarray(ids).ravel()
        if ids.size == 0:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0))
        _, seen = np.unique(ids, return_counts=True)
        times, rows = np.unique(seen, return_counts=True)
        return cls(rows.astype(np.int64), times / ids.size)

    def distinct(self, draws: float) -> float:
        """Distinct rows ``draws`` ids touch, in expectation."""
        if draws <= 0 or self.rows.size == 0:
            return 0.0
        p = np.minimum(self.p, 1.0)
        # 1 - (1 - p)^n, stable for tiny p; a row of p = 1 is touched by any draw.
        touched = np.where(p < 1.0, -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-16))), 1.0)
        return float(np.dot(self.rows, touched))


def _power_integral(lower, upper, alpha: float):
    """The integral of x^-alpha from ``lower`` to ``upper``."""
    if abs(alpha - 1.0) < 1e-9:
        return np.log(upper) - np.log(lower)
    return (np.power(upper, 1.0 - alpha) - np.power(lower, 1.0 - alpha)) / (1.0 - alpha)
