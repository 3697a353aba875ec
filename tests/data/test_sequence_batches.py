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
    # train_rows = "last": one row per user, its last max_len inputs and their targets
    whole = SequenceLoader(dataset, "train", batch_size=8, seed=3)
    h = read_histories(dataset, "train")
    cut = SequenceLoader(h, "train", batch_size=8, seed=3, max_len=2, train_rows="last")
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
    with pytest.raises(ValueError, match="train_rows = 'all'"):
        SequenceLoader(dataset, "train", batch_size=4, max_len=2, train_rows="all")


def _rows(loader: SequenceLoader, epoch: int = 0) -> list[tuple[list[int], list[int], int]]:
    """(inputs, targets, first counted position) of every row of an epoch, in order."""
    rows = []
    for batch in loader.epoch(epoch):
        values, lengths = batch.items.values().tolist(), batch.items.lengths().tolist()
        targets = batch.targets.tolist()
        if batch.target_positions is not None:
            positions = batch.target_positions.tolist()
            assert len(positions) == len(targets)
        start = 0
        for n in lengths:
            inputs = values[start : start + n]
            if batch.target_positions is None:
                rows.append((inputs, targets[start : start + n], 0))
            else:  # the row's last positions
                mine = [
                    (p, t)
                    for p, t in zip(positions, targets, strict=True)
                    if start <= p < start + n
                ]
                assert [p for p, _ in mine] == list(range(start + n - len(mine), start + n))
                rows.append((inputs, [t for _, t in mine], n - len(mine)))
            start += n
    return rows


@pytest.mark.parametrize(("max_len", "stride"), [(1, 0), (2, 0), (3, 0), (5, 0), (5, 2), (4, 1)])
def test_windows_make_every_event_a_target_once(dataset: Path, max_len: int, stride: int):
    h = read_histories(dataset, "train")
    loader = SequenceLoader(h, "train", batch_size=1, seed=2, max_len=max_len, window_stride=stride)
    starts, ends, counts = loader.row_starts, loader.row_ends, loader.row_targets
    assert (ends - starts >= 2).all() and (ends - starts <= max_len + 1).all()
    # the rows' counted targets (their last ones) are e_2 .. e_n of every user, once
    counted = np.concatenate([np.arange(e - c, e) for c, e in zip(counts, ends, strict=True)])
    expected = np.concatenate(
        [np.arange(s + 1, e) for s, e in zip(h.offsets[:-1], h.offsets[1:], strict=True)]
    )
    assert np.array_equal(np.sort(counted), expected)
    user_of = np.searchsorted(h.offsets, starts, side="right") - 1
    assert (ends <= h.offsets[user_of + 1]).all()  # a row never spans two users
    # a row reads max_len events when the user has them: the counted targets' context
    assert (ends - starts == np.minimum(max_len + 1, ends - h.offsets[user_of])).all()
    order = np.random.default_rng([2, 0]).permutation(loader.rows)
    rows = _rows(loader)
    assert len(rows) == loader.rows
    for r, (inputs, targets, first) in zip(order, rows, strict=True):
        events = h.values[starts[r] : ends[r]].tolist()
        assert (inputs, targets, first) == (
            events[:-1],
            events[-counts[r] :],
            len(events) - 1 - counts[r],
        )


def test_prefixes_give_each_target_its_longest_context(dataset: Path):
    h = read_histories(dataset, "train")
    loader = SequenceLoader(h, "train", batch_size=3, seed=2, max_len=3, train_rows="prefixes")
    histories = [h.values[h.offsets[u] : h.offsets[u + 1]].tolist() for u in range(h.users)]
    expected = sorted(
        (tuple(events[max(0, t - 3) : t]), events[t])
        for events in histories
        for t in range(1, len(events))
    )
    rows = _rows(loader)
    assert loader.rows == len(expected) and len(rows) == len(expected) // 3 * 3
    assert all(position == len(inputs) - 1 for inputs, _, position in rows)
    assert set((tuple(i), t[0]) for i, t, _ in rows) <= set(expected)
    whole = SequenceLoader(h, "train", batch_size=1, max_len=3, train_rows="prefixes")
    assert sorted((tuple(i), t[0]) for i, t, _ in _rows(whole)) == expected


def test_eval_batches_carry_the_whole_history_for_exclusion(dataset: Path):
    h = read_histories(dataset, "test")
    loader = SequenceLoader(h, "test", batch_size=5, max_len=2)
    user = 0
    for batch in loader.epoch():
        seen, offsets = batch.seen_items.tolist(), batch.seen_offsets.tolist()
        values, lengths = batch.items.values().tolist(), batch.items.lengths().tolist()
        start = 0
        for b, n in enumerate(lengths):
            history = h.values[h.offsets[user] : h.offsets[user + 1]].tolist()
            assert seen[offsets[b] : offsets[b + 1]] == history
            assert values[start : start + n] == history[-2:]
            start, user = start + n, user + 1
    assert user == h.users


def test_an_epoch_continues_from_a_start_batch(dataset: Path):
    loader = SequenceLoader(dataset, "train", batch_size=4, seed=5)
    batches = list(loader.epoch(2))
    later = list(loader.epoch(2, start_batch=3))
    assert len(later) == len(batches) - 3
    for a, b in zip(batches[3:], later, strict=True):
        assert torch.equal(a.items.values(), b.items.values())
        assert torch.equal(a.targets, b.targets)
