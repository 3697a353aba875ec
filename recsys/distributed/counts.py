"""The counts exchange: the first phase of a sharded collection's input dist.

Before the ids travel (:func:`recsys.distributed.comm.send_ids`), every rank tells every rank
how many samples and ids it sends it, per slot, and whatever all ranks must know first (the
input check's verdict, the replicated tables' touched-row counts): one small all-to-all whose
result is read on the host (the split sizes of the ids' all-to-all), the step's one sync.

:func:`start_counts` posts it and returns without waiting; :meth:`PendingCounts.wait` reads it.
A pipelined step (``train.pipeline``) starts batch i+1's counts before step i and reads them
after step i's forward, so the exchange runs while forward(i) computes. On CUDA the exchange,
what is derived from it and its copy to pinned host memory run on a side stream ordered by
events: the read waits for that stream alone, never for the step's kernels queued before it
(no device-wide sync). :func:`exchange_counts` is both at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recsys.distributed.comm import CommStats, Counts, ReceivedIds, send_ids


@dataclass
class PendingCounts:
    """A counts exchange under way (:func:`start_counts`); :meth:`wait` reads it."""

    received: torch.Tensor  # [W, width] int64, arriving
    world: int
    width: int
    num_extras: int
    slots: int  # this rank's slots
    prepare: Callable[[], torch.Tensor] | None = None  # what the host reads, once arrived
    work: Any = None  # the collective (None once waited for)
    event: Any = None  # CUDA: the side stream's event after the copy to ``host``
    host: torch.Tensor | None = None  # CUDA: ``prepare()`` in pinned host memory
    stats: CommStats | None = None
    _counts: Counts | None = None

    def wait(self) -> Counts:
        """Block until the exchange arrived (on CUDA: until the side stream's copy did); the
        counts, read on the host. Later calls return the same counts."""
        if self._counts is not None:
            return self._counts
        device = self.received.device
        with self.stats.timed(device):
            if self.event is not None:  # CUDA: the side stream did the read's work
                self.event.synchronize()
                torch.cuda.current_stream(device).wait_event(self.event)
                known = self.host.tolist()
            else:
                self.work.wait()
                known = self.prepare().tolist()
        self.work = self.prepare = None
        world, width, num_extras = self.world, self.width, self.num_extras
        rows = [known[s * width : (s + 1) * width] for s in range(world)]
        self._counts = Counts(
            batch_sizes=[row[0] for row in rows],
            num_values=[row[1] for row in rows],
            sent_values=known[world * width : world * (width + 1)],
            extras=[row[width - num_extras :] for row in rows],
            slot_values=[row[2 : 2 + self.slots] for row in rows],
            received=self.received,
            derived=known[world * (width + 1) :],
        )
        return self._counts


def start_counts(
    batch_size: int,
    values_per_rank: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    extras: torch.Tensor | None = None,
    derive: Callable[[torch.Tensor], torch.Tensor] | None = None,
    values_per_slot: torch.Tensor | None = None,
    slots_per_rank: Sequence[int] = (),
) -> PendingCounts:
    """Post the counts exchange; not waited for. Every rank tells every rank how many samples
    and ids it sends it (``values_per_rank`` [W]; with ``values_per_slot`` [sum_d S_d],
    rank-major, also how many for each slot of rank d's ``slots_per_rank[d]``), and ``extras``
    ([E] int64, the same to every rank: what all ranks must know before the ids travel, e.g. a
    check's verdict). :meth:`PendingCounts.wait` reads what came in and what goes out together,
    and ``derive``'s int64 result, computed on the device from the received [W, E] extras.
    Collectives must be posted in the same order on every rank: so must this."""
    device = values_per_rank.device
    with stats.timed(device):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        num_extras = 0 if extras is None else extras.numel()
        slots = list(slots_per_rank) if values_per_slot is not None else [0] * world
        parts = [torch.full((world,), batch_size, device=device), values_per_rank]
        if values_per_slot is not None:
            parts.append(values_per_slot)
        if extras is not None:
            parts.append(extras)
        flat = torch.cat([p.to(torch.int64).view(-1) for p in parts])
        send = flat.index_select(0, _counts_order(world, tuple(slots), num_extras, device))
        width = 2 + slots[rank] + num_extras  # what each rank sends this one
        stats.add("input", send)
        received = send.new_empty(world * width)
        sent = values_per_rank.to(torch.int64).view(-1)

        def prepare() -> torch.Tensor:
            read = [received, sent]
            if derive is not None:
                extra = received.view(world, width)[:, width - num_extras :]
                read.append(derive(extra).to(torch.int64).view(-1))
            return torch.cat(read)

        pending = PendingCounts(
            received.view(world, width), world, width, num_extras, slots[rank], stats=stats
        )
        send_splits, recv_splits = [2 + s + num_extras for s in slots], [width] * world
        if device.type != "cuda":
            pending.work = dist.all_to_all_single(
                received, send, recv_splits, send_splits, group=group, async_op=True
            )
            pending.prepare = prepare
            return pending
        # CUDA: exchange, derive and copy to the host on a side stream, after what the current
        # stream queued for these tensors; the read waits for the side stream's event alone
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for tensor in (send, received, sent):
                tensor.record_stream(side)
            dist.all_to_all_single(received, send, recv_splits, send_splits, group=group)
            read = prepare()
            pending.host = torch.empty(read.shape, dtype=read.dtype, pin_memory=True)
            pending.host.copy_(read, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record(side)
        return pending


def exchange_counts(
    batch_size: int,
    values_per_rank: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    extras: torch.Tensor | None = None,
    derive: Callable[[torch.Tensor], torch.Tensor] | None = None,
    values_per_slot: torch.Tensor | None = None,
    slots_per_rank: Sequence[int] = (),
) -> Counts:
    """:func:`start_counts` and its :meth:`~PendingCounts.wait` at once: one small blocking
    all-to-all and the step's one host read."""
    return start_counts(
        batch_size, values_per_rank, group, stats, extras, derive, values_per_slot, slots_per_rank
    ).wait()


@functools.cache
def _side_stream(device: torch.device):
    """The side stream of ``device`` that counts exchanges run on."""
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=64)
def _counts_order(
    world: int, slots: tuple[int, ...], num_extras: int, device: torch.device
) -> torch.Tensor:
    """Where each value of the counts message comes from in [B] * W, ids per rank [W], ids
    per slot [sum_d S_d] and extras [E] back to back: per destination d its B, its ids, its
    slots' ids and the extras."""
    order, slot_start, extras_start = [], 2 * world, 2 * world + sum(slots)
    for d, num_slots in enumerate(slots):
        first = slot_start + sum(slots[:d])
        order += [d, world + d, *range(first, first + num_slots)]
        order += range(extras_start, extras_start + num_extras)
    return torch.tensor(order, dtype=torch.int64, device=device)


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
    """Two-phase all-to-all of bags, waited for: :func:`exchange_counts`, then
    :func:`send_ids` (the lengths, ids and weights in one all-to-all).

    Args:
        lengths: [sum_d S_d * B] bag lengths, destination by destination (S_d slots of B bags).
        values: ids in the same order; ``weights`` likewise, or None.
        batch_size: B, this rank's samples.
        slots_per_rank: S_d, the slots rank d looks up (the same list on every rank).
        values_per_rank: [W] int64, how many of ``values`` go to each rank.

    Returns:
        The bags every rank sent to this one.
    """
    counts = exchange_counts(batch_size, values_per_rank, group, stats)
    pending = send_ids(lengths, values, weights, batch_size, slots_per_rank, counts, group, stats)
    with stats.timed(values.device):
        return pending.wait()
