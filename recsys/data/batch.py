"""The unit of data every recsys component exchanges.

A :class:`Batch` holds B samples: dense features f32[B, N_dense], categorical features as a
``torchrec.KeyedJaggedTensor`` (F keys, key-major: all of key 0's bags, then key 1's, ...) and
labels f32[B, T]. Datasets produce large batches ("chunks": a synthetic block, a parquet row
group) and the loader cuts and joins them into training batches with :meth:`Batch.slice` and
:meth:`Batch.concat`, so a sample is the same whatever the batch size.
"""

from __future__ import annotations

import itertools
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
        """Rows ``[start, stop)`` as a new batch (values are copied only for the sparse part)."""
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
        return Batch(
            dense=self.dense[start:stop],
            sparse=KeyedJaggedTensor(
                keys=kjt.keys(),
                values=values,
                lengths=lengths[:, start:stop].reshape(-1).clone(),
                weights=weights,
            ),
            labels=self.labels[start:stop],
        )

    def take(self, rows: torch.Tensor) -> Batch:
        """Rows ``rows`` (int64 [R], any order, repeats allowed) as a new batch.

        Key by key, into preallocated outputs: a key whose bags all have m ids (one-hot: m = 1)
        is a [B, m] block of values, gathered by row; another key gathers each id by its
        position.
        """
        kjt = self.sparse
        num_keys, num_rows, num_taken = len(kjt.keys()), self.batch_size, len(rows)
        lengths = kjt.lengths().view(num_keys, num_rows)  # [F, B]
        spans = kjt.offset_per_key()
        same = (lengths == lengths[:, :1]).all(1).tolist() if num_rows else [True] * num_keys
        taken_lengths = torch.empty((num_keys, num_taken), dtype=lengths.dtype)  # [F, R]
        positions: list[torch.Tensor | None] = []  # per key: its ids' positions, None: a block
        sizes = []
        for f in range(num_keys):
            if same[f]:
                width = (spans[f + 1] - spans[f]) // max(num_rows, 1)
                taken_lengths[f].fill_(width)
                positions.append(None)
                sizes.append(width * num_taken)
            else:
                torch.index_select(lengths[f], 0, rows, out=taken_lengths[f])
                positions.append(_id_positions(lengths[f].long(), rows, taken_lengths[f].long()))
                sizes.append(len(positions[-1]))
        starts = [0, *itertools.accumulate(sizes)]
        weights = kjt.weights_or_none()
        gathered = []
        for source in (kjt.values(), weights):
            if source is None:
                gathered.append(None)
                continue
            out = torch.empty(starts[-1], dtype=source.dtype)
            for f in range(num_keys):
                key_source = source[spans[f] : spans[f + 1]]
                key_out = out[starts[f] : starts[f + 1]]
                if positions[f] is not None:
                    torch.index_select(key_source, 0, positions[f], out=key_out)
                elif sizes[f] == num_taken:  # one id per bag
                    torch.index_select(key_source, 0, rows, out=key_out)
                elif sizes[f]:
                    block = key_out.view(num_taken, -1)
                    torch.index_select(key_source.view(num_rows, -1), 0, rows, out=block)
            gathered.append(out)
        return Batch(
            dense=self.dense.index_select(0, rows),
            sparse=KeyedJaggedTensor(
                keys=kjt.keys(),
                values=gathered[0],
                lengths=taken_lengths.view(-1),
                weights=gathered[1],
            ),
            labels=self.labels.index_select(0, rows),
        )

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


def _id_positions(lengths: torch.Tensor, rows: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Where the ids of bags ``rows`` are among one key's values (bag lengths ``lengths`` [B],
    ``picked`` = lengths[rows]): each id's bag start + its rank in the bag, where rank = (its
    index in the output) - (its bag's first index in the output)."""
    starts = (torch.cumsum(lengths, 0) - lengths).index_select(0, rows)  # [R]
    total = int(picked.sum())
    bag_first = torch.cumsum(picked, 0) - picked  # [R], exclusive
    shift = torch.repeat_interleave(starts - bag_first, picked, output_size=total)
    return torch.arange(total) + shift
