"""Mixed precision for the train step: autocast for the dense layers, and fp16's loss scaler.

``train.precision``:

- ``"fp32"``: nothing changes.
- ``"bf16"``: the model's forward runs under ``torch.autocast(dtype=torch.bfloat16)``. The
  tables keep their own dtype and pool in fp32; autocast casts what the dense layers read (the
  interaction and fused MLP kernels already take bf16 and accumulate in fp32). bf16 has fp32's
  exponent range, so no loss scaling is needed.
- ``"fp16"``: the same under fp16, with dynamic loss scaling (:class:`LossScaler`): the loss is
  multiplied by a scale before backward, every gradient is divided by it before any update, and
  a step whose gradients overflowed (inf or NaN anywhere) is skipped and halves the scale.

The fused embedding update runs inside backward, before anyone has seen the dense gradients. In
fp16 it must see unscaled gradients and must be skipped with the dense optimizer, so
:class:`DeferredEmbeddingGrads` cuts the graph at each fused collection's output during the
step: the main backward stops there, leaving the pooled gradients (``[B, sum of dims]``, small)
on the cut; once they and the dense gradients are checked, the second backward from the cut
runs the fused update with the unscaled gradients, or does not run at all. Under torchrun the
overflow flag is agreed over ranks first, so every rank takes the same branch and the sharded
collections' backward collectives stay matched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedTensor

from recsys.distributed.ranks import is_distributed
from recsys.embedding.interface import embedding_collections

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context of ``precision`` on ``device`` (a null context for fp32).

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        expected = ", ".join(PRECISIONS)
        raise ValueError(f"train.precision = {precision!r}; expected one of {expected}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=PRECISIONS[precision])


def precision_note(precision: str, device: torch.device) -> str | None:
    """The one-line warning a run prints at start for a precision that is slow on its device
    (None: nothing to say). fp16 on CPU: most CPU kernels compute fp16 through fp32 conversions,
    and loss scaling adds a pass over the gradients; the default recipe's step measured 1.6x the
    fp32 one on a 2-core CPU (``benchmarks/results/train_step.csv``), where bf16 needs no loss
    scaling and ran as fast as fp32."""
    if precision != "fp16" or device.type != "cpu":
        return None
    return (
        "warning: train.precision = fp16 on CPU is slow (most CPU kernels compute fp16 through "
        "fp32, and loss scaling adds work: the default recipe's step measured 1.6x the fp32 one "
        "on a 2-core CPU); fp16 is for GPUs: on CPU use bf16 (no loss scaling) or fp32"
    )


class LossScaler:
    """Dynamic loss scaling (the rule of ``torch.amp.GradScaler``): multiply the loss by
    ``scale``; after a step whose gradients overflowed, skip it and multiply the scale by
    ``backoff_factor``; after ``growth_interval`` clean steps in a row, multiply it by
    ``growth_factor``.

    Args:
        init_scale: the first scale.
        growth_factor: growth after ``growth_interval`` clean steps.
        backoff_factor: shrink after an overflow.
        growth_interval: clean steps between growths.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0

    def unscale(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; a float tensor on ``device`` that is 1 when
        any of them holds an inf or NaN (then their values are meaningless)."""
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        inv_scale = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault((grad.device, grad.dtype), []).append(grad)
        for (where, _), group in by_device.items():
            found = torch.zeros((), dtype=torch.float32, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(where))
            found_inf = torch.maximum(found_inf, found.to(device))
        return found_inf

    def update(self, overflowed: bool) -> None:
        """Move the scale after a step: back off on an overflow, grow after enough clean
        steps."""
        if overflowed:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, so a resumed fp16 run scales as the straight one did."""
        return {
            "scale": torch.tensor(self.scale, dtype=torch.float64),
            "clean_steps": torch.tensor(self.clean_steps),
            "skipped_steps": torch.tensor(self.skipped_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


class DeferredEmbeddingGrads:
    """Cuts the graph at the output of every collection of ``model`` that updates its tables
    inside backward (a fused optimizer), for one step.

    Inside :meth:`cut`, each such collection's pooled output is handed on detached (a leaf that
    requires grad); a backward from the loss stops there. :meth:`grads` are the gradients that
    arrived at the cuts, and :meth:`backward` runs the rest of the graph from them, which is
    where the fused updates happen.
    """

    def __init__(self, model: nn.Module) -> None:
        self.collections = [c for c in embedding_collections(model).values() if c.optimizer]
        self._cuts: list[tuple[torch.Tensor, torch.Tensor]] = []

    @contextlib.contextmanager
    def cut(self) -> Iterator[None]:
        """Cut the graph at the collections' outputs during the forwards inside."""
        self._cuts = []
        hooks = [c.register_forward_hook(self._cut_output) for c in self.collections]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _cut_output(self, module: nn.Module, inputs: Any, output: KeyedTensor) -> KeyedTensor:
        if not output.values().requires_grad:
            return output
        leaf = output.values().detach().requires_grad_()
        self._cuts.append((output.values(), leaf))
        return KeyedTensor(
            keys=output.keys(),
            length_per_key=output.length_per_key(),
            values=leaf,
            key_dim=output.key_dim(),
        )

    def grads(self) -> list[torch.Tensor]:
        """The gradients that reached the cuts (zeros where none did), after the main
        backward."""
        for _, leaf in self._cuts:
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
        return [leaf.grad for _, leaf in self._cuts]

    def backward(self) -> None:
        """Backward from the cuts with their (by now unscaled) gradients: the fused updates."""
        if self._cuts:
            outputs, leaves = zip(*self._cuts, strict=True)
            torch.autograd.backward(list(outputs), [leaf.grad for leaf in leaves])
        self._cuts = []

    def drop(self) -> None:
        """Forget the cuts without running their backward: the tables' step is skipped."""
        self._cuts = []


def agree_overflow(found_inf: torch.Tensor) -> bool:
    """Whether any rank found an overflow (``found_inf`` is all-reduced in place under
    torchrun; one host sync)."""
    if is_distributed():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item())
