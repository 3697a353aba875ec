"""Checks of a lookup's ids, offsets and per-sample weights that never stop the device.

An embedding lookup checks its inputs on every call in one of three modes (``train.id_checks``):

- ``"sync"``: the host reads the check's result and raises ``ValueError`` right away (one device
  sync per call; free on CPU);
- ``"async"``: the check runs on the device and writes the first bad input it sees (what was
  wrong, the step, the feature, the position, the id, the table size) into a small device
  buffer of :data:`INPUT_ERRORS`; nothing waits. The lookup reads a sanitized batch (an id out of
  range reads row 0, offsets are clamped to the ids), and the batch's fused table update is
  withheld (see :attr:`CheckedBatch.ok`). The run calls :meth:`InputErrors.raise_first` where it
  syncs anyway (a log event, an evaluation, a checkpoint) and gets the same error as ``"sync"``,
  naming the step;
- ``"off"``: no check (an id out of range reads out of bounds on a GPU).

What is checked: offsets start at 0, never decrease and end at the number of ids; every id read
by a feature is in ``[0, rows of its table)``; per-sample weights are finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ID_CHECKS = ("sync", "async", "off")

# What a record's first field says.
_OK, _BAD_ID, _BAD_WEIGHT, _BAD_OFFSETS = range(4)
_FIELDS = 6  # kind, tag * _SITES + site, feature, position, value, limit
_SITES = 1 << 20  # lookups with distinct feature names / table sizes a process may check


def check_mode(validate: bool | str) -> str:
    """``validate`` of a collection or lookup (True = ``"sync"``, False = ``"off"``, or a mode
    name) as a mode of :data:`ID_CHECKS`."""
    if validate is True:
        return "sync"
    if validate is False:
        return "off"
    if validate not in ID_CHECKS:
        raise ValueError(f"id checks {validate!r}; expected one of {ID_CHECKS} (or True / False)")
    return validate


@dataclass(frozen=True)
class CheckedBatch:
    """A batch after an ``"async"`` check: ids and offsets safe to read (equal to the inputs
    when they were good), and ``ok``, a device bool that is False when the batch was bad."""

    values: torch.Tensor
    offsets: torch.Tensor
    ok: torch.Tensor


class InputErrors:
    """The first bad input the ``"async"`` checks of this process have seen, kept on the device
    until :meth:`raise_first` reads it.

    ``tag`` is the training step the lookups belong to (set by the training loop before each
    step; 0 outside training): the error names it.
    """

    def __init__(self) -> None:
        self.tag = 0
        self._records: dict[torch.device, torch.Tensor] = {}
        self._sites: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self._site_index: dict[tuple[tuple[str, ...], tuple[int, ...]], int] = {}
        self._index_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def check(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        key_rows: Sequence[int],
        key_feature: Sequence[int],
        names: Sequence[str],
        batch_size: int,
    ) -> CheckedBatch:
        """Check a lookup on the device (see the module docstring); no sync.

        ``key_rows[k]``: the row count ids of KJT key k must stay under (int64 max for keys no
        feature reads); ``key_feature[k]``: the feature reading key k (for the message).
        """
        device, num_ids = values.device, values.numel()
        site = self._site(tuple(names), tuple(key_rows))
        starts, limits, bound_feature = self._indices(
            device, key_rows, key_feature, batch_size, offsets
        )
        record = self._record(device)
        # Offsets: good ones equal their safe version (clamped to the ids, made non-decreasing,
        # from 0 to the number of ids). Every value below is a [1] tensor: indexing with a
        # 0-dim tensor would read it on the host.
        safe_offsets = offsets.clamp(0, num_ids).cummax(0).values
        safe_offsets[:1].fill_(0)
        safe_offsets[-1:].fill_(num_ids)
        offsets_wrong = safe_offsets != offsets
        offsets_at = offsets_wrong.to(torch.uint8).argmax().view(1)
        offsets_bad = offsets_wrong.index_select(0, offsets_at)
        # Ids, each against the rows of the table its key feeds.
        bounds = safe_offsets[starts]
        limit = limits.repeat_interleave(bounds.diff(), output_size=num_ids)
        bad = (values < 0) | (values >= limit)
        if num_ids:
            at = bad.to(torch.uint8).argmax().view(1)
            ids_bad, value, row_limit = (t.index_select(0, at) for t in (bad, values, limit))
        else:
            at = value = row_limit = torch.zeros(1, dtype=torch.int64, device=device)
            ids_bad = torch.zeros(1, dtype=torch.bool, device=device)
        feature = bound_feature.index_select(0, torch.searchsorted(bounds, at, right=True))
        kind = torch.where(offsets_bad, _BAD_OFFSETS, _BAD_ID)
        batch_bad = offsets_bad | ids_bad
        if per_sample_weights is not None and num_ids:
            weight_bad = ~torch.isfinite(per_sample_weights)
            weight_at = weight_bad.to(torch.uint8).argmax().view(1)
            kind = torch.where(batch_bad, kind, _BAD_WEIGHT)
            at = torch.where(ids_bad, at, weight_at)
            batch_bad = batch_bad | weight_bad.index_select(0, weight_at)
        found = torch.cat(
            [
                kind,
                torch.full_like(at, self.tag * _SITES + site),
                feature,
                torch.where(offsets_bad, offsets_at, at),
                torch.where(offsets_bad, offsets.index_select(0, offsets_at), value),
                torch.where(offsets_bad, safe_offsets.index_select(0, offsets_at), row_limit),
            ]
        )
        record.copy_(torch.where(batch_bad & (record[:1] == _OK), found, record))
        safe_values = torch.where(bad, 0, values) if num_ids else values
        return CheckedBatch(safe_values, safe_offsets, ~batch_bad)

    def raise_first(self) -> None:
        """Raise ``ValueError`` for the first bad input recorded since the last call (a device
        sync); clear the record."""
        for record in self._records.values():
            kind, tag_site, feature, position, value, limit = record.tolist()
            if kind == _OK:
                continue
            record.zero_()
            tag, site = divmod(tag_site, _SITES)
            names = self._sites[site][0]
            raise ValueError(_message(kind, tag, names, feature, position, value, limit))

    def _record(self, device: torch.device) -> torch.Tensor:
        record = self._records.get(device)
        if record is None:
            record = self._records[device] = torch.zeros(_FIELDS, dtype=torch.int64, device=device)
        return record

    def _site(self, names: tuple[str, ...], key_rows: tuple[int, ...]) -> int:
        key = (names, key_rows)
        if key not in self._site_index:
            self._site_index[key] = len(self._sites)
            self._sites.append(key)
        return self._site_index[key]

    def _indices(
        self,
        device: torch.device,
        key_rows: Sequence[int],
        key_feature: Sequence[int],
        batch_size: int,
        offsets: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Where each key's ids start among the offsets, each key's row limit, and the feature
        reading each key (shifted by one, for ``searchsorted``): device tensors built once per
        (device, keys, batch size)."""
        cache_key = (device, tuple(key_rows), tuple(key_feature), batch_size, offsets.numel())
        cached = self._index_cache.get(cache_key)
        if cached is None:
            starts = [k * batch_size for k in range(len(key_rows))] + [offsets.numel() - 1]
            # searchsorted(bounds, position, right=True) is 1 + the key of an id at position.
            bound_feature = [key_feature[0], *key_feature, key_feature[-1]]
            cached = tuple(
                torch.tensor(list(x), device=device) for x in (starts, key_rows, bound_feature)
            )
            self._index_cache[cache_key] = cached
        return cached


def _message(
    kind: int, tag: int, names: Sequence[str], feature: int, position: int, value: int, limit: int
) -> str:
    """The error of a record, in the words of the ``"sync"`` checks, with the step. For bad
    offsets ``limit`` is what the offset at ``position`` should have been."""
    where = f"step {tag}: " if tag else ""
    if kind == _BAD_ID:
        return (
            f"{where}{names[feature]}: id {value} is out of range for its table with {limit} "
            f"rows (expected 0 <= id < {limit})"
        )
    if kind == _BAD_WEIGHT:
        return f"{where}per-sample weight at position {position} is not finite (nan or inf)"
    if position == 0:
        return f"{where}offsets must start at 0, got {value}"
    if value > limit:
        return f"{where}offsets reach {value} at offsets[{position}] but there are {limit} ids"
    return (
        f"{where}offsets must be non-decreasing (bag lengths >= 0) and end at the number of "
        f"ids, but offsets[{position}] = {value} where at least {limit} was expected"
    )


INPUT_ERRORS = InputErrors()
