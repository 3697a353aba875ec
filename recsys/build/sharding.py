"""``[distributed]`` -> a sharded model: :func:`~recsys.distributed.parallel.parallelize` with a
run's options, for the trainer and ``recsys eval`` alike."""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import Config
from recsys.distributed.parallel import parallelize
from recsys.distributed.planner import parse_constraints

__all__ = ["parallelize_from_config"]

_COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def parallelize_from_config(model: nn.Module, config: Config, device: torch.device) -> nn.Module:
    """:func:`~recsys.distributed.parallel.parallelize` with the run's ``[distributed]`` options
    (placement constraints, memory per rank, communication precisions), ``train.batch_size``
    and ``run.seed``; the model unchanged in a world of one."""
    cfg = config.distributed
    return parallelize(
        model,
        device,
        seed=config.run.seed,
        forward_precision=cfg.forward_precision,
        backward_precision=cfg.backward_precision,
        memory_per_rank=int(cfg.memory_per_rank_gb * 2**30),
        batch_size=config.train.batch_size,
        constraints=parse_constraints(cfg.constraints),
        forward_comm_bytes=_COMM_BYTES[cfg.forward_precision],
        backward_comm_bytes=_COMM_BYTES[cfg.backward_precision],
    )
