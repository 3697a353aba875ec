"""Score policies of a dynamic table's slot map: how an entry's score changes when a training
batch looks its key up. At the maximum capacity a bucket evicts its lowest score first (ties: the
lowest key), so the score says how much a row is worth keeping.

- ``"lru"`` (:class:`LRU`): the last step the key was seen;
- ``"lfu"`` (:class:`LFU`): how often it was seen since it got its row;
- a custom :class:`ScorePolicy` subclass for anything else.
"""

from __future__ import annotations

import torch

__all__ = ["LFU", "LRU", "POLICIES", "ScorePolicy", "score_policy"]


class ScorePolicy:
    """How an entry's score is updated when a training batch looks its key up. Subclass it
    for a custom score: at the maximum capacity the lowest score of a bucket is evicted first
    (ties: lowest key).

    Attributes:
        name: the policy's name (in logs and configs).
    """

    name: str = "custom"

    def update(
        self, old: torch.Tensor, is_new: torch.Tensor, counts: torch.Tensor, step: int
    ) -> torch.Tensor:
        """New scores of the entries a batch looked up.

        Args:
            old: [U] int64 current scores (0 where ``is_new``).
            is_new: [U] bool, True for keys inserted by this batch.
            counts: [U] int64 occurrences of each key in the batch.
            step: the training step of the batch.

        Returns:
            [U] int64 scores.
        """
        raise NotImplementedError


class LRU(ScorePolicy):
    """Least recently used: the score is the last step the key was seen."""

    name = "lru"

    def update(self, old, is_new, counts, step):
        return torch.full_like(old, step)


class LFU(ScorePolicy):
    """Least frequently used: the score counts every occurrence since the key got its row."""

    name = "lfu"

    def update(self, old, is_new, counts, step):
        return torch.where(is_new, counts, old + counts)


POLICIES = {"lru": LRU, "lfu": LFU}


def score_policy(name_or_policy: str | ScorePolicy) -> ScorePolicy:
    """The policy named ``"lru"`` or ``"lfu"``, or ``name_or_policy`` itself when it is a
    :class:`ScorePolicy` instance.

    Raises:
        ValueError: any other name or object.
    """
    if isinstance(name_or_policy, ScorePolicy):
        return name_or_policy
    if isinstance(name_or_policy, str) and name_or_policy in POLICIES:
        return POLICIES[name_or_policy]()
    raise ValueError(
        f"score policy {name_or_policy!r}; expected one of {', '.join(POLICIES)} "
        "or a ScorePolicy instance"
    )
