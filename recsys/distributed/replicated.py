"""DATA_PARALLEL tables of a sharded collection: every rank holds them whole and looks up its own
batch with no communication.

Trained by a torch optimizer, their gradients are averaged by DDP like the dense layers'. With
a fused optimizer, the tables are one packed collection whose backward reduces this rank's
gradient per touched row (no gradient the size of a table) and hands the rows to
:meth:`ReplicatedTables.exchange`: one all-gather of every rank's touched rows and their
gradients (after one of their counts), summed per row in rank order and divided by the world
size; then every rank applies the same update to the same rows, one
:func:`recsys.ops.row_update.update_rows` per dim group (the torch backend's own), so the
replicas stay equal. On 2 ranks the result is bitwise that of summing dense gradients with an
all-reduce (a + b either way; only a row whose two gradients are both -0.0 gets +0.0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.distributed.comm import CommStats
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import FusedOptimizer
from recsys.ops.embedding_bag_layout import sorted_segments


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

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The replicated tables' pooled vectors of this rank's samples: [B, D_dp]."""
        return self.tables(features).values()

    def exchange(
        self, keys: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's touched rows and their gradients, averaged over ranks.

        Args:
            keys: [U] this rank's sorted distinct touched rows (the packed tables' row space).
            grads: [U, D] their gradients, reduced over this rank's batch.

        Returns:
            the union's sorted rows [U'] and their gradients summed over ranks in rank order,
            divided by the world size [U', D]; the same on every rank. One host read (the
            ranks' row counts, which size the all-gather).
        """
        group, device = self.process_group, keys.device
        world = dist.get_world_size(group)
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
        union, order, starts = sorted_segments(every_key)
        summed = F.embedding_bag(
            order, rows[:, :width], starts, mode="sum", include_last_offset=True
        )
        return union, summed / world
