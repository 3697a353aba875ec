"""Score policies: LRU and LFU updates, and resolving a policy from a name or an instance."""

import pytest
import torch

from recsys.embedding.dynamic.score_policy import LFU, LRU, ScorePolicy, score_policy


def test_lru_scores_the_step_and_lfu_accumulates_counts():
    old = torch.tensor([3, 9, 0])
    is_new = torch.tensor([False, False, True])
    counts = torch.tensor([2, 1, 4])
    assert LRU().update(old, is_new, counts, 17).tolist() == [17, 17, 17]
    assert LFU().update(old, is_new, counts, 17).tolist() == [5, 10, 4]


def test_score_policy_resolves_names_and_instances():
    assert isinstance(score_policy("lru"), LRU) and isinstance(score_policy("lfu"), LFU)
    custom = ScorePolicy()
    assert score_policy(custom) is custom
    with pytest.raises(NotImplementedError):
        custom.update(torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.ones(1), 0)
    for bad in ("LRU ", "fifo", 3):
        with pytest.raises(ValueError, match="score policy .*expected one of lru, lfu"):
            score_policy(bad)
