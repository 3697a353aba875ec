"""The checks of an embedding lookup's inputs (see :func:`validate_inputs` and
:mod:`recsys.ops.input_checks`): ids within their tables, well-formed offsets, finite per-sample
weights, read on the host now or checked on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recsys.ops.embedding_bag.layout import POOLINGS, LookupPlan
from recsys.ops.input_checks import INPUT_ERRORS, CheckedBatch


def validate_inputs(
    table_rows: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    feature_names: Sequence[str] | None = None,
) -> None:
    """Raise ``ValueError`` for inputs that would read out of bounds or be silently wrong.

    ``table_rows`` is each table's row count. One pass over ids and offsets (a device sync on
    CUDA). ``feature_names`` only improves the messages.
    """
    names = _feature_names(feature_names, len(feature_to_key))
    _check_index_tensors(values, offsets, batch_size, max(feature_to_key, default=-1) + 1)
    _check_offsets(values, offsets)
    if per_sample_weights is not None:
        _check_per_sample_weights(values, per_sample_weights)
    for t, pooling in enumerate(table_pooling):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} of table {t}; expected one of {POOLINGS}")
    _check_ids(table_rows, values, offsets, feature_to_key, feature_to_table, batch_size, names)


def _check_index_tensors(
    values: torch.Tensor, offsets: torch.Tensor, batch_size: int, num_keys: int
) -> None:
    """Ids and offsets are 1-D integer tensors, with an offset for every bag of ``num_keys``
    keys."""
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"ids must be a 1-D int32/int64 tensor, got {values.dtype} {tuple(values.shape)}"
        )
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets must be a 1-D int32/int64 tensor, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if offsets.numel() < num_keys * batch_size + 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; {num_keys} keys x batch {batch_size} "
            f"need at least {num_keys * batch_size + 1}"
        )


def _check_offsets(values: torch.Tensor, offsets: torch.Tensor) -> None:
    """Offsets start at 0, never decrease, and end at the number of ids."""
    if int(offsets[0]) != 0:
        raise ValueError(f"offsets must start at 0, got {int(offsets[0])}")
    steps = offsets.diff()
    if steps.numel() and int(steps.min()) < 0:
        where = int((steps < 0).nonzero()[0])
        raise ValueError(
            f"offsets must be non-decreasing (bag lengths >= 0), but offsets[{where}] = "
            f"{int(offsets[where])} > offsets[{where + 1}] = {int(offsets[where + 1])}"
        )
    if int(offsets[-1]) != values.numel():
        raise ValueError(f"offsets end at {int(offsets[-1])} but there are {values.numel()} ids")


def _check_per_sample_weights(values: torch.Tensor, per_sample_weights: torch.Tensor) -> None:
    """One floating-point weight per id."""
    if not per_sample_weights.is_floating_point():
        raise ValueError(
            f"per-sample weights must be floating point, got {per_sample_weights.dtype}"
        )
    if per_sample_weights.shape != values.shape:
        raise ValueError(
            f"per-sample weights have shape {tuple(per_sample_weights.shape)}, "
            f"expected one weight per id: ({values.numel()},)"
        )


def _check_ids(
    table_rows: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    batch_size: int,
    names: Sequence[str],
) -> None:
    """One pass over the ids: each id is compared with the row count of the table its key
    feeds (keys no feature reads are not checked)."""
    num_keys = max(feature_to_key, default=-1) + 1
    if batch_size > 0:  # the KJT may hold more keys than the features read
        num_keys = (offsets.numel() - 1) // batch_size
    key_rows = [torch.iinfo(torch.int64).max] * num_keys
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        key_rows[k] = table_rows[t]
    bounds = offsets[[k * batch_size for k in range(num_keys)] + [offsets.numel() - 1]]
    ids_per_key = bounds.diff().long()
    limit = torch.repeat_interleave(torch.tensor(key_rows, device=values.device), ids_per_key)
    out_of_range = (values < 0) | (values >= limit)
    if bool(out_of_range.any()):
        where = int(out_of_range.nonzero()[0])
        key = (
            int(torch.searchsorted(bounds, torch.tensor(where, dtype=bounds.dtype), right=True)) - 1
        )
        f = list(feature_to_key).index(key)
        num_rows = key_rows[key]
        raise ValueError(
            f"{names[f]}: id {int(values[where])} is out of range for its table with {num_rows} "
            f"rows (expected 0 <= id < {num_rows})"
        )


def check_on_device(
    plan: LookupPlan,
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    batch_size: int,
    per_sample_weights: torch.Tensor | None,
    feature_names: Sequence[str] | None,
) -> CheckedBatch:
    """The ``"async"`` checks: what the host knows (dtypes, shapes, poolings) now, the values
    on the device (:meth:`InputErrors.check`)."""
    _check_index_tensors(values, offsets, batch_size, max(feature_to_key, default=-1) + 1)
    if per_sample_weights is not None:
        _check_per_sample_weights(values, per_sample_weights)
    num_keys = (offsets.numel() - 1) // batch_size if batch_size > 0 else len(feature_to_key)
    key_rows = [torch.iinfo(torch.int64).max] * num_keys
    key_feature = [0] * num_keys
    for f, (k, t) in enumerate(zip(feature_to_key, plan.feature_to_table, strict=True)):
        key_rows[k], key_feature[k] = plan.layout.rows[t], f
    names = _feature_names(feature_names, len(feature_to_key))
    return INPUT_ERRORS.check(
        values, offsets, per_sample_weights, key_rows, key_feature, names, batch_size
    )


def _feature_names(feature_names: Sequence[str] | None, num_features: int) -> list[str]:
    if feature_names is not None:
        return list(feature_names)
    return [f"feature {f}" for f in range(num_features)]
