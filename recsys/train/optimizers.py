"""The two optimizers of a run: the dense one (any torch optimizer over every parameter but
the tables) and the embedding one, fused into the tables' backward
(:mod:`recsys.embedding.optim`) or a torch optimizer over their dense gradients; and the
weights of the task losses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

from recsys.build.models import (
    TORCH_OPTIMIZERS,
    dense_optimizer,
    dense_parameters,
    fused_embedding_optimizer,
)
from recsys.config import TrainConfig
from recsys.embedding.interface import embedding_collections, logical_optimizer_state


def configure_embedding_optimizer(config: TrainConfig, model: nn.Module) -> None:
    """With ``train.fused_embedding_update``, fuse the embedding optimizer into the backward of
    every embedding collection that is not frozen; call it before :func:`parallelize`, which
    hands the optimizer to the shards (a sharded collection refuses a new one). Otherwise check
    a torch optimizer of that name exists."""
    if config.fused_embedding_update:
        for collection in embedding_collections(model).values():
            if not collection.is_frozen():
                collection.set_optimizer(fused_embedding_optimizer(config))
    elif config.embedding_optimizer not in TORCH_OPTIMIZERS:
        raise ValueError(
            f"train.embedding_optimizer = {config.embedding_optimizer!r} only exists as a fused "
            f"update (train.fused_embedding_update = true); with dense table gradients pick one "
            f"of {', '.join(TORCH_OPTIMIZERS)}"
        )


def build_optimizers(config: TrainConfig, model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    """``{"dense": ..., "embedding": ...}``: all parameters but the tables go to the dense
    optimizer. Tables get the embedding optimizer fused into their backward
    (``train.fused_embedding_update``; set here on collections that have none yet), or else a
    torch optimizer over their dense gradients."""
    collections = embedding_collections(model).values()
    if not any(c.optimizer for c in collections):
        configure_embedding_optimizer(config, model)
    tables = [p for collection in collections for p in collection.trainable_parameters()]
    dense = dense_parameters(model)
    optimizers = {}
    if dense:
        optimizers["dense"] = dense_optimizer(config, dense)
    if tables:
        optimizers["embedding"] = TORCH_OPTIMIZERS[config.embedding_optimizer](
            tables, lr=config.embedding_lr
        )
    return optimizers


def learning_rates(
    optimizers: dict[str, torch.optim.Optimizer], model: nn.Module
) -> dict[str, float]:
    """The current rates: ``lr_dense``, and ``lr_embedding`` (the tables' torch optimizer or
    fused optimizer)."""
    rates = {f"lr_{name}": o.param_groups[0]["lr"] for name, o in optimizers.items()}
    fused = [c.optimizer for c in embedding_collections(model).values() if c.optimizer]
    if fused:
        rates["lr_embedding"] = fused[0].lr
    return rates


def task_loss_weights(
    config: TrainConfig, num_tasks: int, device: torch.device
) -> torch.Tensor | None:
    """``train.task_loss_weights`` normalized to sum to 1, as a [T] tensor; None when empty
    (every task weighs the same: the plain mean BCE over [B, T]).

    Raises:
        ValueError: a count other than the data's number of tasks, or a negative or all-zero
            weight list.
    """
    weights = config.task_loss_weights
    if not weights:
        return None
    if len(weights) != num_tasks:
        raise ValueError(
            f"train.task_loss_weights has {len(weights)} weights {weights}, but the data has "
            f"{num_tasks} task(s)"
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"train.task_loss_weights = {weights}; expected weights >= 0 with a positive sum"
        )
    return torch.tensor(weights, device=device) / sum(weights)


def optimizer_states(
    model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what a checkpoint holds, each optimizer's own state dict) of a run's ``optimizers``
    over ``model`` (under DDP or not). Both keyed by parameter name; the torch embedding
    optimizer's (``train.fused_embedding_update = false``) in the tables' logical layout,
    ShardedTensors over the live state of sharded tables, and without its param_groups (their
    parameter names differ by rank and plan; the rates come from the config)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    tables = {id(p) for c in embedding_collections(inner).values() for p in c.parameters()}
    saved, live = {}, {}
    for name, optimizer in optimizers.items():
        live[name] = get_optimizer_state_dict(model, [optimizer])
        saved[name] = live[name]
        params = (p for group in optimizer.param_groups for p in group["params"])
        if any(id(p) in tables for p in params):  # the tables' torch optimizer
            saved[name] = {"state": logical_optimizer_state(inner, live[name]["state"])}
    return saved, live
