"""CPU paths of the table-batched embedding bag (see ``recsys.ops.embedding_bag.pooled``).

- torch (runs anywhere): one ``F.embedding_bag`` per feature over its table's view of the
  packed buffer; backward sorts the lookups per group of equal-dim tables, reduces each row's
  gradients with ``F.embedding_bag`` over the upstream gradient, then updates the touched rows
  (:func:`recsys.ops.embedding_bag.row_update.update_rows`) or hands back dense gradients.
- fbgemm (CPU, fused SGD / Adagrad / RowWiseAdagrad on fp32 tables of one dim and one pooling):
  FBGEMM's C++ fused backward (fbgemm-gpu-cpu), behind FBGEMM's forward for small batches and
  the torch forward for large ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recsys.ops._triton import accumulate_dtype
from recsys.ops.embedding_bag.layout import (
    FusedUpdate,
    LookupPlan,
    PlanTensors,
    TableLayout,
    bag_lookups,
    lookup_scale,
    padded_segments,
    rounding_seed,
    sorted_segments,
)
from recsys.ops.embedding_bag.row_update import update_rows


@dataclass(frozen=True)
class GroupLookups:
    """The L_g lookups of one dim group, bags in sample-major order (bag b * F_g + f)."""

    ids: torch.Tensor  # [L_g] int64: the group-local row each lookup reads
    bag: torch.Tensor  # [L_g] int64: its bag
    scale: torch.Tensor | None  # [L_g]: per-sample weight x 1/length if mean; None: all 1


def _group_lookups(
    plan: LookupPlan,
    tensors: PlanTensors,
    group: int,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    scale_dtype: torch.dtype,
    num_lookups: int | None = None,
) -> GroupLookups:
    """Every lookup of dim group ``group`` in this batch (see :class:`GroupLookups`);
    ``num_lookups``: their count, when the host knows it."""
    group_tensors = tensors.groups[group]
    keys = group_tensors.key  # [F_g]
    lookups = bag_lookups(offsets, keys, batch_size, sample_major=True, num_lookups=num_lookups)
    feature = lookups.bag % keys.numel()
    ids = values[lookups.position].long() + group_tensors.row[feature]
    mean = group_tensors.mean[feature] if plan.group_any_mean[group] else None
    scale = lookup_scale(lookups, per_sample_weights, mean, scale_dtype)
    return GroupLookups(ids=ids, bag=lookups.bag, scale=scale)


def pool_torch(
    plan: LookupPlan,
    tables: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    feature_to_key: Sequence[int],
    batch_size: int,
    key_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """One ``F.embedding_bag`` per feature over its table (``tables``: each table's [N_t, D_t]
    weight, e.g. its view of the packed buffer), reading the feature's KJT slice in place
    (ATen's CPU kernel; measured faster than one call over the whole buffer, whose bags would
    first have to be reordered sample-major). ``key_lengths``: the ids of each KJT key, when
    the host knows them (else the slices' bounds are read from ``offsets``). Traceable by
    torch.export: B may be symbolic."""
    B, out_dtype = batch_size, accumulate_dtype(tables[0].dtype)
    num_keys = max(feature_to_key, default=-1) + 1
    if key_lengths is not None:
        bounds = [0, *itertools.accumulate(key_lengths)]
    else:
        # A tensor index, not a list of k * B: torch.export would fix B to the traced value.
        bounds = offsets[torch.arange(num_keys + 1, device=offsets.device) * B].tolist()
    pooled = []
    for k, t in zip(feature_to_key, plan.feature_to_table, strict=True):
        start, stop = bounds[k], bounds[k + 1]
        bag_offsets = (offsets[k * B : (k + 1) * B + 1] - start).to(values.dtype)
        psw = None if per_sample_weights is None else per_sample_weights[start:stop]
        mean = plan.table_mean[t]
        ids, table = values[start:stop], tables[t]
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
    if not pooled:
        return torch.zeros(B, 0, dtype=out_dtype, device=values.device)
    return torch.cat(pooled, dim=1)  # [B, total_D]


def pool_packed(
    weight: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    key_rows: torch.Tensor,
    key_base: torch.Tensor,
    mean: bool,
    batch_size: int,
) -> torch.Tensor:
    """Every bag of a key-major batch of K keys pooled by one ``F.embedding_bag`` over
    ``weight`` [R, D], tables of one dim packed in one matrix (a view of the packed buffer):
    key k's ids are rows of its table, which has ``key_rows[k]`` rows from row
    ``key_base[k]`` on (both int64 [K]). ``mean``: every table pools the mean (else the sum).

    The same sums as :func:`pool_torch` (each bag adds its rows in the same order), without
    its per-feature slices, whose bounds a traced program must read from the data: what an
    exported program runs, one lookup for all features instead of about twenty ops per
    feature. An id outside its table fails the call (an assert in the program), as
    ``F.embedding_bag`` over that table would. Traceable by torch.export: B may be symbolic.

    Returns:
        [B, K * D], key k in columns k * D to (k + 1) * D.
    """
    K, B, D = key_rows.numel(), batch_size, weight.shape[1]
    key_of_bag = torch.arange(K, device=ids.device).repeat_interleave(B)  # [K * B]
    key_of_id = torch.repeat_interleave(key_of_bag, lengths, output_size=ids.shape[0])  # [L]
    inside = (ids >= 0) & (ids < key_rows[key_of_id])
    torch._assert_async(inside.all(), "an id outside its feature's table (ids lie in [0, rows))")
    psw = None if per_sample_weights is None else per_sample_weights.to(weight.dtype)
    out = F.embedding_bag(
        ids + key_base[key_of_id],
        weight,
        offsets,
        # ATen rejects per-sample weights with mean pooling: sum, then divide below.
        mode="mean" if mean and psw is None else "sum",
        per_sample_weights=psw,
        include_last_offset=True,
    )  # [K * B, D]
    if mean and psw is not None:
        out = out / lengths.clamp(min=1).to(out.dtype).unsqueeze(1)
    return out.view(K, B, D).transpose(0, 1).reshape(B, K * D)


# Rows reduced and updated per chunk: a chunk's temporaries (rows x dim floats each) stay
# cache-sized and are reused by the allocator, instead of whole-batch [U, D] temporaries of
# hundreds of MiB that page-fault in fresh on every step. Measured on the 2-core EPYC, 26 x 1M
# x 64 tables, batch 2048, fused fwd+bwd p50: Adam at 20 ids per bag 340 ms with 1 MiB chunks
# vs 1.2 s with 8 MiB and 3.6 s unchunked; SGD one-hot 11 vs 17 vs 26 ms. 512 KiB-2 MiB is flat.
CHUNK_BYTES = 1 << 20


def _reduced_chunks(
    plan: LookupPlan,
    tensors: PlanTensors,
    group: int,
    lookups: GroupLookups,
    grad_out: torch.Tensor,
    distinct_rows: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The group's distinct touched rows in increasing order, with their reduced gradients,
    in chunks: (group-local rows [u], gradients [u, D]). ``distinct_rows``: their number, when
    the host knows it: then one chunk, and nothing is read on the host."""
    dim = plan.layout.dims[plan.layout.groups[group][0]]
    if plan.single_group:
        grad = grad_out.view(-1, dim)  # [B*F, D]
    else:
        grad = grad_out.index_select(1, tensors.groups[group].cols).view(-1, dim)
    if distinct_rows is not None:
        rows, order, segments = padded_segments(lookups.ids)
        scale = None if lookups.scale is None else lookups.scale[order].to(grad.dtype)
        reduced = F.embedding_bag(
            lookups.bag[order],
            grad,
            segments[: distinct_rows + 1],  # the rest: empty segments past the last row
            mode="sum",
            per_sample_weights=scale,
            include_last_offset=True,
        )  # [U, D]
        yield rows[:distinct_rows], reduced
        return
    rows, order, segments = sorted_segments(lookups.ids)
    bags = lookups.bag[order]
    scale = None if lookups.scale is None else lookups.scale[order].to(grad.dtype)
    chunk = max(1, CHUNK_BYTES // (dim * grad.element_size()))
    cuts = [*range(0, rows.numel(), chunk), rows.numel()]
    starts = segments[cuts].tolist()
    for lo, hi, first, last in zip(cuts[:-1], cuts[1:], starts[:-1], starts[1:], strict=True):
        reduced = F.embedding_bag(
            bags[first:last],
            grad,
            segments[lo : hi + 1] - first,
            mode="sum",
            per_sample_weights=None if scale is None else scale[first:last],
            include_last_offset=True,
        )  # [hi - lo, D]
        yield rows[lo:hi], reduced


def _update_group(
    layout: TableLayout,
    flat: torch.Tensor,
    fused: FusedUpdate,
    group: int,
    chunks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    step: int,
    generator: torch.Generator,
) -> None:
    """Apply ``fused`` to each chunk of dim group ``group``'s touched rows."""
    states = {
        name: layout.group_rows(buffer, group)
        if fused.optimizer.states[name] == "row"
        else layout.group_view(buffer, group)
        for name, buffer in fused.states.items()
    }
    weight = layout.group_view(flat, group)  # [rows of the group, D]
    for rows, reduced in chunks:
        update_rows(fused.optimizer, weight, states, rows, reduced, step, generator, fused.keep)


def backward_torch(
    plan: LookupPlan,
    flat: torch.Tensor,
    grad_out: torch.Tensor,
    tensors: PlanTensors,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    fused: FusedUpdate | None,
    step: int,
    group_lookups: Sequence[int] | None = None,
    distinct_rows: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Backward of the torch path: per dim group, reduce each touched row's gradients.

    Args:
        plan, flat: the forward's plan and packed tables.
        grad_out: [B, total_D] upstream gradient (contiguous).
        tensors: ``plan.tensors(...)`` for the forward's KJT key order.
        values, offsets, per_sample_weights, batch_size: the forward's batch.
        fused: the optimizer to apply to the touched rows, or None.
        step: the step being applied (seeds the stochastic rounding).
        group_lookups: per dim group, its lookups, when the host knows them.
        distinct_rows: per dim group, the distinct rows its lookups touch, when the host knows
            them (without ``fused``: then no group reads anything on the host).

    Returns:
        ``(None, None)`` after applying ``fused`` in place; without it, the sorted global row
        keys [U] and their reduced gradients [U, max_dim] (for dense table gradients).
    """
    layout = plan.layout
    generator = torch.Generator(device=flat.device).manual_seed(rounding_seed(step))
    all_keys, all_reduced = [], []
    for g, features in enumerate(plan.group_features):
        if not features:
            continue
        lookups = _group_lookups(
            plan,
            tensors,
            g,
            values,
            offsets,
            per_sample_weights,
            batch_size,
            accumulate_dtype(grad_out.dtype),
            None if group_lookups is None else group_lookups[g],
        )
        known = None if fused is not None or distinct_rows is None else distinct_rows[g]
        chunks = _reduced_chunks(plan, tensors, g, lookups, grad_out, known)
        if fused is not None:
            _update_group(layout, flat, fused, g, chunks, step, generator)
            continue
        group_start = layout.row_offsets[layout.groups[g][0]]
        for rows, reduced in chunks:
            all_keys.append(rows + group_start)
            all_reduced.append(reduced)
    if fused is not None:
        return None, None
    # Groups are in row-space order, so the keys stay sorted; pad dims to the widest.
    width = layout.max_dim
    padded = [F.pad(r, (0, width - r.shape[1])) for r in all_reduced]
    if not padded:
        empty = torch.zeros(0, dtype=torch.int64, device=flat.device)
        return empty, torch.zeros(0, width, dtype=grad_out.dtype, device=flat.device)
    return torch.cat(all_keys), torch.cat(padded)


def fbgemm_forward_serves(plan: LookupPlan, flat: torch.Tensor, num_ids: int) -> bool:
    """Whether FBGEMM's CPU forward may pool a call whose backward runs elsewhere (the torch
    backend's: dense gradients, an optimizer FBGEMM has no CPU kernel for, or rows exchanged
    between ranks before the update): fp32 tables of one dim, sum pooling only, fewer than
    :data:`FBGEMM_FORWARD_MAX_IDS` ids. Its sums are then bitwise those of ATen's
    ``embedding_bag`` (``tests/ops/embedding_bag/test_embedding_bag_cpu.py``), in one call instead
    of one per feature; mean pooling is not (it divides where ATen multiplies)."""
    return (
        flat.device.type == "cpu"
        and flat.dtype == torch.float32
        and len(plan.layout.groups) == 1
        and not any(plan.table_mean)
        and num_ids < FBGEMM_FORWARD_MAX_IDS
        and _fbgemm_ops() is not None
    )


def fbgemm_unsupported(plan: LookupPlan, flat: torch.Tensor, fused: FusedUpdate | None) -> str:
    """Why FBGEMM's CPU fused backward cannot serve this call ("" when it can).

    The ``fbgemm`` backend runs FBGEMM's CPU table-batched forward and hands the fused update
    to ``torch.ops.fbgemm.split_embedding_backward_codegen_{sgd,adagrad,rowwise_adagrad}_cpu``
    (fbgemm-gpu-cpu), which reduces duplicate rows and updates them in one C++ pass.
    """
    if flat.device.type != "cpu":
        return "it runs on CPU tensors only"
    if fused is None:
        return "it only fuses an optimizer (optimizer=None takes dense gradients)"
    if fused.exchange is not None:
        return "the touched rows are exchanged between ranks before the update"
    name, decay = type(fused.optimizer).__name__, fused.optimizer.weight_decay
    if name not in ("SGD", "Adagrad", "RowWiseAdagrad"):
        return f"it has no CPU kernel for {name}"
    if decay:  # its L2 mode does not match the weight decay of recsys.embedding.optim
        return "weight decay runs on the torch path"
    if flat.dtype != torch.float32:
        return f"tables are {flat.dtype}; its CPU backward is fp32 here"
    if len(plan.layout.groups) > 1:
        return "tables of different dims (its row space must follow feature order)"
    if len(set(plan.table_mean)) > 1:
        return "it takes one pooling mode for all tables, these mix sum and mean"
    if _fbgemm_ops() is None:
        return "fbgemm_gpu does not import"
    return ""


def _fbgemm_ops():
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        return torch.ops.fbgemm
    except Exception:  # a missing or broken install means "not available"
        return None


@dataclass(frozen=True)
class FbgemmPlan:
    """A :class:`LookupPlan` as FBGEMM's CPU ops take it (built once per plan); features in
    order, each one FBGEMM "table"."""

    weights_offsets: torch.Tensor  # [F] int64: first element of each feature's table
    row_offsets: torch.Tensor  # [F] int64: first row of each feature's table
    D_offsets: torch.Tensor  # [F + 1] int32: first output column of each feature
    max_D: int
    hash_size_cumsum: torch.Tensor  # [F + 1] int64: row offsets, then the total row count
    total_hash_size_bits: int
    placements: torch.Tensor  # [F] int32: all HOST
    pooling_mode: int  # PoolingMode.MEAN (1) or SUM (0), one for all tables


def _fbgemm_plan(plan: LookupPlan) -> FbgemmPlan:
    if "fbgemm" in plan.backend_meta:
        return plan.backend_meta["fbgemm"]
    layout, tables = plan.layout, plan.feature_to_table
    num_features = len(tables)
    dims = [layout.dims[t] for t in tables]
    fbgemm_plan = FbgemmPlan(
        weights_offsets=torch.tensor([layout.elem_offsets[t] for t in tables]),
        row_offsets=torch.tensor([layout.row_offsets[t] for t in tables]),
        D_offsets=torch.tensor([0, *torch.tensor(dims).cumsum(0).tolist()], dtype=torch.int32),
        max_D=max(dims),
        hash_size_cumsum=torch.tensor(
            [*(layout.row_offsets[t] for t in tables), layout.total_rows]
        ),
        total_hash_size_bits=max(1, math.ceil(math.log2(layout.total_rows + 1))),
        placements=torch.full((num_features,), 3, dtype=torch.int32),  # HOST
        pooling_mode=1 if plan.table_mean[0] else 0,  # PoolingMode.MEAN / SUM
    )
    plan.backend_meta["fbgemm"] = fbgemm_plan
    return fbgemm_plan


# Ids per batch below which FBGEMM's forward beats one ATen embedding_bag per feature: it saves
# the per-call overhead of small batches, ATen's kernel wins on large ones (2-core EPYC, 26
# tables x 1M x 64, ms FBGEMM vs ATen: 53k ids 0.9 vs 1.6; 106k 2.2 vs 3.2; 213k 8.6 vs 5.8;
# 1.1M 30 vs 14; 1.7M (batch 65536, one-hot) 227 vs 167). The fused backward is FBGEMM's
# either way.
FBGEMM_FORWARD_MAX_IDS = 150_000


@dataclass(frozen=True)
class FbgemmBatch:
    """The batch as FBGEMM reads it: features in order, bags feature-major (f*B + b)."""

    values: torch.Tensor  # [L] int64 ids
    offsets: torch.Tensor  # [F*B + 1] int64
    indice_weights: torch.Tensor | None  # [L] fp32 per-sample weights


def fbgemm_inputs(
    plan: LookupPlan,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    feature_to_key: Sequence[int],
    batch_size: int,
    key_lengths: Sequence[int] | None = None,
) -> FbgemmBatch:
    """The KJT batch as FBGEMM reads it (see :class:`FbgemmBatch`). ``key_lengths``: the ids of
    each KJT key, when the host knows them (else a KJT whose keys are not exactly the features,
    in order, costs a host read)."""
    B, num_features = batch_size, len(plan.feature_to_table)
    if tuple(feature_to_key) != tuple(range(num_features)):
        # Gather each feature's bags from its KJT key.
        cache_key = ("fbgemm_keys", tuple(feature_to_key), offsets.device)
        keys = plan.backend_meta.get(cache_key)
        if keys is None:
            keys = torch.tensor(feature_to_key, device=offsets.device)
            plan.backend_meta[cache_key] = keys
        total = None if key_lengths is None else sum(key_lengths[k] for k in feature_to_key)
        lookups = bag_lookups(offsets, keys, B, sample_major=False, num_lookups=total)
        values, offsets = values[lookups.position], lookups.offsets
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights[lookups.position]
    elif offsets.numel() > num_features * B + 1:
        # The KJT has keys after the features read: their ids end where the last feature's do
        # (a host read, only for such inputs, when the ids per key are not known).
        offsets = offsets[: num_features * B + 1]
        end = sum(key_lengths[:num_features]) if key_lengths is not None else int(offsets[-1])
        values = values[:end]
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.float().contiguous()
    return FbgemmBatch(values.long().contiguous(), offsets.long().contiguous(), per_sample_weights)


def pool_fbgemm(plan: LookupPlan, flat: torch.Tensor, batch: FbgemmBatch) -> torch.Tensor:
    """FBGEMM's CPU forward (through its SGD lookup op, which builds no graph here: forward
    of an autograd.Function runs without grad, and the update only happens in its backward)."""
    fbgemm_plan = _fbgemm_plan(plan)
    return _fbgemm_ops().split_embedding_codegen_lookup_sgd_function_cpu(
        flat,
        fbgemm_plan.placements,
        fbgemm_plan.weights_offsets,
        fbgemm_plan.D_offsets,
        plan.total_dim,
        fbgemm_plan.max_D,
        fbgemm_plan.hash_size_cumsum,
        fbgemm_plan.total_hash_size_bits,
        batch.values,
        batch.offsets,
        fbgemm_plan.pooling_mode,
        batch.indice_weights,
        None,  # feature_requires_grad
        False,  # gradient_clipping
        0.0,  # max_gradient
        False,  # stochastic_rounding
        0.0,  # learning_rate (unused: no backward through this call)
        0,  # output dtype FP32
    )


def backward_fbgemm(
    plan: LookupPlan,
    flat: torch.Tensor,
    grad_out: torch.Tensor,
    batch: FbgemmBatch,
    fused: FusedUpdate,
) -> None:
    """Apply ``fused`` in place with FBGEMM's C++ backward for its optimizer.

    Args:
        plan, flat: the forward's plan and packed tables.
        grad_out: [B, total_D] upstream gradient.
        batch: the forward's :func:`fbgemm_inputs`.
        fused: SGD, Adagrad or RowWiseAdagrad (see :func:`fbgemm_unsupported`).
    """
    fbgemm_plan = _fbgemm_plan(plan)
    optimizer = fused.optimizer
    name = type(optimizer).__name__
    common = (
        grad_out.float().contiguous(),
        flat,
        fbgemm_plan.placements,
        fbgemm_plan.weights_offsets,
        fbgemm_plan.D_offsets,
        fbgemm_plan.max_D,
        fbgemm_plan.hash_size_cumsum,
        fbgemm_plan.total_hash_size_bits,
        batch.values,
        batch.offsets,
        fbgemm_plan.pooling_mode,
        torch.empty(0) if batch.indice_weights is None else batch.indice_weights,
        False,  # stochastic rounding: fp32 tables only
    )
    ops = _fbgemm_ops()
    if name == "SGD":
        ops.split_embedding_backward_codegen_sgd_cpu(*common, torch.full((), optimizer.lr))
        return
    state = fused.states["sum"]
    per_row = name == "RowWiseAdagrad"
    state_offsets = fbgemm_plan.row_offsets if per_row else fbgemm_plan.weights_offsets
    state_args = (state, fbgemm_plan.placements, state_offsets, torch.full((), optimizer.lr))
    if name == "Adagrad":
        ops.split_embedding_backward_codegen_adagrad_cpu(*common, *state_args, optimizer.eps)
    else:  # eps, weight_decay 0 (mode NONE), max_norm 0
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common, *state_args, optimizer.eps, 0.0, 0, 0.0
        )
