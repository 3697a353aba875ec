"""The all-to-alls of model-parallel embeddings, and quantized communication.

Two exchanges serve a sharded lookup (W ranks, rank r holds the samples of its own batch B_r):

- **input dist** (:func:`recsys.distributed.counts.all_to_all_ids`): every rank sends each rank
  the ids of the shards that rank owns, in two phases. First the counts (how many samples, how
  many ids, and whatever every rank must know before the ids move:
  :mod:`recsys.distributed.counts`, the one host read), then
  the bag lengths, ids and per-id weights in one all-to-all (:func:`send_ids`: one int64 block
  per destination), whose sizes the counts made known. A receiver gets the blocks source by
  source; :func:`source_to_slot_major` reorders them into one KeyedJaggedTensor layout (slot
  by slot, each slot's bags source by source) for the local lookup.
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


@dataclass(frozen=True)
class Counts:
    """What the counts exchange (:mod:`recsys.distributed.counts`) made known on the host.

    ``batch_sizes[s]`` samples and ``num_values[s]`` ids come from rank s, ``slot_values[s]``
    of them for each of this rank's slots (when sent); ``sent_values[d]`` ids go to rank d;
    ``extras[s]`` are the values rank s sent along (the same to every rank); ``derived`` what
    the exchange's ``derive`` computed from them. ``received`` is the exchange's device tensor
    ([W, 2 + S + E] int64: B_s, ids, the slots' ids, extras), which the receiver's index
    arithmetic reads on the device, and ``received_extras`` its last E columns."""

    batch_sizes: list[int]
    num_values: list[int]
    sent_values: list[int]
    extras: list[list[int]]
    received: torch.Tensor
    derived: list[int] = field(default_factory=list)
    slot_values: list[list[int]] = field(default_factory=list)

    @property
    def received_extras(self) -> torch.Tensor:
        return self.received[:, self.received.shape[1] - len(self.extras[0]) :]


_WIDE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _widen(weights: torch.Tensor) -> torch.Tensor:
    """Each weight's bits in an int64 word (sign-extended; :func:`_narrow` inverts it)."""
    return weights.view(_WIDE[weights.element_size()]).to(torch.int64)


def _narrow(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return words.to(_WIDE[torch.empty((), dtype=dtype).element_size()]).view(dtype)


@dataclass
class ReceivedIds:
    """What one rank received in the input dist: one int64 buffer, source after source, each
    source's block its bag lengths ([S, B_s], slot-major), its ids, then (weighted) its
    per-id weights, each weight's bits in a word of its own.

    ``batch_sizes[s]`` samples and ``num_values[s]`` ids came from rank s, for ``num_slots``
    slots; ``weight_dtype`` is the weights' dtype (None: no weights); ``counts`` the counts
    exchange's device tensor, ``extras[s]`` what rank s sent along (``extras_on_device``: on
    the device, [W, E]), ``derived`` what was derived from them and ``slot_values[s]`` rank
    s's ids per slot (see :class:`Counts`)."""

    batch_sizes: list[int]
    num_values: list[int]
    num_slots: int
    buffer: torch.Tensor
    weight_dtype: torch.dtype | None
    counts: torch.Tensor
    extras: list[list[int]] = field(default_factory=list)
    derived: list[int] = field(default_factory=list)
    slot_values: list[list[int]] = field(default_factory=list)
    extras_on_device: torch.Tensor | None = None


@dataclass
class PendingIds:
    """An input dist whose ids are still on their way (:func:`send_ids`): the counts are
    known, the bags arrive in the background; :meth:`wait` returns them."""

    received: ReceivedIds
    works: list[Any]

    def wait(self) -> ReceivedIds:
        """Block until every bag has arrived; the bags."""
        for work in self.works:
            work.wait()
        self.works = []
        return self.received


def send_ids(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
    slots_per_rank: Sequence[int],
    counts: Counts,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> PendingIds:
    """The second phase: each destination's bag lengths, ids and weights in one int64 block
    (a weight's bits in a word of their own), all blocks in one all-to-all whose sizes
    ``counts`` made known; not waited for. Arguments as :func:`all_to_all_ids`'s."""
    with stats.timed(values.device):
        rank = dist.get_rank(group)
        sent = counts.sent_values
        words = 1 if weights is None else 2
        length_blocks = lengths.long().split([s * batch_size for s in slots_per_rank])
        value_blocks = values.long().split(sent)
        weight_blocks = (None,) * len(sent) if weights is None else _widen(weights).split(sent)
        pieces = []
        for bag_lengths, ids, w in zip(length_blocks, value_blocks, weight_blocks, strict=True):
            pieces += [bag_lengths, ids] if w is None else [bag_lengths, ids, w]
        send = torch.cat(pieces)
        stats.add("input", send)
        num_slots = slots_per_rank[rank]
        send_splits = [
            s * batch_size + words * n for s, n in zip(slots_per_rank, sent, strict=True)
        ]
        recv_splits = [
            num_slots * b + words * n
            for b, n in zip(counts.batch_sizes, counts.num_values, strict=True)
        ]
        buffer, work = all_to_all(send, send_splits, recv_splits, group, async_op=True)
        dtype = None if weights is None else weights.dtype
        received = ReceivedIds(
            counts.batch_sizes,
            counts.num_values,
            num_slots,
            buffer,
            dtype,
            counts.received,
            counts.extras,
            counts.derived,
            counts.slot_values,
            counts.received_extras,
        )
        return PendingIds(received, [work])


def source_to_slot_major(
    received: ReceivedIds,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder received bags from [source][slot][sample] to [slot][source][sample]: the
    KeyedJaggedTensor layout of ``received.num_slots`` keys over a batch of sum_s B_s samples,
    source 0's samples first. Returns (lengths, values, weights). Reads nothing on the host:
    the ids' places come from the counts exchange's device tensor."""
    sizes, num_slots, buffer = received.batch_sizes, received.num_slots, received.buffer
    device, words = buffer.device, 1 if received.weight_dtype is None else 2
    total = sum(received.num_values)
    if len(sizes) == 1 or num_slots == 0 or not sum(sizes):  # the one block, as it lies
        lengths, values, weights = buffer.split(
            [num_slots * sum(sizes), total, (words - 1) * total]
        )
        return lengths, values, None if words == 1 else _narrow(weights, received.weight_dtype)
    # Bag lengths: each source's [S, B_s] block, columns side by side.
    starts, start = [], 0
    for b, n in zip(sizes, received.num_values, strict=True):
        starts.append(start)
        start += num_slots * b + words * n
    pieces = [
        torch.arange(s, s + num_slots * b, device=device).view(num_slots, b)
        for s, b in zip(starts, sizes, strict=True)
    ]
    lengths_2d = buffer[torch.cat(pieces, dim=1)]  # [S, sum_s B_s]
    lengths = lengths_2d.reshape(-1)
    # Ids: whole (source, slot) segments move; gather each segment's range in the new order.
    if len(set(sizes)) == 1:
        segment = lengths_2d.view(num_slots, len(sizes), sizes[0]).sum(dim=2)  # [S, W]
    else:
        segment = torch.stack([c.sum(dim=1) for c in lengths_2d.split(sizes, dim=1)], dim=1)
    counts = received.counts
    block = num_slots * counts[:, 0] + words * counts[:, 1]  # [W] words of each source
    first_id = block.cumsum(0) - block + num_slots * counts[:, 0]  # [W] where its ids start
    within = segment.cumsum(0) - segment  # [S, W] a segment's start among its source's ids
    segment_t = segment.reshape(-1)  # slot-major
    place = (within + first_id).reshape(-1)
    new_starts = segment_t.cumsum(0) - segment_t
    shifts = place - new_starts
    if words == 2:  # a weight lies num_values[s] words after its id
        shifts = torch.stack([shifts, shifts + counts[:, 1].repeat(num_slots)], dim=1)
    shift = torch.repeat_interleave(shifts, segment_t, dim=0, output_size=total)
    arange = torch.arange(total, device=device)
    if words == 1:
        return lengths, buffer[shift + arange], None
    index = shift + arange.view(-1, 1)
    weights = _narrow(buffer[index[:, 1]], received.weight_dtype)
    return lengths, buffer[index[:, 0]], weights


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
