"""Ranking samples on the synthetic interaction log (:mod:`recsys.data.synthetic_sequences`)
whose click probability is known, so a ranking model's AUC can be read against the best
achievable.

Each user's whole log is the history; then ``num_candidates`` candidates for the next event:
the first ``num_candidates // 2`` drawn from the user's true next-item distribution, the rest
uniformly over the items (so both clicked and skipped candidates are common). A candidate i
of topic z is clicked with probability

    p(click | u, i) = stay * [z = z_last] + (1 - stay) * theta_u[z]

(the chance that the user's next event is in i's topic; ``z_last`` the topic of the latest
event), drawn once per candidate. ``oracle`` holds that probability: ranking by it gives the
best expected AUC, :func:`oracle_auc` its value on the drawn labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recsys.data.synthetic_sequences import SyntheticSequences, generate_log

__all__ = ["RankingSamples", "oracle_auc", "synthetic_ranking"]


@dataclass
class RankingSamples:
    """Users' histories (item ids ``0 .. num_items - 1``, oldest first) and candidates.

    ``items`` [E] and ``times`` [E] (seconds) the histories back to back with ``offsets``
    [U + 1]; ``candidates``, ``labels`` (0. / 1.) and ``oracle`` (the click probability) [U, C].
    """

    items: np.ndarray
    times: np.ndarray
    offsets: np.ndarray
    candidates: np.ndarray
    labels: np.ndarray
    oracle: np.ndarray

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1


def synthetic_ranking(params: SyntheticSequences, num_candidates: int) -> RankingSamples:
    """The log of ``params`` with ``num_candidates`` labelled candidates per user (module
    docstring); deterministic in ``params.seed``."""
    if num_candidates < 1:
        raise ValueError(f"num_candidates={num_candidates}: expected >= 1")
    table, truth = generate_log(params)
    users = np.array([int(u[1:]) for u in table.column("user").to_pylist()])
    items = np.array([int(i[1:]) for i in table.column("item").to_pylist()])
    times = table.column("time").to_numpy()
    order = np.lexsort((times, users))  # by user, then time (stable: generation order)
    users, items, times = users[order], items[order], times[order]
    counts = np.bincount(users, minlength=params.num_users)
    offsets = np.concatenate([[0], np.cumsum(counts)])

    rng = np.random.default_rng(params.seed + 1)
    topic_of = np.arange(params.num_items) % params.num_topics
    last_topic = topic_of[items[offsets[1:] - 1]]
    mix = (1 - params.stay) * truth.theta  # [U, K] p(next event's topic)
    mix[np.arange(params.num_users), last_topic] += params.stay
    next_item = mix @ truth.popularity  # [U, I]
    from_user = num_candidates // 2
    cumulative = next_item.cumsum(axis=1)
    draws = rng.random((params.num_users, from_user)) * cumulative[:, -1:]
    liked = np.stack([(cumulative < draws[:, [c]]).sum(axis=1) for c in range(from_user)], 1)
    uniform = rng.integers(0, params.num_items, size=(params.num_users, num_candidates - from_user))
    candidates = np.minimum(np.concatenate([liked, uniform], axis=1), params.num_items - 1)
    oracle = np.take_along_axis(mix, topic_of[candidates], axis=1)  # [U, C]
    labels = (rng.random(oracle.shape) < oracle).astype(np.float32)
    return RankingSamples(items, times.astype(np.float64), offsets, candidates, labels, oracle)


def oracle_auc(samples: RankingSamples, users: np.ndarray | None = None) -> float:
    """AUC of ranking the candidates of ``users`` (default all) by the true click
    probability against their drawn labels."""
    from torchmetrics.functional.classification import binary_auroc

    picked = slice(None) if users is None else users
    scores = torch.from_numpy(samples.oracle[picked].ravel())
    labels = torch.from_numpy(samples.labels[picked].ravel()).long()
    return float(binary_auroc(scores, labels))
