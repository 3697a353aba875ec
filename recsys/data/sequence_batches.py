"""Batches of user histories from a directory written by ``recsys preprocess --format
interactions`` (:mod:`recsys.data.sequences`), for sequence models.

A :class:`SequenceBatch` holds B users' histories as a ``KeyedJaggedTensor`` with one key
(``items``; the ids of a user's events, oldest first), the events' times, and targets:

- **train** (``next_item``): the model reads e_1 .. e_(n-1) and predicts the next item at every
  position, so ``items`` holds each history without its last event and ``targets`` [sum L] the
  history shifted by one (e_2 .. e_n), aligned with ``items.values()``;
- **valid / test**: ``items`` is the whole history and ``targets`` [B] the one item to rank.

Everything the host knows travels with the batch (lengths per key, offsets, the longest
history), so a model pads or splits without reading the device. :class:`SequenceLoader` reads a
split into memory (its histories as flat arrays: ~8 bytes per event), deals users to ranks and
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

__all__ = ["Histories", "SequenceBatch", "SequenceLoader", "read_histories"]

ITEMS = "items"


@dataclass
class SequenceBatch:
    """B users' histories and their targets (see the module docstring).

    Attributes:
        items: KJT with key ``items``: [sum L] ids, lengths [B].
        times: [sum L] float64 event times, aligned with ``items.values()``.
        targets: train: [sum L] next items; valid / test: [B] target items.
        max_length: the longest history in the batch (host-known).
        next_item: whether ``targets`` is per position (train) or per user.
    """

    items: KeyedJaggedTensor
    times: torch.Tensor
    targets: torch.Tensor
    max_length: int
    next_item: bool

    @property
    def size(self) -> int:
        return self.items.stride()

    def pin_memory(self) -> SequenceBatch:
        """The batch in pinned host memory (so a copy to the GPU can be ``non_blocking``)."""
        return SequenceBatch(
            self.items.pin_memory(),
            self.times.pin_memory(),
            self.targets.pin_memory(),
            self.max_length,
            self.next_item,
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> SequenceBatch:
        return SequenceBatch(
            self.items.to(device, non_blocking=non_blocking),
            self.times.to(device, non_blocking=non_blocking),
            self.targets.to(device, non_blocking=non_blocking),
            self.max_length,
            self.next_item,
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


class SequenceLoader:
    """Batches of one split of a sequence dataset.

    Args:
        path: the dataset directory, or a split already read (:func:`read_histories`).
        split: ``train`` (next-item targets at every position, shuffled), ``valid`` or ``test``.
        batch_size: users per batch on each rank.
        rank / world_size: this rank's share: train deals each epoch's shuffled users out in
            whole global batches of ``batch_size * world_size`` (the last partial one dropped, so
            every rank steps alike); valid / test give rank r users r, r + W, ... (all of them).
        seed: the shuffle's seed (train).
        max_len: the most recent events of a history a batch keeps (None: all); a train row
            keeps ``max_len`` inputs and their targets.
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

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        users = self.histories.users
        if self.split == "train":
            return users // (self.batch_size * self.world_size)
        mine = len(range(self.rank, users, self.world_size))
        return math.ceil(mine / self.batch_size)

    def epoch(self, epoch: int = 0, start_batch: int = 0) -> Iterator[SequenceBatch]:
        """This rank's batches of epoch ``epoch``, from its batch ``start_batch`` on (train:
        the batches before it were trained by a run this one resumes)."""
        users = self.histories.users
        if self.split == "train":
            order = np.random.default_rng([self.seed, epoch]).permutation(users)
            step = self.batch_size * self.world_size
            for start in range(start_batch * step, len(self) * step, step):
                mine = start + self.rank * self.batch_size
                yield self.batch(order[mine : mine + self.batch_size])
            return
        order = np.arange(self.rank, users, self.world_size)
        for start in range(start_batch * self.batch_size, len(order), self.batch_size):
            yield self.batch(order[start : start + self.batch_size])

    def batch(self, users: np.ndarray) -> SequenceBatch:
        """The batch of these users (indices into the split), in this order."""
        h = self.histories
        starts, ends = h.offsets[users], h.offsets[users + 1]
        if self.max_len is not None:  # the most recent events (train: plus the last target)
            keep = self.max_len + (self.split == "train")
            starts = np.maximum(starts, ends - keep)
        if self.split == "train":  # read e_1 .. e_(n-1), predict e_2 .. e_n
            index, lengths = segment_index(starts, ends - 1)[0], ends - 1 - starts
            targets = torch.from_numpy(h.values[index + 1])
        else:
            index, lengths = segment_index(starts, ends)[0], ends - starts
            assert h.targets is not None
            targets = torch.from_numpy(h.targets[users])
        values = torch.from_numpy(h.values[index])
        total = int(lengths.sum())
        kjt = KeyedJaggedTensor(
            keys=[ITEMS],
            values=values,
            lengths=torch.from_numpy(lengths),
            stride=len(users),
            length_per_key=[total],
            offset_per_key=[0, total],
        )
        longest = int(lengths.max()) if len(lengths) else 0
        return SequenceBatch(
            kjt, torch.from_numpy(h.times[index]), targets, longest, self.split == "train"
        )
