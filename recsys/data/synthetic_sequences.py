"""A synthetic interaction log whose next-item distribution is known, so a sequence model's
ranking metrics can be read against the best achievable.

Generative process (all draws from one seeded numpy generator):

- ``num_items`` items, item i in topic ``i mod num_topics``; within its topic an item's
  popularity is Zipf(``zipf``) over the topic's items in a seeded random order.
- User u has interests ``theta_u ~ Dirichlet(alpha)`` over the topics and ``n_u`` events,
  ``n_u = min_events + Geometric(1 / (mean_events - min_events + 1)) - 1`` capped at
  ``max_events``. The first event's topic is drawn from ``theta_u``; each next topic stays the
  same with probability ``stay``, else is drawn anew from ``theta_u`` (which may give the same
  topic again). Each event's item is drawn from its topic's popularity.
- Times: user u starts at a uniform second of one year and waits Exponential(1 hour) between
  events.

So, given u's events so far, the next item's distribution is
``P(i) = sum_z (stay * [z = z_last] + (1 - stay) * theta_u[z]) * pop_z(i)`` with ``z_last``
the topic of the last item. :func:`oracle_metrics` ranks every item by it for each user's last
event (the leave-one-out test target) and reports the expected HR@k and NDCG@k of that ranking
(the mass of its top k, and the same discounted by rank): what a model that knew ``theta_u``
would score, an upper bound for one that must infer it from the history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["SyntheticSequences", "Truth", "generate_log", "oracle_metrics"]


@dataclass(frozen=True)
class SyntheticSequences:
    """The generator's parameters (see the module docstring)."""

    num_users: int = 2000
    num_items: int = 1000
    num_topics: int = 20
    alpha: float = 0.1
    stay: float = 0.8
    zipf: float = 1.0
    min_events: int = 5
    mean_events: float = 30.0
    max_events: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "num_users >= 1": self.num_users >= 1,
            "num_topics >= 1": self.num_topics >= 1,
            "num_items >= num_topics": self.num_items >= self.num_topics,
            "alpha > 0": self.alpha > 0,
            "0 <= stay <= 1": 0 <= self.stay <= 1,
            "zipf >= 0": self.zipf >= 0,
            "1 <= min_events <= mean_events <= max_events": (
                1 <= self.min_events <= self.mean_events <= self.max_events
            ),
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"{self}: expected {'; '.join(failed)}")


@dataclass
class _World:
    topic: np.ndarray  # [I] topic of each item
    popularity: np.ndarray  # [K, I] p(item | topic), rows sum to 1
    theta: np.ndarray  # [U, K]


@dataclass
class Truth:
    """What the log hides: the item popularities, the users' interests, each user's number
    of events and the topic of each user's second-to-last event."""

    popularity: np.ndarray  # [K, I]
    theta: np.ndarray  # [U, K]
    lengths: np.ndarray  # [U]
    before_last: np.ndarray  # [U]


def _world(params: SyntheticSequences, rng: np.random.Generator) -> _World:
    items, topics = params.num_items, params.num_topics
    topic = np.arange(items) % topics
    popularity = np.zeros((topics, items))
    for z in range(topics):
        members = rng.permutation(np.flatnonzero(topic == z))
        weights = 1.0 / np.arange(1, len(members) + 1) ** params.zipf
        popularity[z, members] = weights / weights.sum()
    theta = rng.dirichlet(np.full(topics, params.alpha), size=params.num_users)
    return _World(topic, popularity, theta)


def _draw_rows(probabilities: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of ``probabilities`` [N, M] (rows sum to 1)."""
    cumulative = probabilities.cumsum(axis=1)
    u = rng.random(len(probabilities))[:, None] * cumulative[:, -1:]
    return np.minimum((cumulative < u).sum(axis=1), probabilities.shape[1] - 1)


def generate_log(params: SyntheticSequences) -> tuple[pa.Table, Truth]:
    """The interaction log (``user``, ``item``, ``time`` columns; users ``u<n>``, items
    ``i<n>``, times in whole seconds, each user's events in time order) and what generated
    it."""
    rng = np.random.default_rng(params.seed)
    world = _world(params, rng)
    users = params.num_users
    extra = rng.geometric(1.0 / (params.mean_events - params.min_events + 1), size=users) - 1
    lengths = np.minimum(params.min_events + extra, params.max_events)
    topic = _draw_rows(world.theta, rng)
    columns: dict[str, list[np.ndarray]] = {"user": [], "item": [], "time": []}
    clock = rng.uniform(0, 365 * 86400, size=users)
    before_last = np.zeros(users, dtype=np.int64)
    for step in range(int(lengths.max())):
        active = np.flatnonzero(lengths > step)
        if step:
            fresh = _draw_rows(world.theta[active], rng)
            keep = rng.random(len(active)) < params.stay
            topic[active] = np.where(keep, topic[active], fresh)
            clock[active] += rng.exponential(3600.0, size=len(active))
        item = _draw_rows(world.popularity[topic[active]], rng)
        ending = lengths[active] == step + 2
        before_last[active[ending]] = world.topic[item[ending]]
        columns["user"].append(active)
        columns["item"].append(item)
        columns["time"].append(np.floor(clock[active]))
    table = pa.table(
        {
            "user": pa.array([f"u{u}" for u in np.concatenate(columns["user"])]),
            "item": pa.array([f"i{i}" for i in np.concatenate(columns["item"])]),
            "time": np.concatenate(columns["time"]).astype(np.int64),
        }
    )
    return table, Truth(world.popularity, world.theta, lengths, before_last)


def oracle_metrics(
    params: SyntheticSequences, truth: Truth, ks: tuple[int, ...] = (10, 50)
) -> dict[str, float]:
    """Expected HR@k and NDCG@k, over the users with a test row (3 events or more), of ranking
    every item by the true distribution of each user's last event given the events before it
    (see the module docstring)."""
    scored = np.flatnonzero(truth.lengths >= 3)
    theta, last_topic = truth.theta[scored], truth.before_last[scored]
    hits: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    gains = {k: [] for k in ks}
    discount = 1.0 / np.log2(np.arange(2, max(ks) + 2))
    for start in range(0, len(theta), 512):
        z = last_topic[start : start + 512]
        mix = (1 - params.stay) * theta[start : start + 512]
        mix[np.arange(len(z)), z] += params.stay
        p = mix @ truth.popularity  # [U, I]
        top = -np.sort(-p, axis=1)[:, : max(ks)]
        for k in ks:
            hits[k].append(top[:, :k].sum(axis=1))
            gains[k].append((top[:, :k] * discount[:k]).sum(axis=1))
    out = {}
    for k in ks:
        out[f"hr@{k}"] = float(np.concatenate(hits[k]).mean())
        out[f"ndcg@{k}"] = float(np.concatenate(gains[k]).mean())
    return out
