"""The unit of data every recsys component exchanges.

A :class:`Batch` holds B samples: dense features f32[B, N_dense], categorical features as a
``torchrec.KeyedJaggedTensor`` (F keys, key-major: all of key 0's bags, then key 1's, ...) and
labels f32[B, T]. Datasets produce large batches ("chunks": a synthetic block, a parquet row
group) and the loader cuts and joins them into training batches with :meth:`Batch.slice` and
:meth:`Batch.concat`, so a sample is the same whatever the batch size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

ID_ENCODINGS = ("index", "raw")


@dataclass(frozen=True)
class DatasetSpec:
    """Column roles and sizes of a dataset: what a model needs to build its tables.

    Args:
        dense_names: names of the dense features, N_dense of them.
        sparse_names: names of the categorical features (the KJT keys), F of them.
        cardinalities: number of distinct ids of each categorical feature.
        label_names: names of the T labels (tasks).
        fingerprint: the vocabulary the ids come from: ``recsys preprocess``'s fingerprint of
            its fitted workflow, or of its options and key scheme for raw keys ("" for data
            with no fitted vocabulary: synthetic, hashed raw Criteo, or preprocessed before
            fingerprints existed).
        id_encoding: ``"index"``: ids are row numbers in [0, cardinality); ``"raw"``: ids are
            any int64 keys (``recsys preprocess --preprocess.encoding=raw``, or synthetic data
            with ``id_encoding = "raw"``) with no vocabulary, and every cardinality is 0: such
            features need dynamic tables (keyed by id, growing), not fixed ones.

    Raises:
        ValueError: names and cardinalities of different lengths, an unknown id_encoding, or
            a non-zero cardinality with raw ids.
    """

    dense_names: tuple[str, ...]
    sparse_names: tuple[str, ...]
    cardinalities: tuple[int, ...]
    label_names: tuple[str, ...]
    fingerprint: str = ""
    id_encoding: str = "index"

    def __post_init__(self) -> None:
        if len(self.sparse_names) != len(self.cardinalities):
            raise ValueError(
                f"{len(self.sparse_names)} sparse feature names but "
                f"{len(self.cardinalities)} cardinalities"
            )
        if self.id_encoding not in ID_ENCODINGS:
            raise ValueError(
                f"id_encoding = {self.id_encoding!r}; expected one of {', '.join(ID_ENCODINGS)}"
            )
        if self.id_encoding == "raw" and any(self.cardinalities):
            raise ValueError(
                f"cardinalities {self.cardinalities} with id_encoding = 'raw'; raw ids have no "
                "vocabulary: every cardinality must be 0"
            )

    @classmethod
    def from_json(cls, fields: dict) -> DatasetSpec:
        """The spec ``json.dumps(dataclasses.asdict(spec))`` wrote (a checkpoint's or an
        export's ``spec.json``; older ones have no fingerprint or id_encoding, and read as
        ``""`` and ``"index"``)."""
        return cls(
            **{
                key: value if isinstance(value, str) else tuple(value)
                for key, value in fields.items()
            }
        )

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    @property
    def num_tasks(self) -> int:
        return len(self.label_names)


@dataclass
class Batch:
    """B samples: ``dense`` f32[B, N_dense], ``sparse`` KJT with F keys, ``labels`` f32[B, T]."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def __len__(self) -> int:
        return self.batch_size

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Copy to ``device``; with ``non_blocking`` from pinned memory the copy is async."""
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        """Page-locked copy, so a later ``.to(cuda, non_blocking=True)`` overlaps compute."""
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` as a new batch (values are copied only for the sparse part);
        its KJT carries its lengths and offsets per key."""
        kjt = self.sparse
        num_keys = len(kjt.keys())
        lengths = kjt.lengths().view(num_keys, -1)  # [F, B]
        offsets = kjt.offsets().view(-1)  # [F*B + 1]
        stride = lengths.shape[1]
        starts = offsets[torch.arange(num_keys) * stride + start].tolist()
        stops = offsets[torch.arange(num_keys) * stride + stop].tolist()
        values = torch.cat([kjt.values()[a:b] for a, b in zip(starts, stops, strict=True)])
        weights = kjt.weights_or_none()
        if weights is not None:
            weights = torch.cat([weights[a:b] for a, b in zip(starts, stops, strict=True)])
        length_per_key = [b - a for a, b in zip(starts, stops, strict=True)]
        return Batch(
            dense=self.dense[start:stop],
            sparse=KeyedJaggedTensor(
                keys=kjt.keys(),
                values=values,
                lengths=lengths[:, start:stop].reshape(-1).clone(),
                weights=weights,
                length_per_key=length_per_key,
                offset_per_key=[0, *itertools.accumulate(length_per_key)],
            ),
            labels=self.labels[start:stop],
        )

    def take(self, rows: torch.Tensor) -> Batch:
        """Rows ``rows`` (int64 [R], any order, repeats allowed) as a new batch (several
        batches of one batch's rows at once: :func:`gather_batches`)."""
        if not len(rows):
            return self.slice(0, 0)
        return gather_batches(self, rows, [len(rows)])[0]

    def with_offsets(self) -> Batch:
        """This batch with everything a step needs to know about its KJT computed now, on the
        host: the offsets, the ids per key (``length_per_key``), where each key starts
        (``offset_per_key``) and the stride. They travel with the batch (``.to(device)``
        keeps them), so a step on a device never reads them back from a device tensor. The
        loader delivers every batch this way; the values are those the KJT would compute."""
        kjt = self.sparse
        return Batch(
            dense=self.dense,
            sparse=KeyedJaggedTensor(
                keys=kjt.keys(),
                values=kjt.values(),
                weights=kjt.weights_or_none(),
                lengths=kjt.lengths(),
                offsets=kjt.offsets(),
                stride=kjt.stride(),
                length_per_key=kjt.length_per_key(),
                offset_per_key=kjt.offset_per_key(),
            ),
            labels=self.labels,
        )

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Join batches row-wise; all must have the same keys in the same order."""
        if len(batches) == 1:
            return batches[0]
        keys = batches[0].sparse.keys()
        for b in batches[1:]:
            if b.sparse.keys() != keys:
                raise ValueError(f"cannot concat batches with keys {keys} and {b.sparse.keys()}")
        per_key_values = [b.sparse.values().split(b.sparse.length_per_key()) for b in batches]
        values = torch.cat([vals[f] for f in range(len(keys)) for vals in per_key_values])
        lengths = torch.cat([b.sparse.lengths().view(len(keys), -1) for b in batches], dim=1)
        weights = None
        if batches[0].sparse.weights_or_none() is not None:
            per_key_weights = [b.sparse.weights().split(b.sparse.length_per_key()) for b in batches]
            weights = torch.cat([w[f] for f in range(len(keys)) for w in per_key_weights])
        return Batch(
            dense=torch.cat([b.dense for b in batches]),
            sparse=KeyedJaggedTensor(
                keys=keys, values=values, lengths=lengths.reshape(-1), weights=weights
            ),
            labels=torch.cat([b.labels for b in batches]),
        )


Allocate = Callable[[int, torch.dtype], torch.Tensor]
"""``allocate(size, dtype)``: an uninitialized [size] tensor (``torch.empty``, or one in
shared memory)."""


def gather_batches(
    batch: Batch, rows: torch.Tensor, sizes: Sequence[int], allocate: Allocate | None = None
) -> list[Batch]:
    """Rows ``rows`` (int64 [R], indices into ``batch``, any order, repeats allowed) of
    ``batch``, cut into consecutive batches of ``sizes`` rows (summing to R), each carrying its
    KJT's offsets, ids per key and key offsets (as :meth:`Batch.with_offsets`).

    Each key's ids of all R rows are gathered in one pass (a key whose bags all hold m ids,
    one-hot m = 1, as a [B, m] block by row; a ragged key id by id, at its bag's start + its
    rank in the bag), then copied batch by batch into one allocation per tensor
    (``allocate``, default ``torch.empty``; in shared memory the batches cross to another
    process as they are), the batches being views of it.
    """
    if allocate is None:
        allocate = lambda size, dtype: torch.empty(size, dtype=dtype)  # noqa: E731
    kjt = batch.sparse
    num_keys, num_rows, num_taken = len(kjt.keys()), batch.batch_size, len(rows)
    if sum(sizes) != num_taken or any(size < 1 for size in sizes):
        raise ValueError(f"batch sizes {list(sizes)} do not cut {num_taken} rows")
    lengths = kjt.lengths().view(num_keys, num_rows)  # [F, B]
    spans = kjt.offset_per_key()
    same = (lengths == lengths[:, :1]).all(1).tolist() if num_rows else [True] * num_keys
    firsts = [0, *itertools.accumulate(sizes)]  # [P + 1], first row of each batch
    firsts_t = torch.tensor(firsts)
    weights = kjt.weights_or_none()
    taken_lengths = torch.empty((num_keys, num_taken), dtype=lengths.dtype)  # [F, R]
    key_ids: list[list[torch.Tensor | None]] = []  # per key: its values, weights of all R rows
    ids_before: list[list[int]] = []  # per key: its ids in rows [0, firsts[p])
    for f in range(num_keys):
        sources = [
            None if t is None else t[spans[f] : spans[f + 1]] for t in (kjt.values(), weights)
        ]
        if same[f]:
            width = (spans[f + 1] - spans[f]) // max(num_rows, 1)
            taken_lengths[f].fill_(width)
            key_ids.append(
                [
                    None if t is None else t.view(num_rows, width).index_select(0, rows).view(-1)
                    for t in sources
                ]
            )
            ids_before.append([width * first for first in firsts])
            continue
        torch.index_select(lengths[f], 0, rows, out=taken_lengths[f])
        key_lengths, picked = lengths[f].long(), taken_lengths[f].long()
        ends = torch.cumsum(picked, 0)  # [R], inclusive
        total = int(ends[-1])
        shift = (torch.cumsum(key_lengths, 0) - key_lengths).index_select(0, rows) - (
            ends - picked
        )  # each picked bag's start in the key's values - its start among the picked ids
        positions = torch.arange(total) + torch.repeat_interleave(shift, picked, output_size=total)
        key_ids.append([None if t is None else t.index_select(0, positions) for t in sources])
        ids_before.append(torch.cat([torch.zeros(1, dtype=torch.long), ends])[firsts_t].tolist())
    # Per batch: ids per key, where each key starts, where its ids start in the allocation.
    length_per_key = [
        [ids_before[f][p + 1] - ids_before[f][p] for f in range(num_keys)]
        for p in range(len(sizes))
    ]
    num_ids = [sum(per_key) for per_key in length_per_key]
    id_starts = [0, *itertools.accumulate(num_ids)]
    out = {
        "values": allocate(id_starts[-1], kjt.values().dtype),
        "weights": None if weights is None else allocate(id_starts[-1], weights.dtype),
        "lengths": allocate(num_keys * num_taken, lengths.dtype),
        "offsets": allocate(num_keys * num_taken + len(sizes), lengths.dtype),
    }
    dense = allocate(num_taken * batch.dense.shape[1], batch.dense.dtype).view(num_taken, -1)
    torch.index_select(batch.dense, 0, rows, out=dense)
    labels = allocate(num_taken * batch.labels.shape[1], batch.labels.dtype).view(num_taken, -1)
    torch.index_select(batch.labels, 0, rows, out=labels)
    batches = []
    for p, size in enumerate(sizes):
        first, bags = firsts[p], slice(num_keys * firsts[p], num_keys * firsts[p + 1])
        out["lengths"][bags].view(num_keys, size).copy_(taken_lengths[:, first : first + size])
        offsets = out["offsets"][bags.start + p : bags.stop + p + 1]
        offsets[0] = 0
        torch.cumsum(out["lengths"][bags], 0, dtype=offsets.dtype, out=offsets[1:])
        offset_per_key = [0, *itertools.accumulate(length_per_key[p])]
        ids = slice(id_starts[p], id_starts[p + 1])
        for name, column in (("values", 0), ("weights", 1)):
            if out[name] is None:
                continue
            for f in range(num_keys):
                start = id_starts[p] + offset_per_key[f]
                part = key_ids[f][column][ids_before[f][p] : ids_before[f][p + 1]]
                out[name][start : start + len(part)].copy_(part)
        batches.append(
            Batch(
                dense=dense[first : first + size],
                sparse=KeyedJaggedTensor(
                    keys=kjt.keys(),
                    values=out["values"][ids],
                    weights=None if weights is None else out["weights"][ids],
                    lengths=out["lengths"][bags],
                    offsets=offsets,
                    stride=size,
                    length_per_key=length_per_key[p],
                    offset_per_key=offset_per_key,
                ),
                labels=labels[first : first + size],
            )
        )
    return batches
