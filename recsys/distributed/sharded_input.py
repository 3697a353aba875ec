"""A sharded collection's input: its checks, without a host read of their own, and the batches
its input dist delivers or has under way (:class:`LocalBatch`, :class:`StartedInput`).

A sharded lookup's ids are updated on other ranks, so every rank must know, before any id
travels, whether every rank's batch is good. The check (offsets start at 0, never decrease and
end at the number of ids; every id of a fixed table in ``[0, rows)``; no reserved key in a
dynamic one; per-sample weights finite) runs on the device (:func:`check_on_device`), and its
verdict travels with the input dist's counts, which every rank reads on the host anyway: one
read for both. A bad batch
raises ``ValueError`` on every rank at that read, before any id moves or any table changes
(:func:`raise_on_bad_input`): the rank whose batch it was names the input, the others name
that rank. Until then the routing reads a safe batch (an id out of range reads 0, offsets are
clamped to the ids), so a bad id cannot send anything out of bounds.

``train.id_checks`` ``"sync"`` and ``"async"`` both check this way (``"off"``: no check). A
collection with no sharded table exchanges no counts: it checks on the host
(:func:`check_now`), as the rank with a bad batch does to name what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torchrec import KeyedJaggedTensor

from recsys.distributed.comm import PendingIds
from recsys.distributed.counts import PendingCounts
from recsys.distributed.replicated import TouchedRows
from recsys.distributed.routing import RoutedIds
from recsys.ops.embedding_bag.pooled import validate_inputs
from recsys.ops.slot_map.hash_map import RESERVED_KEY, check_keys


@dataclass(frozen=True)
class CheckedInput:
    """A batch after :func:`check_on_device`: what the routing reads (equal to the input when
    it was good) and the verdict."""

    lengths: torch.Tensor  # [F, B] bag lengths
    values: torch.Tensor  # [L] ids (a fixed table's id out of range reads 0)
    ok: torch.Tensor  # [1] bool: the batch is good


@dataclass(frozen=True)
class InputSpec:
    """What the checks need to know of a sharded collection: per feature (in its order) its
    name and its table, per table its rows and pooling, and ``key_buckets`` ([F] device
    int64, > 0 for a feature of a dynamic table; None: no dynamic table)."""

    names: Sequence[str]
    table_of: Sequence[int]
    table_rows: Sequence[int]
    poolings: Sequence[str]
    key_buckets: torch.Tensor | None
    indices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )  # built once per (batch size, offsets, device): see _indices


@dataclass(frozen=True)
class LocalBatch:
    """What input_dist delivers to this rank: the ids every rank sent to its shards, as one
    KeyedJaggedTensor of sum_s B_s samples (``batch_sizes[s]`` from rank s)."""

    features: KeyedJaggedTensor
    batch_sizes: list[int]
    touched: TouchedRows | None = None  # the rows the batch touches in the replicated tables


MAX_PREFETCHED = 2  # batches kept with their input_dist done: the one training, the next


@dataclass(frozen=True)
class StartedInput:
    """An input dist whose counts are under way (:meth:`ShardedEmbeddingBagCollection.
    start_input_dist`): the batch as routed, its device-side check, the counts exchange."""

    features: KeyedJaggedTensor  # checked, in the collection's feature order
    weights: torch.Tensor | None
    routed: RoutedIds
    checked: bool  # the counts carry the input check's verdict
    counts: PendingCounts


@dataclass
class Prefetched:
    """A batch :meth:`ShardedEmbeddingBagCollection.prefetch_input` ran ahead: its counts under
    way (``started``), then its ids (``pending``) once a forward sent them, or its input dist
    done (``local``); ``error``: its input check failed (raised by its own forward)."""

    given: KeyedJaggedTensor  # the object prefetch_input had (forward must get this one)
    features: KeyedJaggedTensor  # checked, in the collection's feature order
    started: StartedInput | None  # its counts under way; None: sent, or nothing exchanged
    pending: PendingIds | None = None  # its ids under way
    local: LocalBatch | None = None  # its input_dist done (tiered shards prefetch its rows)
    error: ValueError | None = None


class PrefetchQueue:
    """The batches a sharded collection's ``prefetch_input`` ran ahead, oldest first (the
    newest :data:`MAX_PREFETCHED`)."""

    def __init__(self) -> None:
        self.entries: list[Prefetched] = []

    def add(self, entry: Prefetched) -> None:
        """Queue ``entry``, dropping the oldest beyond :data:`MAX_PREFETCHED`."""
        kept = self.entries[-(MAX_PREFETCHED - 1) :]
        for dropped in self.entries[: len(self.entries) - len(kept)]:
            if dropped.started is not None:  # its counts arrive; its ids are never sent
                dropped.started.counts.wait()
        self.entries = [*kept, entry]

    def take(self, features: KeyedJaggedTensor) -> Prefetched | None:
        """The entry of this very ``features`` object, dropped with older ones."""
        for position, entry in enumerate(self.entries):
            if entry.given is features:
                self.entries = self.entries[position + 1 :]
                return entry
        return None

    def send(self, send_input: Callable[[StartedInput], PendingIds]) -> None:
        """After a forward's exchanges: send the ids of every queued batch whose counts are
        under way (read now: they had the forward's compute to arrive), in the order they
        were queued, as every rank does. A batch whose input check failed sends nothing (on
        any rank: all read the same verdicts); its forward raises."""
        for entry in self.entries:
            if entry.started is None:
                continue
            started, entry.started = entry.started, None
            try:
                entry.pending = send_input(started)
            except ValueError as error:
                entry.error = error

    def clear(self) -> None:
        self.entries = []


def check_on_device(
    spec: InputSpec, features: KeyedJaggedTensor, weights: torch.Tensor | None
) -> CheckedInput:
    """Check ``features`` (the collection's features, in its order) on the device; no sync.
    Only the verdict: the rank whose batch is bad finds what is wrong on the host afterwards
    (:func:`raise_on_bad_input`)."""
    values, offsets = features.values(), features.offsets()
    num_features, batch_size, num_ids = len(spec.names), features.stride(), values.numel()
    safe = offsets.clamp(0, num_ids).cummax(0).values  # good offsets: equal to these
    safe[:1].fill_(0)
    safe[-1:].fill_(num_ids)
    ok = (safe == offsets).all().view(1)
    starts, limits = _indices(spec, batch_size, offsets.numel(), values.device)
    bounds = safe.index_select(0, starts)  # [F + 1] where each feature's ids start
    feature_ids = bounds.diff()
    key_wise = None
    if spec.key_buckets is not None:  # a dynamic table's keys: any int64 but the reserved two
        feature = torch.arange(num_features, device=values.device)
        feature = torch.repeat_interleave(feature, feature_ids, output_size=num_ids)
        key_wise = spec.key_buckets[feature] > 0
        ok &= ~((values <= RESERVED_KEY) & key_wise).any()
        limit = limits[feature]
    else:
        limit = limits.repeat_interleave(feature_ids, output_size=num_ids)
    bad = (values < 0) | (values >= limit)
    if key_wise is not None:
        bad &= ~key_wise
    ok &= ~bad.any()
    if weights is not None:
        ok &= torch.isfinite(weights).all()
    lengths = safe.diff().view(num_features, batch_size)
    return CheckedInput(lengths, values.masked_fill(bad, 0), ok)


def _indices(
    spec: InputSpec, batch_size: int, num_offsets: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each feature's bags start among the offsets (and the end), and each feature's
    row limit: device tensors built once per (spec, batch size, device)."""
    key = (batch_size, num_offsets, device)
    if key not in spec.indices:
        starts = [f * batch_size for f in range(len(spec.names))] + [num_offsets - 1]
        limits = [spec.table_rows[t] for t in spec.table_of]
        spec.indices[key] = (
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(limits, dtype=torch.int64, device=device),
        )
    return spec.indices[key]


def raise_on_bad_input(
    verdicts: Sequence[int],
    rank: int,
    spec: InputSpec,
    features: KeyedJaggedTensor,
    weights: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` on every rank when some rank's batch failed its check
    (``verdicts[s]``: rank s's, 1 good, 0 bad; the same list on every rank): on a rank whose
    batch it was, naming the bad input (read on the host now); on the others, naming the first
    such rank."""
    bad = [s for s, ok in enumerate(verdicts) if not ok]
    if not bad:
        return
    if rank in bad:
        check_now(spec, features, weights)
        if weights is not None and not bool(torch.isfinite(weights).all()):
            position = int((~torch.isfinite(weights)).nonzero()[0])
            raise ValueError(f"per-sample weight at position {position} is not finite (nan or inf)")
        raise ValueError(f"rank {rank}'s batch failed its input check")
    raise ValueError(
        f"the batch of rank {bad[0]} failed its input check (that rank's error names the "
        "input); no rank's batch was looked up"
    )


def check_now(spec: InputSpec, features: KeyedJaggedTensor, weights: torch.Tensor | None) -> None:
    """The same checks, read on the host now (a sync on a device)."""
    values = features.values()
    if spec.key_buckets is not None:
        lengths = features.lengths().view(len(spec.names), -1).sum(dim=1)
        arange = torch.arange(len(lengths), device=values.device)
        feature = torch.repeat_interleave(arange, lengths, output_size=values.numel())
        key_wise = spec.key_buckets[feature] > 0
        check_keys(values.masked_fill(~key_wise, 0), "ids of dynamic tables")
        values = values.masked_fill(key_wise, 0)
    validate_inputs(
        spec.table_rows,
        values,
        features.offsets(),
        list(range(len(spec.names))),
        spec.table_of,
        spec.poolings,
        features.stride(),
        weights,
        spec.names,
    )
