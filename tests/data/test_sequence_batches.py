"""Batches of user histories: next-item targets, ranks, shuffling, host-known shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys.config import PreprocessConfig
from recsys.data.sequence_batches import SequenceLoader, read_histories
from recsys.data.sequences import preprocess_interactions


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seq")
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(50), rng.integers(1, 12, size=50))
    table = pa.table(
        {
            "user": users,
            "item": rng.integers(0, 30, size=len(users)),
            "time": np.arange(len(users)),
        }
    )
    pq.write_table(table, root / "log.parquet")
    config = PreprocessConfig(
        format="interactions",
        input=str(root / "log.parquet"),
        output=str(root / "data"),
        user="user",
        item="item",
        time="time",
        max_len=6,
    )
    preprocess_interactions(config)
    return root / "data"


def test_train_batches_read_all_but_the_last_event_and_predict_the_next(dataset: Path):
    h = read_histories(dataset, "train")
    loader = SequenceLoader(dataset, "train", batch_size=4, seed=1)
    seen = 0
    for batch in loader.epoch(0):
        kjt = batch.items
        lengths = kjt.lengths().tolist()
        assert kjt.keys() == ["items"] and batch.next_item and batch.size == 4
        assert kjt.length_per_key() == [sum(lengths)] and batch.max_length == max(lengths)
        values, targets = kjt.values().tolist(), batch.targets.tolist()
        # Each user's row: inputs = events[:-1], targets = events[1:].
        rows = {tuple(h.values[h.offsets[u] : h.offsets[u + 1]]) for u in range(h.users)}
        start = 0
        for n in lengths:
            row = values[start : start + n] + targets[start + n - 1 : start + n]
            assert values[start + 1 : start + n] == targets[start : start + n - 1]
            assert tuple(row) in rows
            start += n
        seen += 4
    assert seen == len(loader) * 4 == (h.users // 4) * 4


def test_ranks_share_an_epoch_and_shuffles_follow_the_seed(dataset: Path):
    def users_of(loader, epoch):
        return [tuple(b.items.values().tolist()) for b in loader.epoch(epoch)]

    one = SequenceLoader(dataset, "train", batch_size=2, seed=3)
    ranks = [
        SequenceLoader(dataset, "train", batch_size=1, rank=r, world_size=2, seed=3) for r in (0, 1)
    ]
    # The global batch of 2 users: rank 0 takes the first, rank 1 the second.
    both = [
        x for pair in zip(users_of(ranks[0], 0), users_of(ranks[1], 0), strict=True) for x in pair
    ]
    single = [b for b in one.epoch(0)]
    assert [tuple(b.items.values().tolist()) for b in single] == [
        both[i] + both[i + 1] for i in range(0, len(both), 2)
    ]
    assert users_of(one, 0) != users_of(one, 1)  # epochs reshuffle
    assert users_of(one, 1) == users_of(SequenceLoader(dataset, "train", batch_size=2, seed=3), 1)


def test_eval_batches_hold_every_user_once_with_their_target(dataset: Path):
    h = read_histories(dataset, "test")
    parts = [SequenceLoader(dataset, "test", batch_size=3, rank=r, world_size=2) for r in (0, 1)]
    targets = sorted(t for p in parts for b in p.epoch() for t in b.targets.tolist())
    assert targets == sorted(h.targets.tolist())
    batch = next(parts[0].epoch())
    assert not batch.next_item and batch.targets.shape == (batch.size,)
    for r, part in enumerate(parts):
        assert len(part) == len(list(part.epoch())) == -(-len(range(r, h.users, 2)) // 3)


def test_not_a_sequence_dataset(tmp_path: Path, dataset: Path):
    with pytest.raises(ValueError, match="split 'dev'"):
        read_histories(dataset, "dev")
    (tmp_path / "metadata.json").write_text('{"format_version": 1, "splits": {}}')
    with pytest.raises(ValueError, match="not user histories"):
        read_histories(tmp_path, "train")
    with pytest.raises(ValueError, match="rank=2"):
        SequenceLoader(dataset, "train", 4, rank=2, world_size=2)
    assert torch.is_tensor(next(SequenceLoader(dataset, "valid", 2).epoch()).times)


def test_max_len_keeps_the_most_recent_events(dataset: Path):
    whole = SequenceLoader(dataset, "train", batch_size=8, seed=3)
    cut = SequenceLoader(read_histories(dataset, "train"), "train", batch_size=8, seed=3, max_len=2)
    for full, short in zip(whole.epoch(0), cut.epoch(0), strict=True):
        assert short.max_length <= 2
        for n, m in zip(full.items.lengths().tolist(), short.items.lengths().tolist(), strict=True):
            assert m == min(n, 2)
        ends = torch.cumsum(short.items.lengths(), 0) - 1
        full_ends = torch.cumsum(full.items.lengths(), 0) - 1
        assert torch.equal(short.targets[ends], full.targets[full_ends])  # same last target
        assert torch.equal(short.items.values()[ends], full.items.values()[full_ends])
    test = SequenceLoader(dataset, "test", batch_size=64, max_len=3)
    (batch,) = list(test.epoch())
    assert batch.max_length <= 3
    with pytest.raises(ValueError, match="max_len=0"):
        SequenceLoader(dataset, "test", batch_size=4, max_len=0)


def test_an_epoch_continues_from_a_start_batch(dataset: Path):
    loader = SequenceLoader(dataset, "train", batch_size=4, seed=5)
    batches = list(loader.epoch(2))
    later = list(loader.epoch(2, start_batch=3))
    assert len(later) == len(batches) - 3
    for a, b in zip(batches[3:], later, strict=True):
        assert torch.equal(a.items.values(), b.items.values())
        assert torch.equal(a.targets, b.targets)
