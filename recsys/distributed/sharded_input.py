"""The checks of a sharded collection's input, without a host read of their own.

A sharded lookup's ids are updated on other ranks, so every rank must know, before any id
travels, whether every rank's batch is good. The check (offsets start at 0, never decrease and
end at the number of ids; every id of a fixed table in ``[0, rows)``; no reserved key in a
dynamic one; per-sample weights finite) runs on the device (:func:`check_on_device`, the
``"async"`` checks of :mod:`recsys.ops.input_checks`), and its verdict travels with the input
dist's counts, which every rank reads on the host anyway: one read for both. A bad batch
raises ``ValueError`` on every rank at that read, before any id moves or any table changes
(:func:`raise_on_bad_input`): the rank whose batch it was names the input, the others name
that rank. Until then the routing reads a safe batch (an id out of range reads 0, offsets are
clamped to the ids), so a bad id cannot send anything out of bounds.

``train.id_checks`` ``"sync"`` and ``"async"`` both check this way (``"off"``: no check). A
collection with no sharded table exchanges no counts: it checks on the host
(:func:`check_now`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

from recsys.ops.embedding_bag import validate_inputs
from recsys.ops.input_checks import INPUT_ERRORS
from recsys.ops.slot_map import RESERVED_KEY, check_keys


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


def check_on_device(
    spec: InputSpec, features: KeyedJaggedTensor, weights: torch.Tensor | None
) -> CheckedInput:
    """Check ``features`` (the collection's features, in its order) on the device; no sync.
    The first bad input is recorded in :data:`~recsys.ops.input_checks.INPUT_ERRORS`."""
    values, offsets = features.values(), features.offsets()
    num_features, batch_size = len(spec.names), features.stride()
    fixed, key_wise, reserved = values, None, None
    if spec.key_buckets is not None:  # a dynamic table's keys: any int64 but the reserved two
        bounds = _safe(offsets, values.numel())[
            torch.arange(num_features + 1, device=values.device) * batch_size
        ]
        feature = torch.repeat_interleave(
            torch.arange(num_features, device=values.device),
            bounds.diff(),
            output_size=values.numel(),
        )
        key_wise = spec.key_buckets[feature] > 0
        reserved = ((values <= RESERVED_KEY) & key_wise).any().view(1)
        fixed = values.masked_fill(key_wise, 0)
    checked = INPUT_ERRORS.check(
        fixed,
        offsets,
        weights,
        [spec.table_rows[t] for t in spec.table_of],
        list(range(num_features)),
        list(spec.names),
        batch_size,
    )
    ok = checked.ok if reserved is None else checked.ok & ~reserved
    routed = checked.values if key_wise is None else torch.where(key_wise, values, checked.values)
    lengths = checked.offsets.diff().view(num_features, batch_size)
    return CheckedInput(lengths, routed, ok)


def _safe(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``offsets`` clamped to the ids, non-decreasing, from 0 to ``num_ids`` (as the check's)."""
    safe = offsets.clamp(0, num_ids).cummax(0).values
    safe[:1].fill_(0)
    safe[-1:].fill_(num_ids)
    return safe


def raise_on_bad_input(
    verdicts: Sequence[int],
    rank: int,
    spec: InputSpec,
    features: KeyedJaggedTensor,
    weights: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` on every rank when some rank's batch failed its check
    (``verdicts[s]``: rank s's, 1 good, 0 bad; the same list on every rank): on a rank whose
    batch it was, naming the bad input; on the others, naming the first such rank."""
    bad = [s for s, ok in enumerate(verdicts) if not ok]
    if not bad:
        return
    if rank in bad:
        INPUT_ERRORS.raise_first()  # what the device check recorded
        check_now(spec, features, weights)  # a reserved key: not among the recorded errors
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
