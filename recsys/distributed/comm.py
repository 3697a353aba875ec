"""The all-to-alls of model-parallel embeddings, and quantized communication.

Two exchanges serve a sharded lookup (W ranks, rank r holds the samples of its own batch B_r):

- **input dist** (:func:`all_to_all_ids`): every rank sends each rank the ids of the shards that
  rank owns, in two phases. First the counts (how many samples, how many ids), then the bag
  lengths, ids and per-id weights, whose sizes the counts made known. A receiver gets the
  blocks source by source; :func:`source_to_slot_major` reorders them into one
  KeyedJaggedTensor layout (slot by slot, each slot's bags source by source) for the local
  lookup.
- **output dist** (:func:`pooled_all_to_all`): the pooled vectors computed for the samples of
  rank s go back to rank s; its backward sends the gradients the other way. This is where
  quantization applies.

Quantized communication (:data:`PRECISIONS`): ``fp32`` (exact), ``fp16`` / ``bf16`` (a cast;
relative error <= 2**-11 / 2**-8 per element; for fp16 only in its normal range
[2**-14, 65504]: smaller values have absolute error <= 2**-25), ``int8`` (per row:
``scale = max|x| / 127``, ``q = round(x / scale)``; the fp32 scale travels in 4 extra bytes of
the row; absolute error <= ``max|row| / 254`` per element). A row is one sample's pooled
vectors for one destination. Decoded values are fp32.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from recsys.distributed.assembly import PooledAssembly, ScratchBuffers
from recsys.distributed.timeline import DeviceTimeline, device_timeline

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class CommStats:
    """Bytes this rank handed to collectives since the last :meth:`reset` (its own block
    included): ``input`` (counts, lengths, ids, weights), ``forward`` (pooled vectors),
    ``backward`` (their gradients, and the replicated tables' gradient all-reduce); and
    ``seconds`` spent in them.

    On CPU ``seconds`` is host wall time, counted when a timed block ends. On CUDA a block's
    start and end are CUDA events on the current stream (nothing waits for the device): they
    go on the device's :class:`~recsys.distributed.timeline.DeviceTimeline` (``timeline``; None:
    the process's one for the device), which adds the time between them to ``seconds`` once the
    device has run the block, at the latest when the timeline is flushed (a log event)."""

    bytes: dict[str, int] = field(default_factory=lambda: {"input": 0, "forward": 0, "backward": 0})
    seconds: float = 0.0
    timeline: DeviceTimeline | None = field(default=None, repr=False, compare=False)

    def add(self, kind: str, *tensors: torch.Tensor) -> None:
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)

    @contextlib.contextmanager
    def timed(self, device: torch.device) -> Iterator[None]:
        """Count the time of the block in :attr:`seconds` (see the class)."""
        if device.type != "cuda":
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds += time.perf_counter() - start
            return
        timeline = self.timeline or device_timeline(device)
        timeline.begin(self)
        try:
            yield
        finally:
            timeline.end(self)

    def reset(self) -> None:
        for kind in self.bytes:
            self.bytes[kind] = 0
        self.seconds = 0.0


def check_precision(precision: str, what: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{what} = {precision!r}; expected one of {', '.join(PRECISIONS)}")
    return precision


# ---------------------------------------------------------------------------------------------
# Codecs: blocks of [rows, width] fp32 values <-> what travels


def encode(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` [R, C] (fp32) -> the [R, C'] tensor sent for it (C' = C + 4 int8 bytes for int8)."""
    if precision == "fp32":
        return x
    if precision in _CASTS:
        return x.to(_CASTS[precision])
    if x.numel() == 0:  # no rows, or no columns (a rank holding no table): nothing to scale
        return x.new_zeros(x.shape[0], x.shape[1] + 4, dtype=torch.int8)
    # max |x| without an |x| tensor; amax and amin apart: torch's CPU aminmax over rows runs
    # ~6x slower than the two reductions together.
    low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scale = torch.maximum(high, -low).abs_() / 127.0  # [R, 1]; abs_: +0 for a row of zeros
    q = torch.div(x, torch.where(scale > 0, scale, 1.0)).round_()
    out = torch.empty(x.shape[0], x.shape[1] + 4, dtype=torch.int8, device=x.device)
    out[:, :-4].copy_(q)
    out[:, -4:].copy_(scale.view(torch.int8))  # the fp32 scale as its 4 bytes
    return out


def decode(y: torch.Tensor, precision: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`encode`: [R, C'] received -> [R, C] fp32 (written into ``out``
    when given)."""
    if precision == "fp32":
        return y if out is None else out.copy_(y)
    if precision in _CASTS:
        return y.float() if out is None else out.copy_(y)
    # A copy: one row's 4 scale bytes may start at an offset not divisible by 4.
    scale = y[:, -4:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # [R, 1]
    # The int8 values to fp32 first, then an in-place product: the same values as a mixed
    # int8 x fp32 mul, which converts through a temporary and runs ~2x slower on CPU.
    if out is None:
        out = torch.empty(y.shape[0], y.shape[1] - 4, dtype=torch.float32, device=y.device)
    return out.copy_(y[:, :-4]).mul_(scale)


def wire_width(width: int, precision: str) -> int:
    """Elements per row on the wire for a row of ``width`` values."""
    return width + 4 if precision == "int8" else width


def wire_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "int8": torch.int8}.get(precision) or _CASTS[precision]


# ---------------------------------------------------------------------------------------------
# Input dist


def all_to_all(
    send: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None,
    async_op: bool = False,
):
    """All-to-all of a 1-D tensor: ``send_splits[d]`` elements to rank d, ``recv_splits[s]``
    from rank s. Returns the received tensor (and the work handle with ``async_op``)."""
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(
        recv, send, list(recv_splits), list(send_splits), group=group, async_op=async_op
    )
    return (recv, work) if async_op else recv


@dataclass
class ReceivedIds:
    """What one rank received in the input dist, source by source.

    ``batch_sizes[s]`` samples came from rank s, with ``lengths`` [sum_s S * B_s] (source s's
    block is [S, B_s], slot-major), ``values`` and optional ``weights`` (source-major)."""

    batch_sizes: list[int]
    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None


@dataclass
class PendingIds:
    """An input dist whose ids are still on their way (:func:`start_all_to_all_ids`): the
    counts are known, the bags arrive in the background; :meth:`wait` returns them."""

    received: ReceivedIds
    works: list[Any]

    def wait(self) -> ReceivedIds:
        """Block until every bag has arrived; the bags."""
        for work in self.works:
            work.wait()
        self.works = []
        return self.received


def all_to_all_ids(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
    slots_per_rank: Sequence[int],
    values_per_rank: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> ReceivedIds:
    """Two-phase all-to-all of bags, waited for: :func:`start_all_to_all_ids` then
    :meth:`PendingIds.wait` (same arguments)."""
    pending = start_all_to_all_ids(
        lengths, values, weights, batch_size, slots_per_rank, values_per_rank, group, stats
    )
    with stats.timed(values.device):
        return pending.wait()


def start_all_to_all_ids(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
    slots_per_rank: Sequence[int],
    values_per_rank: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> PendingIds:
    """Two-phase all-to-all of bags: the counts are exchanged now (a small blocking
    all-to-all), the lengths, ids and weights are sent without waiting for them.

    Args:
        lengths: [sum_d S_d * B] bag lengths, destination by destination (S_d slots of B bags).
        values: ids in the same order; ``weights`` likewise, or None.
        batch_size: B, this rank's samples.
        slots_per_rank: S_d, the slots rank d looks up (the same list on every rank).
        values_per_rank: [W] int64, how many of ``values`` go to each rank.

    Returns:
        The bags every rank is sending to this one, once waited for.
    """
    with stats.timed(values.device):
        world, rank = len(slots_per_rank), dist.get_rank(group)
        counts = torch.stack([torch.full_like(values_per_rank, batch_size), values_per_rank], dim=1)
        counts = counts.to(torch.int64).reshape(-1)  # [W * 2]: (B, num values) per destination
        stats.add("input", counts)
        received = all_to_all(counts, [2] * world, [2] * world, group)
        # The step's one read of the device: what comes in and what goes out, together.
        known = torch.cat([received, values_per_rank.to(torch.int64)]).tolist()
        batch_sizes, num_values = known[0 : 2 * world : 2], known[1 : 2 * world : 2]
        sent_values = known[2 * world :]
        stats.add("input", lengths, values, *(() if weights is None else (weights,)))
        works = []
        recv_lengths, work = all_to_all(
            lengths,
            [s * batch_size for s in slots_per_rank],
            [slots_per_rank[rank] * b for b in batch_sizes],
            group,
            async_op=True,
        )
        works.append(work)
        recv_values, work = all_to_all(values, sent_values, num_values, group, async_op=True)
        works.append(work)
        recv_weights = None
        if weights is not None:
            recv_weights, work = all_to_all(weights, sent_values, num_values, group, async_op=True)
            works.append(work)
        return PendingIds(ReceivedIds(batch_sizes, recv_lengths, recv_values, recv_weights), works)


def source_to_slot_major(
    received: ReceivedIds, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder received bags from [source][slot][sample] to [slot][source][sample]: the
    KeyedJaggedTensor layout of ``num_slots`` keys over a batch of sum_s B_s samples, source
    0's samples first. Returns (lengths, values, weights)."""
    sizes = received.batch_sizes
    device = received.lengths.device
    if len(sizes) == 1 or num_slots <= 1:
        return received.lengths, received.values, received.weights
    # Bag lengths: a fixed permutation of positions.
    bases = [num_slots * sum(sizes[:s]) for s in range(len(sizes))]
    pieces = [
        base + torch.arange(num_slots * b, device=device).view(num_slots, b)
        for base, b in zip(bases, sizes, strict=True)
    ]
    lengths = received.lengths[torch.cat(pieces, dim=1).reshape(-1)]
    # Ids: whole (source, slot) segments move; gather each segment's range in the new order.
    segment = torch.stack(
        [
            block.view(num_slots, b).sum(dim=1)
            for block, b in zip(
                received.lengths.split([num_slots * b for b in sizes]), sizes, strict=True
            )
        ]
    )  # [W, S] ids per (source, slot)
    starts = (segment.reshape(-1).cumsum(0) - segment.reshape(-1)).view_as(segment)
    segment_t, starts_t = segment.t().reshape(-1), starts.t().reshape(-1)  # slot-major
    new_starts = segment_t.cumsum(0) - segment_t
    shift = torch.repeat_interleave(
        starts_t - new_starts, segment_t, output_size=received.values.numel()
    )
    index = shift + torch.arange(shift.numel(), device=device)
    weights = None if received.weights is None else received.weights[index]
    return lengths, received.values[index], weights


# ---------------------------------------------------------------------------------------------
# Output dist


@dataclass
class PooledLayout:
    """Shapes of one output dist: this rank computed [sum_s B_s, ``local_width``] pooled rows
    (``batch_sizes[s]`` of them for rank s) and receives [B_r, ``widths[d]``] from each rank d;
    ``assembly`` puts the received columns in the model's order (None: rank d's columns after
    rank d-1's)."""

    batch_sizes: list[int]
    local_width: int
    widths: list[int]
    forward: str = "fp32"
    backward: str = "fp32"
    grad_scale: float = 1.0
    assembly: PooledAssembly | None = None


@functools.lru_cache(maxsize=16)
def _exchange_order(widths: tuple[int, ...], device: torch.device) -> PooledAssembly:
    return PooledAssembly.exchange_order(list(widths), device)


def _wire(
    flat: torch.Tensor,
    shapes: Sequence[tuple[int, int]],
    precision: str,
    scratch: ScratchBuffers,
    kind: str,
) -> torch.Tensor:
    """Blocks of [rows, width] fp32 values back to back in ``flat`` -> what travels."""
    if precision == "fp32":
        return flat
    if precision in _CASTS:  # elementwise: every block at once
        wire = scratch.take(f"{kind} send", flat.numel(), _CASTS[precision], flat.device)
        return wire.copy_(flat)
    width = _one_width(shapes)
    if width is not None:  # one [rows, width] matrix: encoded at once, rows as they lie
        return encode(flat.view(-1, width), precision).reshape(-1)
    blocks = flat.split([rows * width for rows, width in shapes])
    return torch.cat(
        [
            encode(block.view(rows, width), precision).reshape(-1)
            for block, (rows, width) in zip(blocks, shapes, strict=True)
        ]
    )


def _one_width(shapes: Sequence[tuple[int, int]]) -> int | None:
    """The width every block with rows has, if they agree (and there is one)."""
    widths = {width for rows, width in shapes if rows}
    return widths.pop() if len(widths) == 1 else None


def _exchange(
    flat: torch.Tensor,
    send_shapes: Sequence[tuple[int, int]],
    recv_shapes: Sequence[tuple[int, int]],
    precision: str,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    kind: str,
    scratch: ScratchBuffers,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Send block d of ``flat`` ([rows, width] of ``send_shapes[d]``, fp32, back to back) to
    rank d; receive a block of ``recv_shapes[s]`` from each rank s, through the codec of
    ``precision``, into ``out`` (1-D fp32; None: a scratch buffer). Returns the received
    blocks, back to back. At fp32 nothing is copied: ``flat`` is sent and ``out`` received
    into as they are."""
    send = _wire(flat, send_shapes, precision, scratch, kind)
    stats.add(kind, send)
    send_splits = [rows * wire_width(width, precision) for rows, width in send_shapes]
    recv_splits = [rows * wire_width(width, precision) for rows, width in recv_shapes]
    if out is None:
        received = sum(rows * width for rows, width in recv_shapes)
        out = scratch.take(f"{kind} received", received, torch.float32, flat.device)
    recv = out
    if precision != "fp32":
        recv = scratch.take(f"{kind} wire", sum(recv_splits), send.dtype, send.device)
    with stats.timed(send.device):
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    if precision in _CASTS:
        out.copy_(recv)
    elif precision == "int8":
        width = _one_width(recv_shapes)
        if width is not None:  # one [rows, width] matrix: decoded at once
            decode(recv.view(-1, width + 4), precision, out=out.view(-1, width))
            return out
        pieces = recv.split(recv_splits)
        targets = out.split([rows * width for rows, width in recv_shapes])
        for piece, target, (rows, width) in zip(pieces, targets, recv_shapes, strict=True):
            wire = piece.view(rows, wire_width(width, precision))
            decode(wire, precision, out=target.view(rows, width))
    return out


class _PooledAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, group, stats, anchor, lengths, pooled, pooled_dp):
        rank_batch = layout.batch_sizes[dist.get_rank(group)]
        assembly = layout.assembly or _exchange_order(tuple(layout.widths), pooled.device)
        index = assembly.index(rank_batch)
        pool = assembly.new_pool(index, pooled.device)
        send_shapes = [(b, layout.local_width) for b in layout.batch_sizes]
        recv_shapes = [(rank_batch, width) for width in layout.widths]
        received = pool.view(-1)[: rank_batch * sum(layout.widths)]
        flat = pooled.float().reshape(-1)  # the lookup's rows: rank s's block after s-1's
        _exchange(
            flat,
            send_shapes,
            recv_shapes,
            layout.forward,
            group,
            stats,
            "forward",
            assembly.scratch,
            out=received,
        )
        scale = None if lengths is None else assembly.mean_scale(lengths, rank_batch)
        dp = None if pooled_dp is None else pooled_dp.float()
        ctx.layout, ctx.group, ctx.stats = layout, group, stats
        ctx.assembly, ctx.index, ctx.scale = assembly, index, scale
        return assembly.forward(pool, dp, scale, index)  # [B_r, N]

    @staticmethod
    def backward(ctx, grad):
        layout, assembly, index = ctx.layout, ctx.assembly, ctx.index
        send = assembly.backward(grad, ctx.scale, layout.grad_scale, index)
        send_shapes = [(index.batch, width) for width in layout.widths]
        recv_shapes = [(b, layout.local_width) for b in layout.batch_sizes]
        received = _exchange(
            send,
            send_shapes,
            recv_shapes,
            layout.backward,
            ctx.group,
            ctx.stats,
            "backward",
            assembly.scratch,
        )
        grad_pooled = received.view(sum(layout.batch_sizes), layout.local_width)
        grad_dp = assembly.dp_grad(grad, index) if ctx.needs_input_grad[6] else None
        return None, None, None, None, None, grad_pooled, grad_dp


def pooled_all_to_all(
    pooled: torch.Tensor,
    layout: PooledLayout,
    anchor: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    pooled_dp: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Send each rank's rows of ``pooled`` [sum_s B_s, local_width] back to it; returns
    [B_r, N]: with ``layout.assembly`` the model's columns (row-wise partial sums added,
    ``pooled_dp`` [B_r, N_dp] the replicated tables' columns, ``lengths`` [F, B_r] the bag
    lengths for mean pooling), else [B_r, sum_d widths[d]], rank d's columns after rank d-1's.

    Differentiable: backward sends the gradient the other way, multiplied by
    ``layout.grad_scale``. ``anchor`` is a scalar that requires grad, so the backward (a
    collective) runs on every rank even where ``pooled`` needs no gradient.
    """
    return _PooledAllToAll.apply(layout, group, stats, anchor, lengths, pooled, pooled_dp)
