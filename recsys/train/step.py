"""One training step: forward, loss, backward and the optimizers, at the run's precision.

fp32 and bf16 steps are the plain sequence (bf16 only adds autocast around the forward). An fp16
step scales the loss, checks every gradient (dense ones and those arriving at the fused
collections, see :class:`recsys.train.precision.DeferredEmbeddingGrads`) and then either
applies all updates with unscaled gradients or none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recsys.build.registry import check_logits
from recsys.data.batch import Batch
from recsys.train.precision import DeferredEmbeddingGrads, LossScaler, agree_overflow, autocast
from recsys.train.progress import StepTimer


class TrainStep:
    """The train step of a run.

    Args:
        model: the model (DDP-wrapped under torchrun).
        optimizers: the torch optimizers by name (the fused embedding updates run in backward).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``train.precision``).
        device: where the batches are.
        task_weights: [T] weights of each task's loss, or None for one task.
        cuda_graphs: the dense part replays CUDA graphs (``train.cuda_graphs``): each step
            starts a new graph generation, whose replays reuse the memory of the previous
            step's graph outputs (nothing holds those across steps: the loss is computed eagerly).
        loss: ``loss(model, batch) -> scalar``, the whole forward of a model that is not a
            CTR model (a sequence model's next-item loss, :mod:`recsys.train.retrieval`), run
            under the precision's autocast and taken in fp32; None: BCE over
            ``model(batch.dense, batch.sparse)``'s logits.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: dict[str, torch.optim.Optimizer],
        precision: str,
        device: torch.device,
        task_weights: torch.Tensor | None,
        cuda_graphs: bool = False,
        loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.optimizers = optimizers
        self.precision = precision
        self.device = device
        self.task_weights = task_weights
        self.cuda_graphs = cuda_graphs
        self.loss = loss
        autocast(precision, device)  # a bad precision fails here, before training
        self.scaler = LossScaler() if precision == "fp16" else None
        self.deferred = DeferredEmbeddingGrads(model) if self.scaler else None

    def __call__(self, batch: Batch, timer: StepTimer) -> torch.Tensor:
        """Train on ``batch``; the loss (detached, unscaled)."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.scaler is not None:
            return self._scaled_step(batch, timer)
        if self.loss is not None:
            with autocast(self.precision, self.device):
                loss = self.loss(self.model, batch).float()
        else:
            with autocast(self.precision, self.device):
                logits = self.model(batch.dense, batch.sparse)  # [B, T]
            loss = self._loss(logits, batch.labels)
        timer.mark("forward")
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        timer.mark("backward")
        for optimizer in self.optimizers.values():
            optimizer.step()
        timer.mark("optimizer")
        return loss.detach()

    def _scaled_step(self, batch: Batch, timer: StepTimer) -> torch.Tensor:
        scaler, deferred = self.scaler, self.deferred
        if self.loss is not None:
            with deferred.cut(), autocast(self.precision, self.device):
                loss = self.loss(self.model, batch).float()
        else:
            with deferred.cut(), autocast(self.precision, self.device):
                logits = self.model(batch.dense, batch.sparse)
            loss = self._loss(logits, batch.labels)
        timer.mark("forward")
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        (loss * scaler.scale).backward()
        grads = [p.grad for p in self._parameters() if p.grad is not None]
        overflowed = agree_overflow(scaler.unscale(grads + deferred.grads(), self.device))
        if overflowed:
            deferred.drop()  # neither the tables nor their optimizer state move
        else:
            deferred.backward()  # the fused updates, with unscaled gradients
        timer.mark("backward")
        if not overflowed:
            for optimizer in self.optimizers.values():
                optimizer.step()
        scaler.update(overflowed)
        timer.mark("optimizer")
        return loss.detach()

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_logits(self.model, logits, labels)  # a model class of the user's: at the first batch
        logits = logits.float()  # the loss in fp32 whatever the precision
        if self.task_weights is None:
            return F.binary_cross_entropy_with_logits(logits, labels)
        per_task = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(0)
        return (per_task * self.task_weights).sum()

    def log_fields(self) -> dict[str, float | int]:
        """Fields of the train event: with fp16, ``loss_scale`` (the scale the next step uses)
        and ``skipped_steps`` (steps skipped on an overflow since the run began, resumes
        included); empty otherwise. Host values (the overflow check already synced each step):
        reading them waits on nothing."""
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps}

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (empty without one)."""
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
