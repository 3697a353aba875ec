"""Multi-table pooled embedding lookup (embedding bag) over KeyedJaggedTensor-layout ids.

Shapes: B batch, K keys in the KJT, F pooled features, T tables, L total ids, N_t rows and D_t
columns of table t. Feature f reads KJT key ``k = feature_to_key[f]`` and table
``t = feature_to_table[f]``; several features may share a table. For sample b, feature f:

    ids    = values[offsets[k*B + b] : offsets[k*B + b + 1]]       (a bag, possibly empty)
    out[b, cols(f)] = sum_i w_i * W_t[ids[i]]                       pooling "sum"
                    = (sum_i w_i * W_t[ids[i]]) / max(len(ids), 1)  pooling "mean"

where w_i are the per-sample weights (1 when absent) and cols(f) is feature f's slice of the
[B, sum_f D_t(f)] output, features in order. An empty bag gives zeros. Mean pooling with
weights divides by the bag length, not by the sum of weights (as FBGEMM does).

Dtypes: tables fp32 / fp16 / bf16 (accumulated and returned in fp32) or fp64 (returned in fp64);
ids and offsets int32 or int64. The torch path is deterministic on CPU.

Backends (see ``recsys.ops._triton``): ``torch`` uses ``torch.nn.functional.embedding_bag`` once
per feature; its backward gives dense gradients for the tables, so any torch optimizer works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from recsys.ops._triton import resolve_backend

POOLINGS = ("sum", "mean")


def embedding_bag_reference(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch specification of :func:`embedding_bag` (run in float64 by the tests)."""
    B = batch_size
    out_dtype = torch.promote_types(weights[0].dtype, torch.float32)
    pooled = []
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        bag_offsets = offsets[k * B : (k + 1) * B + 1].long()
        start, stop = int(bag_offsets[0]), int(bag_offsets[-1])
        lengths = bag_offsets.diff()  # [B]
        bag = torch.repeat_interleave(torch.arange(B, device=values.device), lengths)
        rows = weights[t][values[start:stop].long()].to(out_dtype)  # [L_f, D_t]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[start:stop].to(out_dtype).unsqueeze(1)
        sums = torch.zeros(B, rows.shape[1], dtype=out_dtype, device=values.device)
        sums = sums.index_add(0, bag, rows)  # [B, D_t]
        if table_pooling[t] == "mean":
            sums = sums / lengths.clamp(min=1).to(out_dtype).unsqueeze(1)
        pooled.append(sums)
    return torch.cat(pooled, dim=1)  # [B, sum D]


def validate_inputs(
    weights: Sequence[torch.Tensor],
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

    One pass over ids and offsets (a device sync on CUDA). ``feature_names`` only improves the
    messages.
    """
    names = (
        list(feature_names)
        if feature_names is not None
        else [f"feature {f}" for f in range(len(feature_to_key))]
    )
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
    num_keys = max(feature_to_key, default=-1) + 1
    if offsets.numel() < num_keys * batch_size + 1:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; {num_keys} keys x batch {batch_size} "
            f"need at least {num_keys * batch_size + 1}"
        )
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
    if per_sample_weights is not None:
        if not per_sample_weights.is_floating_point():
            raise ValueError(
                f"per-sample weights must be floating point, got {per_sample_weights.dtype}"
            )
        if per_sample_weights.shape != values.shape:
            raise ValueError(
                f"per-sample weights have shape {tuple(per_sample_weights.shape)}, "
                f"expected one weight per id: ({values.numel()},)"
            )
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise ValueError(f"all tables must share one dtype, got {sorted(map(str, dtypes))}")
    for t, pooling in enumerate(table_pooling):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} of table {t}; expected one of {POOLINGS}")
    # One pass over the ids: each id is compared with the row count of the table its key
    # feeds (keys no feature reads are not checked).
    key_rows = [torch.iinfo(torch.int64).max] * num_keys
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        key_rows[k] = weights[t].shape[0]
    bounds = offsets[[k * batch_size for k in range(num_keys + 1)]]
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


def _embedding_bag_torch(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None,
) -> torch.Tensor:
    B = batch_size
    out_dtype = torch.promote_types(weights[0].dtype, torch.float32)
    num_keys = max(feature_to_key, default=-1) + 1
    bounds = offsets[[k * B for k in range(num_keys + 1)]].tolist()
    pooled = []
    for k, t in zip(feature_to_key, feature_to_table, strict=True):
        start, stop = bounds[k], bounds[k + 1]
        bag_offsets = (offsets[k * B : (k + 1) * B + 1] - start).to(values.dtype)
        psw = None if per_sample_weights is None else per_sample_weights[start:stop]
        mean = table_pooling[t] == "mean"
        ids, table = values[start:stop], weights[t]
        if table.dtype in (torch.float16, torch.bfloat16):
            # ATen pools in the table's dtype; gather the rows and pool them in fp32 instead.
            table = table[ids.long()].float()  # [L_f, D_t]
            ids = torch.arange(ids.numel(), device=ids.device, dtype=ids.dtype)
        out = F.embedding_bag(
            ids,
            table,
            bag_offsets,
            # ATen rejects per-sample weights with mean pooling: sum, then divide below.
            mode="mean" if mean and psw is None else "sum",
            per_sample_weights=None if psw is None else psw.to(table.dtype),
            include_last_offset=True,
        ).to(out_dtype)  # [B, D_t]
        if mean and psw is not None:
            out = out / bag_offsets.diff().clamp(min=1).to(out_dtype).unsqueeze(1)
        pooled.append(out)
    return torch.cat(pooled, dim=1)  # [B, sum D]


def embedding_bag(
    weights: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    feature_to_table: Sequence[int],
    table_pooling: Sequence[str],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    validate: bool = True,
    feature_names: Sequence[str] | None = None,
) -> torch.Tensor:
    """Pooled lookup of F features over T tables in one call.

    Args:
        weights: T tables, table t of shape [N_t, D_t], one dtype.
        values: [L] ids in KeyedJaggedTensor layout (key-major).
        offsets: [K*B + 1] KJT offsets: bag b of key k is values[offsets[k*B+b]:offsets[k*B+b+1]].
        feature_to_key: for each output feature, the KJT key it reads.
        feature_to_table: for each output feature, the table it looks up.
        table_pooling: per table, ``"sum"`` or ``"mean"``.
        batch_size: B.
        per_sample_weights: optional [L] weight of each id.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``recsys.ops._triton``).
        validate: check ids, offsets and weights first (one pass; turn off for speed once the
            input pipeline is trusted).
        feature_names: names used in validation errors.

    Returns:
        [B, sum_f D_t(f)] pooled embeddings, features in order; fp32 (fp64 for fp64 tables).

    Example::

        W = [torch.randn(10, 4)]
        ids, offsets = torch.tensor([1, 2, 7]), torch.tensor([0, 2, 3])
        embedding_bag(W, ids, offsets, [0], [0], ["sum"], batch_size=2)  # [2, 4]
    """
    if validate:
        validate_inputs(
            weights,
            values,
            offsets,
            feature_to_key,
            feature_to_table,
            table_pooling,
            batch_size,
            per_sample_weights,
            feature_names,
        )
    resolve_backend(backend, values.device, op="embedding_bag", has_triton=False)
    return _embedding_bag_torch(
        weights,
        values,
        offsets,
        feature_to_key,
        feature_to_table,
        table_pooling,
        batch_size,
        per_sample_weights,
    )
