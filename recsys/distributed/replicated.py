"""DATA_PARALLEL tables of a sharded collection: every rank holds them whole and looks up its own
batch with no communication.

Trained by a torch optimizer, their gradients are averaged by DDP like the dense layers'. With
a fused optimizer, the tables are one packed collection whose backward reduces this rank's
gradient per touched row (no gradient the size of a table) and hands the rows to
:meth:`ReplicatedTables.exchange`: one all-gather of every rank's touched rows and their
gradients (after one of their counts), summed per row in rank order and divided by the world
size; then every rank applies the same update to the same rows, one
:func:`recsys.ops.embedding_bag.row_update.update_rows` per dim group (the torch backend's own), so
the replicas stay equal. Where the sharded collection exchanges ids, each rank counts the distinct
rows its batch touches before the input dist (:meth:`ReplicatedTables.count_rows`, on the
device) and the counts travel with the input dist's (one host read for both): the backward's
reduction and the all-gather then read no size on the host (:class:`TouchedRows`).
On 2 ranks the result is bitwise that of summing dense gradients with an all-reduce (a + b
either way; only a row whose two gradients are both -0.0 gets +0.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.distributed.comm import CommStats, ReceivedIds
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import FusedOptimizer
from recsys.ops.embedding_bag.layout import TableLayout, sorted_segments

# Replicated tables of at most this many rows send which rows they touch as a bitmap with the
# input dist's counts (rows / 8 bytes per destination), so the union is known before backward.
MAX_MARKED_ROWS = 1 << 22
BITMAP_WORD_BITS = 63  # bits per int64 word of the touched-rows bitmap (the sign bit unused)


def counted_rows_width(num_rows: int, num_groups: int) -> int:
    """The int64 values :meth:`ReplicatedTables.count_rows` adds to each destination's counts
    for replicated tables of ``num_rows`` rows in ``num_groups`` dim groups: a count per group,
    then the bitmap's words (tables of at most :data:`MAX_MARKED_ROWS` rows)."""
    words = -(-num_rows // BITMAP_WORD_BITS) if num_rows <= MAX_MARKED_ROWS else 0
    return num_groups + words


@dataclass(frozen=True)
class TouchedRows:
    """The distinct rows one batch touches, known on the host: ``mine`` per dim group of the
    packed tables on this rank, ``per_rank[r]`` in all on rank r."""

    mine: list[int]
    per_rank: list[int]
    union: list[int] | None = None  # per dim group, the rows some rank touches
    marks: torch.Tensor | None = None  # [W, M] every rank's touched rows (see count_rows)


class ReplicatedTables(nn.Module):
    """The replicated tables of one sharded collection on one rank.

    Args:
        configs: the replicated tables.
        source: the unsharded collection to copy weights and optimizer state from; None to
            initialize with each table's ``init_fn`` (the group's first rank's values are
            broadcast either way, so replicas start equal).
        optimizer: the collection's fused optimizer, or None.
        is_weighted / backend: as the collection's.
        process_group: the sharded collection's group.
        comm_stats: where the exchange's bytes are counted.
        device: this rank's device.
        features: the sharded collection's features, in its order (what
            :meth:`count_rows` reads).
    """

    def __init__(
        self,
        configs: list[EmbeddingBagConfig],
        source: EmbeddingBagCollection | None,
        optimizer: FusedOptimizer | None,
        *,
        is_weighted: bool,
        backend: str,
        process_group: dist.ProcessGroup | None,
        comm_stats: CommStats,
        device: torch.device,
        features: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.configs = configs
        self.optimizer = optimizer
        self.process_group = process_group
        self.comm_stats = comm_stats
        self.tables = EmbeddingBagCollection(
            configs,
            is_weighted=is_weighted,
            device=device,
            backend=backend,
            validate=False,
            optimizer=optimizer,
        )
        with torch.no_grad():
            for c in configs:
                if source is not None:
                    self.weight(c.name).copy_(source.embedding_bags[c.name].weight)
                for name, state in self.optimizer_state(c.name).items():
                    if source is not None:
                        state.copy_(source.embedding_bags[c.name].get_buffer(name))
            if optimizer is not None and source is not None:
                self.tables.optimizer_step.copy_(source.optimizer_step)
        first = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        for table in self.tables.embedding_bags.values():
            dist.broadcast(table.weight.data, src=first, group=process_group)
        if optimizer is not None:
            self.tables.exchange = self.exchange
        layout = TableLayout.build(
            [c.num_embeddings for c in configs], [c.embedding_dim for c in configs]
        )
        first_row = {
            f: layout.row_offsets[t] for t, c in enumerate(configs) for f in c.feature_names
        }
        self._rows = layout.total_rows
        self._feature_row = torch.tensor(
            [first_row.get(f, self._rows) for f in features], dtype=torch.int64, device=device
        )  # a feature of no replicated table: the spare row past the last
        group_ends = [
            layout.row_offsets[tables[0]] + sum(layout.rows[t] for t in tables)
            for tables in layout.groups
        ]
        self._group_last = torch.tensor(group_ends, dtype=torch.int64, device=device) - 1
        self._groups = len(group_ends)
        self._marked = self._rows <= MAX_MARKED_ROWS
        self._bits = torch.arange(BITMAP_WORD_BITS, dtype=torch.int64, device=device)
        self._touched: TouchedRows | None = None  # the rows of the batch in training

    @property
    def step(self) -> torch.Tensor:
        """The fused optimizer's step counter (a zero without one)."""
        if self.optimizer is None:
            return torch.zeros((), dtype=torch.int64)
        return self.tables.optimizer_step

    def weight(self, table: str) -> nn.Parameter:
        """The whole table ``table`` [num_embeddings, embedding_dim]."""
        return self.tables.embedding_bags[table].weight

    def optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The fused optimizer's state of ``table`` by name (empty without one)."""
        if self.optimizer is None:
            return {}
        bag = self.tables.embedding_bags[table]
        return {name: bag.get_buffer(name) for name in self.optimizer.states}

    @property
    def counts_rows(self) -> bool:
        """Whether the backward exchanges touched rows (a fused optimizer), whose counts
        :meth:`count_rows` can give ahead."""
        return self.optimizer is not None

    def count_rows(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """What this rank sends with the input dist's counts: per dim group, the distinct rows
        of the replicated tables its batch touches ([G] int64), then (tables of at most
        :data:`MAX_MARKED_ROWS` rows) those rows as a bitmap of int64 words, so every rank
        knows the union (:meth:`union_rows`). On the device, no sync. ``values`` [L] and
        ``lengths`` [F, B]: the sharded collection's batch, features in its order (ids within
        their tables)."""
        per_feature = lengths.sum(dim=1)
        first = torch.repeat_interleave(self._feature_row, per_feature, output_size=values.numel())
        rows = torch.where(first < self._rows, first + values, self._rows).clamp_(0, self._rows)
        touched = torch.zeros(self._rows + 1, dtype=torch.int64, device=values.device)
        touched.index_fill_(0, rows, 1)
        upto = touched.cumsum(0).index_select(0, self._group_last)  # touched up to a group's end
        counts = upto.diff(prepend=upto.new_zeros(1))
        if not self._marked:
            return counts
        bits = F.pad(touched[: self._rows], (0, -self._rows % BITMAP_WORD_BITS)).view(
            -1, BITMAP_WORD_BITS
        )
        return torch.cat([counts, (bits << self._bits).sum(dim=1)])

    def union_rows(self, extras: torch.Tensor) -> torch.Tensor:
        """From every rank's :meth:`count_rows` ([W, G + M]), per dim group the rows some rank
        touches ([G] int64; empty without bitmaps)."""
        if not self._marked:
            return extras.new_zeros(0)
        union = self._union(extras[:, self._groups :])
        upto = union.cumsum(0).index_select(0, self._group_last)
        return upto.diff(prepend=upto.new_zeros(1))

    def touched_rows(self, received: ReceivedIds, skip: int, rank: int) -> TouchedRows:
        """The :class:`TouchedRows` of a batch from the input dist's counts: every rank's
        :meth:`count_rows` (after its first ``skip`` extras) and :meth:`union_rows`."""
        per_group = [list(e[skip : skip + self._groups]) for e in received.extras]
        union = list(received.derived) if self._marked else None
        marks = received.extras_on_device[:, skip + self._groups :] if self._marked else None
        return TouchedRows(per_group[rank], [sum(g) for g in per_group], union, marks)

    def _union(self, words: torch.Tensor) -> torch.Tensor:
        """[W, M] bitmaps -> [rows] int64, 1 where some rank's bit is set."""
        bits = (words.unsqueeze(2) >> self._bits) & 1  # [W, M, 63]
        return bits.amax(dim=0).view(-1)[: self._rows]

    def forward(
        self, features: KeyedJaggedTensor, touched: TouchedRows | None = None
    ) -> torch.Tensor:
        """The replicated tables' pooled vectors of this rank's samples: [B, D_dp].
        ``touched``: the rows this batch touches, when known (see :meth:`count_rows`)."""
        self._touched = touched
        if touched is None:
            return self.tables.pooled_values(features)
        return self.tables.pooled_values(
            features, distinct_rows=touched.mine, exchanged_rows=touched.union
        )

    def exchange(
        self, keys: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's touched rows and their gradients, averaged over ranks.

        Args:
            keys: [U] this rank's sorted distinct touched rows (the packed tables' row space).
            grads: [U, D] their gradients, reduced over this rank's batch.

        Returns:
            the union's sorted rows [U'] and their gradients summed over ranks in rank order,
            divided by the world size [U', D]; the same on every rank. The ranks' row
            counts size the all-gather: known from the forward (:class:`TouchedRows`), else
            gathered and read on the host first.
        """
        group, device = self.process_group, keys.device
        world = dist.get_world_size(group)
        touched, self._touched = self._touched, None
        sizes = None if touched is None else touched.per_rank
        if sizes is None:
            count = torch.full((1,), keys.numel(), dtype=torch.int64, device=device)
            counts = torch.empty(world, dtype=torch.int64, device=device)
            self.comm_stats.add("backward", count)
            with self.comm_stats.timed(device):
                dist.all_gather_single(counts, count, group=group)
            sizes = counts.tolist()
        most, width = max(sizes), grads.shape[1]
        # One message: the gradients, then each key's 8 bytes as gradient-dtype columns.
        key_cols = 8 // grads.element_size()
        packed = torch.zeros(most, width + key_cols, dtype=grads.dtype, device=device)
        packed[: keys.numel(), :width] = grads
        packed[: keys.numel(), width:] = keys.view(grads.dtype).view(-1, key_cols)
        gathered = torch.empty(world * most, width + key_cols, dtype=grads.dtype, device=device)
        if most:
            self.comm_stats.add("backward", packed)
            with self.comm_stats.timed(device):
                dist.all_gather_single(gathered, packed, group=group)
        ranks = gathered.view(world, most, -1)
        rows = torch.cat([ranks[r, :n] for r, n in enumerate(sizes)])  # [sum U_r, D + key]
        every_key = rows[:, width:].contiguous().view(torch.int64).view(-1)
        # Stable: a row's gradients stay in rank order, and are summed in that order.
        if touched is not None and touched.union is not None:  # the union known: no read
            every_key, order = torch.sort(every_key, stable=True)
            marks = self._union(touched.marks)
            union = torch.nonzero_static(marks, size=sum(touched.union)).view(-1)
            starts = torch.searchsorted(every_key, union)
            starts = torch.cat([starts, starts.new_full((1,), every_key.numel())])
        else:
            union, order, starts = sorted_segments(every_key)
        summed = F.embedding_bag(
            order, rows[:, :width], starts, mode="sum", include_last_offset=True
        )
        return union, summed / world
