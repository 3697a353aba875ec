"""Multi-table pooled embedding lookup (embedding bag) over KeyedJaggedTensor-layout ids, with
an optional optimizer update fused into its backward.

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
ids and offsets int32 or int64.

Table-batched: the tables of one call live in one flat buffer (:class:`TableLayout`), tables of
equal dim next to each other, so one kernel launch serves all of them. Backward sorts the
batch's lookups by row (stable) and reduces each touched row's gradients in that fixed order:
the result is deterministic and duplicates are summed before any optimizer sees them. Then
either

- no optimizer: each table gets a dense gradient (any torch optimizer works), or
- a fused optimizer (:mod:`recsys.embedding.optim`): the touched rows and their optimizer
  state are updated in place inside backward; no gradient the size of a table is built.

Backends (chosen in ``recsys.ops._triton``): ``triton`` (CUDA; CPU under TRITON_INTERPRET=1)
runs ``recsys.ops.embedding_bag.triton_kernels``. ``fbgemm`` (CPU, fused SGD / Adagrad /
RowWiseAdagrad only) is FBGEMM's C++ fused backward, behind FBGEMM's forward for small
batches and the torch forward for large ones. ``torch`` runs anywhere: one ``F.embedding_bag`` per
feature over its table's view of the buffer; a backward that sorts the lookups per group of
equal-dim tables, reduces each row's gradients with ``F.embedding_bag`` over the upstream
gradient, then updates the touched rows with
:func:`recsys.ops.embedding_bag.row_update.update_rows`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

import torch

from recsys.ops._triton import accumulate_dtype, resolve_backend
from recsys.ops.embedding_bag.checks import check_on_device, validate_inputs
from recsys.ops.embedding_bag.cpu import (
    CHUNK_BYTES,
    FBGEMM_FORWARD_MAX_IDS,
    backward_fbgemm,
    backward_torch,
    fbgemm_forward_serves,
    fbgemm_inputs,
    fbgemm_unsupported,
    pool_fbgemm,
    pool_torch,
)
from recsys.ops.embedding_bag.layout import (
    FusedUpdate,
    LookupPlan,
    TableLayout,
    rounding_seed,
    stochastic_round,
)
from recsys.ops.embedding_bag.row_update import update_keyed_rows, update_rows
from recsys.ops.input_checks import check_mode

__all__ = [
    "FusedUpdate",
    "LookupPlan",
    "TableLayout",
    "check_on_device",
    "choose_backend",
    "embedding_bag",
    "embedding_bag_reference",
    "rounding_seed",
    "stochastic_round",
    "table_batched_embedding_bag",
    "update_rows",
    "validate_inputs",
]


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


def _dense_grads(
    layout: TableLayout,
    keys: torch.Tensor,
    reduced: torch.Tensor,
    needs: Sequence[bool],
    dtype: torch.dtype,
) -> list[torch.Tensor | None]:
    """Dense per-table gradients from sorted distinct global row keys and their gradients."""
    bounds = torch.tensor(
        [[r, r + n] for r, n in zip(layout.row_offsets, layout.rows, strict=True)],
        device=keys.device,
    )
    cuts = torch.searchsorted(keys, bounds.reshape(-1)).view(-1, 2).tolist()
    grads: list[torch.Tensor | None] = []
    for t, (lo, hi) in enumerate(cuts):
        if not needs[t]:
            grads.append(None)
            continue
        n, d = layout.rows[t], layout.dims[t]
        grad = torch.zeros(n, d, dtype=dtype, device=keys.device)
        grad.index_copy_(0, keys[lo:hi] - layout.row_offsets[t], reduced[lo:hi, :d].to(dtype))
        grads.append(grad)
    return grads


class _TableBatchedEmbeddingBag(torch.autograd.Function):
    """Forward pools; backward reduces per row, then fused update or dense table gradients.

    ``handles`` are the autograd inputs: the tables' weights (views of ``flat``) when they get
    gradients, or one placeholder tensor that requires grad when the update is fused. The
    backends get everything they need as arguments; only this class touches ``ctx``.
    """

    @staticmethod
    def forward(
        ctx,
        plan: LookupPlan,
        flat: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        feature_to_key: Sequence[int],
        batch_size: int,
        backend: str,
        fused: FusedUpdate | None,
        keep: torch.Tensor | None,
        key_lengths: Sequence[int] | None,
        *handles: torch.Tensor,
    ) -> torch.Tensor:
        ctx.plan, ctx.flat, ctx.fused, ctx.backend = plan, flat, fused, backend
        ctx.keep, ctx.key_lengths = keep, key_lengths
        ctx.num_lookups = _num_lookups(values, offsets, feature_to_key, batch_size, key_lengths)
        ctx.feature_to_key, ctx.batch_size = feature_to_key, batch_size
        batch = (values, offsets, per_sample_weights, feature_to_key, batch_size, key_lengths)
        if backend == "fbgemm":
            ctx.fbgemm_batch = fbgemm_inputs(plan, *batch)
            if values.numel() < FBGEMM_FORWARD_MAX_IDS:
                return pool_fbgemm(plan, flat, ctx.fbgemm_batch)
        else:
            psw = () if per_sample_weights is None else (per_sample_weights,)
            ctx.save_for_backward(values, offsets, *psw)
            if backend == "triton":
                return _pool_triton(plan, flat, *batch[:-1])
            if fbgemm_forward_serves(plan, flat, values.numel()):
                return pool_fbgemm(plan, flat, fbgemm_inputs(plan, *batch))
        return pool_torch(plan, plan.layout.table_views(flat), *batch)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        nothing = (None,) * len(ctx.needs_input_grad)
        needs = ctx.needs_input_grad[_HANDLES_START:]
        fused: FusedUpdate | None = ctx.fused
        if fused is None and not any(needs):
            return nothing
        plan, flat = ctx.plan, ctx.flat
        grad_out = grad_out.contiguous()
        step = 0 if fused is None else fused.advance()
        keep = ctx.keep
        if keep is not None and (fused is None or ctx.backend == "fbgemm"):
            # A batch that failed its "async" input check gives no gradient: a no-op update for
            # FBGEMM's SGD / Adagrad / RowWiseAdagrad (no weight decay on that path); the
            # other backends withhold the fused update themselves (``fused.keep``).
            grad_out = torch.where(keep.view(1, 1), grad_out, 0)
        if ctx.backend == "fbgemm":
            backward_fbgemm(plan, flat, grad_out, ctx.fbgemm_batch, fused)
            return nothing
        backward = backward_torch
        if ctx.backend == "triton":
            from recsys.ops.embedding_bag import triton_kernels as embedding_bag_triton

            backward = embedding_bag_triton.backward
        values, offsets, *psw = ctx.saved_tensors
        if ctx.backend == "triton":
            extra = {"num_lookups": ctx.num_lookups}
        else:
            extra = {
                "group_lookups": _group_lookups(plan, ctx.feature_to_key, ctx.key_lengths),
                "distinct_rows": None if fused is None else fused.distinct_rows,
            }
        exchange = None if fused is None else fused.exchange
        keys, reduced = backward(
            plan,
            flat,
            grad_out,
            plan.tensors(grad_out.device, ctx.feature_to_key),
            values,
            offsets,
            psw[0] if psw else None,
            ctx.batch_size,
            fused if exchange is None else None,  # exchanged first, then updated below
            step,
            **extra,
        )
        if exchange is not None:
            keys, reduced = exchange(keys, reduced[:, : plan.layout.max_dim])
            update_keyed_rows(
                plan.layout, flat, fused, keys, reduced, step, CHUNK_BYTES, fused.exchanged_rows
            )
        if fused is not None:
            return nothing
        grads = _dense_grads(plan.layout, keys, reduced, needs, flat.dtype)
        return (None,) * _HANDLES_START + tuple(grads)


def _num_lookups(
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    batch_size: int,
    key_lengths: Sequence[int] | None = None,
) -> int | None:
    """How many ids the features read, when the host knows it: from ``key_lengths`` (the ids
    of each KJT key), or every key of the input read by exactly one feature (the usual KJT)
    reads all of them. None otherwise."""
    if key_lengths is not None:
        return sum(key_lengths[k] for k in feature_to_key)
    num_keys = (offsets.numel() - 1) // batch_size if batch_size > 0 else -1
    return values.numel() if sorted(feature_to_key) == list(range(num_keys)) else None


def _group_lookups(
    plan: LookupPlan, feature_to_key: Sequence[int], key_lengths: Sequence[int] | None
) -> list[int] | None:
    """Per dim group, the lookups of its features, when the host knows the ids per key."""
    if key_lengths is None:
        return None
    return [sum(key_lengths[feature_to_key[f]] for f in group) for group in plan.group_features]


def _handles_start(forward: Callable[..., torch.Tensor]) -> int:
    """Index of ``*handles`` among the inputs of ``forward`` (``ctx`` excluded): the
    ``ctx.needs_input_grad`` entries from there on are the handles'."""
    inputs = list(inspect.signature(forward).parameters.values())[1:]
    return next(i for i, p in enumerate(inputs) if p.kind is inspect.Parameter.VAR_POSITIONAL)


_HANDLES_START = _handles_start(_TableBatchedEmbeddingBag.forward)


def _pool_triton(
    plan: LookupPlan,
    flat: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    feature_to_key: Sequence[int],
    batch_size: int,
) -> torch.Tensor:
    """Forward of the Triton path: [B, total_D] pooled, in the tables' accumulate dtype."""
    from recsys.ops.embedding_bag import triton_kernels as embedding_bag_triton

    num_features = len(plan.feature_to_table)
    out = torch.empty(
        batch_size, plan.total_dim, dtype=accumulate_dtype(flat.dtype), device=flat.device
    )
    embedding_bag_triton.pool(
        values,
        offsets,
        per_sample_weights,
        flat,
        out,
        plan.tensors(values.device, feature_to_key),
        batch_size,
        num_features,
        plan.layout.max_dim,
        embedding_bag_triton.lookup_block(values, num_features * batch_size),
    )
    return out


def choose_backend(
    backend: str, plan: LookupPlan, flat: torch.Tensor, fused: FusedUpdate | None
) -> str:
    """The backend that serves a call: ``"triton"``, ``"fbgemm"`` or ``"torch"`` (the rules
    are in ``recsys.ops._triton``). Raises ``ValueError`` for one that cannot run it."""
    backend = resolve_backend(
        backend,
        flat.device,
        op="embedding_bag",
        has_triton=True,
        cpu_paths={"fbgemm": fbgemm_unsupported(plan, flat, fused)},
    )
    return backend


def table_batched_embedding_bag(
    plan: LookupPlan,
    flat: torch.Tensor,
    handles: Sequence[torch.Tensor],
    values: torch.Tensor,
    offsets: torch.Tensor,
    feature_to_key: Sequence[int],
    batch_size: int,
    per_sample_weights: torch.Tensor | None = None,
    *,
    fused: FusedUpdate | None = None,
    backend: str = "auto",
    validate: bool | str = True,
    feature_names: Sequence[str] | None = None,
    keep: torch.Tensor | None = None,
    key_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pooled lookup of every feature over tables packed in ``flat`` (see :class:`TableLayout`).

    Args:
        plan: layout, feature -> table map and poolings (:class:`LookupPlan`).
        flat: the packed tables, one dtype.
        handles: the autograd inputs. Without ``fused``: each table's weight (views of
            ``flat``), which receive dense gradients. With ``fused``: one tensor that requires
            grad, so backward runs and applies the update.
        values, offsets: KJT ids and offsets ([K*B + 1]).
        feature_to_key: for each feature, the KJT key it reads.
        batch_size: B.
        per_sample_weights: optional [L] weight of each id.
        fused: apply this optimizer inside backward instead of returning gradients.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``recsys.ops._triton``).
        validate: check ids, offsets and weights first: ``True`` / ``"sync"`` (raise now, one
            host sync), ``"async"`` (on the device, raised at the next
            ``INPUT_ERRORS.raise_first()``, the batch's fused update withheld; see
            :mod:`recsys.ops.input_checks`), ``False`` / ``"off"``.
        feature_names: names used in validation errors.
        keep: a device bool from an ``"async"`` check the caller ran itself (with ``validate``
            off): where False, the batch gives no gradient and no fused update.
        key_lengths: the ids of each KJT key, when the host knows them (the KJT's
            ``length_per_key``): the torch backend then reads no sizes from the device.

    Returns:
        [B, total_D] pooled embeddings; fp32 (fp64 for fp64 tables).
    """
    mode = check_mode(validate)
    if keep is not None and fused is not None:
        fused = dataclasses.replace(fused, keep=keep)
    if mode == "async":
        checked = check_on_device(
            plan, values, offsets, feature_to_key, batch_size, per_sample_weights, feature_names
        )
        values, offsets, keep = checked.values, checked.offsets, checked.ok
        if fused is not None:
            fused = dataclasses.replace(fused, keep=checked.ok)
    if mode == "sync":
        validate_inputs(
            plan.layout.rows,
            values,
            offsets,
            feature_to_key,
            plan.feature_to_table,
            ["mean" if m else "sum" for m in plan.table_mean],
            batch_size,
            per_sample_weights,
            feature_names,
        )
    backend = choose_backend(backend, plan, flat, fused)
    return _TableBatchedEmbeddingBag.apply(
        plan,
        flat,
        values,
        offsets,
        per_sample_weights,
        tuple(feature_to_key),
        batch_size,
        backend,
        fused,
        keep,
        None if key_lengths is None else tuple(key_lengths),
        *handles,
    )


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
    """Pooled lookup of F features over T separate tables in one call.

    The functional form: it packs the tables into one buffer on every call (a copy), and
    gradients flow back to ``weights`` as dense tensors. ``recsys.EmbeddingBagCollection``
    keeps its tables packed and can fuse the optimizer; use it for training.

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
    _check_tables(weights)
    layout = TableLayout.build([w.shape[0] for w in weights], [w.shape[1] for w in weights])
    plan = LookupPlan(layout, feature_to_table, table_pooling)
    return table_batched_embedding_bag(
        plan,
        layout.pack(weights),
        weights,
        values,
        offsets,
        feature_to_key,
        batch_size,
        per_sample_weights,
        backend=backend,
        validate=validate,
        feature_names=feature_names,
    )


def _check_tables(weights: Sequence[torch.Tensor]) -> None:
    """The tables of one call are 2-D and share one dtype."""
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise ValueError(f"all tables must share one dtype, got {sorted(map(str, dtypes))}")
    if any(w.dim() != 2 for w in weights):
        raise ValueError(f"tables must be 2-D, got shapes {[tuple(w.shape) for w in weights]}")
