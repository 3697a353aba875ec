"""DATA_PARALLEL tables of a sharded collection: every rank holds them whole and looks up its own
batch with no communication.

Trained by a torch optimizer, their gradients are averaged by DDP like the dense layers'. With
a fused optimizer, a hook per table collects its gradient in backward; once every replicated
table has one (they come from one backward node, so back to back), ONE all-reduce averages all
the gradients over ranks together with the rows any rank touched, and every rank applies the
same row update (:func:`recsys.ops.row_update.update_rows`, the torch backend's own), so the
replicas stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.distributed.comm import CommStats
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import FusedOptimizer
from recsys.ops.embedding_bag_layout import rounding_seed
from recsys.ops.row_update import update_rows


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
        comm_stats: where the all-reduce's bytes are counted.
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
            configs, is_weighted=is_weighted, device=device, backend=backend, validate=False
        )
        if source is not None:
            with torch.no_grad():
                for c in configs:
                    self.tables.embedding_bags[c.name].weight.copy_(
                        source.embedding_bags[c.name].weight
                    )
        first = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        for table in self.tables.embedding_bags.values():
            dist.broadcast(table.weight.data, src=first, group=process_group)
        # Fused optimizer state per table (``states[t].<state>``) and the step counter.
        self.states = nn.ModuleDict()
        step = source.optimizer_step.clone() if optimizer and source is not None else None
        if step is None:
            step = torch.zeros((), dtype=torch.int64)
        self.register_buffer("step", step.to(device=device, dtype=torch.int64))
        self._touched: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self._pending_step = 0
        if optimizer is not None:
            for c in configs:
                self.states[c.name] = _state_holder(c, optimizer, source, device)
                weight = self.tables.embedding_bags[c.name].weight
                weight.register_post_accumulate_grad_hook(self._hook(c.name))

    def weight(self, table: str) -> nn.Parameter:
        """The whole table ``table`` [num_embeddings, embedding_dim]."""
        return self.tables.embedding_bags[table].weight

    def optimizer_state(self, table: str) -> dict[str, torch.Tensor]:
        """The fused optimizer's state of ``table`` by name (empty without one)."""
        if table not in self.states:
            return {}
        return dict(self.states[table].named_buffers())

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The replicated tables' pooled vectors of this rank's samples: [B, D_dp]."""
        pooled = self.tables(features).values()
        if self.optimizer is not None and torch.is_grad_enabled():
            self._record_touched(features)
        return pooled

    def _record_touched(self, features: KeyedJaggedTensor) -> None:
        values = features.values().split(features.length_per_key())
        per_feature = dict(zip(features.keys(), values, strict=True))
        self._pending_step = int(self.step) + 1
        for c in self.configs:
            ids = torch.cat([per_feature[f] for f in c.feature_names]).long()
            touched = torch.zeros(c.num_embeddings, dtype=torch.bool, device=ids.device)
            self._touched[c.name] = touched.index_fill_(0, ids, True)

    def _hook(self, table: str):
        """Keep the table's gradient; the last table's hook applies every update."""

        def hook(weight: torch.Tensor) -> None:
            self._grads[table] = weight.grad
            weight.grad = None
            if len(self._grads) == len(self.configs):
                self._apply_updates()

        return hook

    def _apply_updates(self) -> None:
        names = [c.name for c in self.configs]
        grads = [self._grads.pop(name) for name in names]
        touched = [self._touched.pop(name) for name in names]
        packed = torch.cat([g.reshape(-1).float() for g in grads] + [t.float() for t in touched])
        self.comm_stats.add("backward", packed)
        with self.comm_stats.timed(packed.device):
            dist.all_reduce(packed, group=self.process_group)  # sums over ranks
        pieces = packed.split([g.numel() for g in grads] + [t.numel() for t in touched])
        step = self._pending_step
        self.step.fill_(step)
        generator = None
        if self.optimizer.stochastic_rounding:
            generator = torch.Generator(device=packed.device)
            generator.manual_seed(rounding_seed(step))
        world_size = dist.get_world_size(self.process_group)
        with torch.no_grad():
            for t, name in enumerate(names):
                weight = self.weight(name)
                grad = pieces[t].view_as(weight) / world_size
                rows = (pieces[len(names) + t] > 0).nonzero().squeeze(1)
                states = self.optimizer_state(name)
                update_rows(self.optimizer, weight, states, rows, grad[rows], step, generator)


def _state_holder(
    config: EmbeddingBagConfig,
    optimizer: FusedOptimizer,
    source: EmbeddingBagCollection | None,
    device: torch.device,
) -> nn.Module:
    """A module whose buffers are one table's fused optimizer state, copied from ``source``."""
    holder = nn.Module()
    for name, kind in optimizer.states.items():
        rows, dim = config.num_embeddings, config.embedding_dim
        shape = (rows,) if kind == "row" else (rows, dim)
        state = torch.full(shape, optimizer.initial_state(name), device=device)
        if source is not None:
            state.copy_(source.embedding_bags[config.name].get_buffer(name))
        holder.register_buffer(name, state)
    return holder
