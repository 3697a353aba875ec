"""Batches of user histories from a directory written by ``recsys preprocess --format
interactions`` (:mod:`recsys.data.sequences`), for sequence models.

A :class:`SequenceBatch` holds B users' histories as a ``KeyedJaggedTensor`` with one key
(``items``; the ids of a user's events, oldest first), the events' times, and targets:

- **train** (``next_item``): a row is a stretch e_s .. e_t of a user's history; the model reads
  e_s .. e_(t-1) and predicts the next item at every position, so ``items`` holds the row
  without its last event and ``targets`` [sum L] the row shifted by one (e_(s+1) .. e_t),
  aligned with ``items.values()``; rows that count only their last positions (``prefixes``, or
  windows with a stride) carry ``target_positions`` [T], and ``targets`` [T] is then one item
  per counted position;
- **valid / test**: ``items`` is the history (its last ``max_len`` events), ``targets`` [B] the
  one item to rank, and ``seen_items`` / ``seen_offsets`` every item of the user's history
  before the target (what ``exclude_history`` leaves out of the ranking).

How a train history becomes rows (``train_rows``), for a user with train events e_1 .. e_n and
L = ``max_len``: ``windows`` cuts it from its end into rows of up to L + 1 events ending every
S = ``window_stride`` events (ends n, n - S, n - 2S, ...; S = L by default, rows that share one
event), each counting its last S targets (the first row of a user all of its own), so e_2 ..
e_n are each a target once per epoch, with at least L - S events of context when the history
has them, at about L / S times the cost of S = L; ``prefixes`` are windows with S = 1, a row per
target e_t (t >= 2) of the L events before it (RecBole's augmentation: every target with its
longest context, about L times the attention cost of S = L); ``last`` keeps one row per user,
its last L + 1 events.

Everything the host knows travels with the batch (lengths per key, offsets, the longest
history), so a model pads or splits without reading the device. :class:`SequenceLoader` reads a
split into memory (its histories as flat arrays: ~8 bytes per event), deals rows to ranks and
cuts batches; train epochs are shuffled by (seed, epoch), the same on any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from recsys.data.prepared import SPLITS, read_metadata
from recsys.data.sequences import SEQUENCE_KIND, segment_index

__all__ = [
    "TRAIN_ROWS",
    "Histories",
    "SequenceBatch",
    "SequenceLoader",
    "cut_train_rows",
    "read_histories",
]

ITEMS = "items"


@dataclass
class SequenceBatch:
    """B users' histories and their targets (see the module docstring).

    Attributes:
        items: KJT with key ``items``: [sum L] ids, lengths [B].
        times: [sum L] float64 event times, aligned with ``items.values()``.
        targets: train: [sum L] next items (with ``target_positions``: [B], one per row);
            valid / test: [B] target items.
        max_length: the longest history in the batch (host-known).
        next_item: whether this is a train batch (next-item targets) or one to rank.
        target_positions: train rows that count only their last positions (the earlier ones
            are another row's targets): [T] int64, the position (index into
            ``items.values()``) of each target, and ``targets`` [T]; None: every position.
        seen_items / seen_offsets: valid / test: [S] every item of each user's history before
            its target (not only the ``max_len`` the model reads), [B + 1] int64 offsets.
    """

    items: KeyedJaggedTensor
    times: torch.Tensor
    targets: torch.Tensor
    max_length: int
    next_item: bool
    target_positions: torch.Tensor | None = None
    seen_items: torch.Tensor | None = None
    seen_offsets: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.items.stride()

    def pin_memory(self) -> SequenceBatch:
        """The batch in pinned host memory (so a copy to the GPU can be ``non_blocking``)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device, non_blocking: bool = False) -> SequenceBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def _map(self, move) -> SequenceBatch:
        def optional(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else move(tensor)

        return SequenceBatch(
            move(self.items),
            move(self.times),
            move(self.targets),
            self.max_length,
            self.next_item,
            optional(self.target_positions),
            optional(self.seen_items),
            optional(self.seen_offsets),
        )


@dataclass
class Histories:
    """A split's histories as flat arrays: user b's events are
    ``values[offsets[b] : offsets[b + 1]]``."""

    values: np.ndarray  # int64 [E]
    times: np.ndarray  # float64 [E]
    offsets: np.ndarray  # int64 [U + 1]
    targets: np.ndarray | None  # int64 [U] (valid / test)
    num_items: int

    @property
    def users(self) -> int:
        return len(self.offsets) - 1


def read_histories(path: str | Path, split: str) -> Histories:
    """A split of a sequence dataset, whole, as flat arrays (files in metadata order).

    Raises:
        ValueError: ``path`` is not a sequence dataset, or ``split`` is not one of its splits.
    """
    metadata = read_metadata(path)
    if metadata.get("kind") != SEQUENCE_KIND:
        raise ValueError(
            f"'{path}' holds {metadata.get('kind', 'CTR')} data, not user histories; create "
            "them with `recsys preprocess --format interactions`"
        )
    if split not in SPLITS:
        raise ValueError(f"split {split!r}; expected one of {', '.join(SPLITS)}")
    files = [Path(path) / split / name for name in metadata["splits"][split]["files"]]
    columns = ["items", "times"] + ([] if split == "train" else ["target"])
    if files:
        table = pa.concat_tables([pq.read_table(f, columns=columns) for f in files])
    else:
        table = pa.table({c: pa.array([], pa.list_(pa.int64())) for c in columns[:2]})
    items = table.column("items").combine_chunks()
    times = table.column("times").combine_chunks()
    offsets = items.offsets.to_numpy().astype(np.int64)
    values = items.values.to_numpy().astype(np.int64)
    targets = None
    if split != "train":
        targets = table.column("target").to_numpy().astype(np.int64) if files else np.zeros(0)
    return Histories(
        values,
        times.values.to_numpy().astype(np.float64),
        offsets - offsets[0],
        targets,
        metadata["sequence"]["num_items"],
    )


TRAIN_ROWS = ("windows", "prefixes", "last")


def cut_train_rows(
    offsets: np.ndarray, max_len: int | None, mode: str, stride: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows ``mode`` cuts from histories at ``offsets`` [U + 1] (see the module docstring):
    each row's first and end event index [R] (users in order, each user's rows oldest first)
    and how many of its last targets it counts [R] (the others are counted by the row after
    it). ``windows`` rows end every ``stride`` events from each history's end (0: max_len);
    ``prefixes`` are windows with stride 1. Histories of fewer than 2 events give no row;
    ``max_len`` None keeps each history whole, one row.

    Raises:
        ValueError: an unknown mode, or a stride outside [0, max_len].
    """
    if mode not in TRAIN_ROWS:
        raise ValueError(f"train_rows = {mode!r}; expected one of {', '.join(TRAIN_ROWS)}")
    starts, ends = offsets[:-1], offsets[1:]
    users = np.flatnonzero(ends - starts >= 2)
    starts, ends = starts[users], ends[users]
    if max_len is None or mode == "last":
        keep = ends - starts if max_len is None else np.minimum(ends - starts, max_len + 1)
        return ends - keep, ends, keep - 1
    if not 0 <= stride <= max_len:
        raise ValueError(f"window stride {stride}; expected 0 (max_len) to max_len = {max_len}")
    step = 1 if mode == "prefixes" else stride or max_len
    targets = ends - starts - 1  # e_2 .. e_n
    per_user = -(-targets // step)  # rows: ceil(targets / step)
    row_of = np.arange(per_user.sum()) - np.repeat(np.cumsum(per_user) - per_user, per_user)
    row_ends = np.repeat(ends, per_user) - step * row_of  # each user's last row first
    user_starts = np.repeat(starts, per_user)
    row_starts = np.maximum(user_starts, row_ends - max_len - 1)
    counted = np.minimum(step, row_ends - user_starts - 1)
    order = np.lexsort((row_ends, np.repeat(np.arange(len(users)), per_user)))
    return row_starts[order], row_ends[order], counted[order]


class SequenceLoader:
    """Batches of one split of a sequence dataset.

    Args:
        path: the dataset directory, or a split already read (:func:`read_histories`).
        split: ``train`` (next-item targets, rows shuffled), ``valid`` or ``test``.
        batch_size: rows (valid / test: users) per batch on each rank.
        rank / world_size: this rank's share: train deals each epoch's shuffled rows out in
            whole global batches of ``batch_size * world_size`` (the last partial one dropped, so
            every rank steps alike); valid / test give rank r users r, r + W, ... (all of them).
        seed: the shuffle's seed (train).
        max_len: the most recent events of a history a batch keeps (None: all); a train row
            keeps ``max_len`` inputs and their targets.
        train_rows: how train histories become rows (``windows``, ``prefixes``, ``last``; see
            the module docstring).
        window_stride: ``windows``: events between the ends of a user's consecutive rows (0:
            ``max_len``, rows that share one event; smaller: more context per target, each
            still counted once, at about max_len / stride times the cost).
    """

    def __init__(
        self,
        path: str | Path | Histories,
        split: str,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        max_len: int | None = None,
        train_rows: str = "windows",
        window_stride: int = 0,
    ) -> None:
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"batch_size={batch_size} must be >= 1 and rank={rank} in [0, world_size="
                f"{world_size})"
            )
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len={max_len}; expected >= 1 (or None: whole histories)")
        self.histories = path if isinstance(path, Histories) else read_histories(path, split)
        self.max_len = max_len
        self.split, self.batch_size = split, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.num_items = self.histories.num_items
        if split == "train":
            self.row_starts, self.row_ends, self.row_targets = cut_train_rows(
                self.histories.offsets, max_len, train_rows, window_stride
            )

    @property
    def rows(self) -> int:
        """Train: the rows an epoch shuffles; valid / test: the users."""
        return len(self.row_starts) if self.split == "train" else self.histories.users

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        if self.split == "train":
            return self.rows // (self.batch_size * self.world_size)
        mine = len(range(self.rank, self.rows, self.world_size))
        return math.ceil(mine / self.batch_size)

    def epoch(self, epoch: int = 0, start_batch: int = 0) -> Iterator[SequenceBatch]:
        """This rank's batches of epoch ``epoch``, from its batch ``start_batch`` on (train:
        the batches before it were trained by a run this one resumes)."""
        if self.split == "train":
            order = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
            step = self.batch_size * self.world_size
            for start in range(start_batch * step, len(self) * step, step):
                mine = start + self.rank * self.batch_size
                yield self.batch(order[mine : mine + self.batch_size])
            return
        order = np.arange(self.rank, self.rows, self.world_size)
        for start in range(start_batch * self.batch_size, len(order), self.batch_size):
            yield self.batch(order[start : start + self.batch_size])

    def batch(self, rows: np.ndarray) -> SequenceBatch:
        """The batch of these rows (train; valid / test: users), in this order."""
        h = self.histories
        if self.split == "train":  # read e_s .. e_(t-1), predict e_(s+1) .. e_t
            starts, ends = self.row_starts[rows], self.row_ends[rows]
            index, offsets = segment_index(starts, ends - 1)
            lengths = ends - 1 - starts
            targets = torch.from_numpy(h.values[index + 1])
            counted = self.row_targets[rows]
            positions = None
            if (counted < lengths).any():  # rows that count their last positions only
                row_ends = offsets[1:].astype(np.int64)
                positions = torch.from_numpy(segment_index(row_ends - counted, row_ends)[0])
                targets = targets[positions]
            return self._batch(index, lengths, targets, target_positions=positions)
        seen_starts, ends = h.offsets[rows], h.offsets[rows + 1]
        starts = seen_starts
        if self.max_len is not None:  # the most recent events
            starts = np.maximum(starts, ends - self.max_len)
        assert h.targets is not None
        seen, seen_offsets = segment_index(seen_starts, ends)
        return self._batch(
            segment_index(starts, ends)[0],
            ends - starts,
            torch.from_numpy(h.targets[rows]),
            seen_items=torch.from_numpy(h.values[seen]),
            seen_offsets=torch.from_numpy(seen_offsets.astype(np.int64)),
        )

    def _batch(
        self, index: np.ndarray, lengths: np.ndarray, targets: torch.Tensor, **extra
    ) -> SequenceBatch:
        h = self.histories
        values = torch.from_numpy(h.values[index])
        total = int(lengths.sum())
        kjt = KeyedJaggedTensor(
            keys=[ITEMS],
            values=values,
            lengths=torch.from_numpy(lengths),
            stride=len(lengths),
            length_per_key=[total],
            offset_per_key=[0, total],
        )
        longest = int(lengths.max()) if len(lengths) else 0
        return SequenceBatch(
            kjt,
            torch.from_numpy(h.times[index]),
            targets,
            longest,
            self.split == "train",
            **extra,
        )
