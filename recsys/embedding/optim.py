"""Fused sparse optimizers for :class:`recsys.EmbeddingBagCollection`.

Pass one to ``EmbeddingBagCollection(tables, optimizer=RowWiseAdagrad(lr=0.05))`` and the
update is applied inside the collection's backward, to the rows the batch touched, with no
gradient tensor the size of a table ever built (as FBGEMM's fused TBE does). Each table's
optimizer state is a module buffer next to its weight, so it is in ``state_dict()`` and in every
checkpoint: ``embedding_bags.<table>.<state>`` (see :attr:`FusedOptimizer.states`), plus the
collection's step counter ``optimizer_step``.

The math, for one touched row ``w`` whose ids occurred several times in the batch: ``g`` is the
sum of the row's gradients over all its occurrences (duplicates are reduced first, in a fixed
order, so the update is deterministic), plus ``weight_decay * w`` (L2, touched rows only);
``t`` is the collection's step counter after this step (1 for the first). Rows the batch did not
touch are left alone (their Adam moments do not decay: "lazy" Adam, like torch's SparseAdam).

=====================  ======================================================================
SGD                    ``w -= lr * g``
Adagrad                ``sum += g**2;  w -= lr * g / (sqrt(sum) + eps)`` (torch.optim.Adagrad)
RowWiseAdagrad         ``sum += mean(g**2);  w -= lr * g / (sqrt(sum) + eps)``, one float of
                       state per row (FBGEMM's EXACT_ROWWISE_ADAGRAD)
Adam                   ``m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g**2;``
                       ``w -= lr * (m / (1-b1**t)) / (sqrt(v / (1-b2**t)) + eps)``
=====================  ======================================================================

Hyperparameters are read at every backward, so ``ebc.optimizer.lr = 0.01`` changes the learning
rate from the next step on (this is how a schedule drives a fused optimizer).

fp16 / bf16 tables are updated in fp32 and written back with stochastic rounding (unbiased: a
value between two representable neighbours rounds up with probability proportional to its
distance from the lower one), so updates far below the table's precision still move the weights
on average (``stochastic_rounding=False`` rounds to nearest instead); optimizer state is
always fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

# The Triton kernels dispatch on these codes (a tl.constexpr); ops owns them, as the kernels do.
from recsys.ops.embedding_bag.layout import ADAGRAD_CODE, ADAM_CODE, ROWWISE_ADAGRAD_CODE, SGD_CODE


@dataclass
class FusedOptimizer:
    """Base class: hyperparameters, state layout and the reference update (what the embedding
    bag's backends apply, :class:`recsys.ops.embedding_bag.layout.RowOptimizer`)."""

    lr: float
    weight_decay: float = 0.0
    stochastic_rounding: bool = True
    """fp16 / bf16 tables: round updated weights stochastically (else to nearest)."""

    code: ClassVar[int]
    #: state name -> "row" (one fp32 per row) or "element" (one fp32 per weight element)
    states: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, float | int) and not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}: {name}={value!r} must be finite")
        if self.lr < 0:
            raise ValueError(f"{type(self).__name__}: lr={self.lr!r} must be >= 0")
        if self.weight_decay < 0:
            raise ValueError(
                f"{type(self).__name__}: weight_decay={self.weight_decay!r} must be >= 0"
            )

    def initial_state(self, name: str) -> float:
        """Value every row's state ``name`` starts from."""
        return 0.0

    def scalars(self, step: int) -> dict[str, float]:
        """Every hyperparameter the kernels take, for the step being applied (1 for the
        first); the ones an optimizer does not have are 0."""
        b1, b2 = getattr(self, "betas", (0.0, 0.0))
        return {
            "lr": self.lr,
            "eps": getattr(self, "eps", 0.0),
            "beta1": b1,
            "beta2": b2,
            "weight_decay": self.weight_decay,
            "bias_correction1": 1 - b1**step,
            "bias_correction2": 1 - b2**step,
        }

    def update(
        self, weight: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        """Reference update of touched rows, out of place.

        Args:
            weight: [U, D] rows, in the compute dtype (fp32 or fp64).
            grad: [U, D] reduced gradient of each row.
            state: name -> [U] or [U, D] rows of each state tensor, updated in place.
            step: the step being applied (1 for the first).

        Returns:
            the updated [U, D] rows.
        """
        raise NotImplementedError

    def _decayed(self, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad + self.weight_decay * weight if self.weight_decay else grad


@dataclass
class SGD(FusedOptimizer):
    """Plain SGD: ``w -= lr * g``."""

    code: ClassVar[int] = SGD_CODE

    def update(self, weight, grad, state, step):
        return weight - self.lr * self._decayed(weight, grad)


@dataclass
class _Accumulating(FusedOptimizer):
    """Adagrad's hyperparameters: ``eps`` and the accumulator's starting value."""

    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps <= 0 or self.initial_accumulator_value < 0:
            raise ValueError(
                f"{type(self).__name__}: eps={self.eps!r} must be > 0 and "
                f"initial_accumulator_value={self.initial_accumulator_value!r} >= 0"
            )

    def initial_state(self, name: str) -> float:
        return self.initial_accumulator_value


@dataclass
class Adagrad(_Accumulating):
    """Adagrad with one accumulator per element (``sum``), as ``torch.optim.Adagrad``."""

    code: ClassVar[int] = ADAGRAD_CODE
    states: ClassVar[dict[str, str]] = {"sum": "element"}

    def update(self, weight, grad, state, step):
        grad = self._decayed(weight, grad)
        state["sum"] += grad * grad
        return weight - self.lr * grad / (state["sum"].sqrt() + self.eps)


@dataclass
class RowWiseAdagrad(_Accumulating):
    """Adagrad with one accumulator per row (``sum``, the mean of the squared gradient over the
    row): the memory of SGD, the robustness of Adagrad. The usual choice for large tables."""

    eps: float = 1e-8

    code: ClassVar[int] = ROWWISE_ADAGRAD_CODE
    states: ClassVar[dict[str, str]] = {"sum": "row"}

    def update(self, weight, grad, state, step):
        grad = self._decayed(weight, grad)
        state["sum"] += (grad * grad).mean(dim=1)
        return weight - self.lr * grad / (state["sum"].sqrt() + self.eps).unsqueeze(1)


@dataclass
class Adam(FusedOptimizer):
    """Lazy Adam: moments ``exp_avg`` and ``exp_avg_sq`` per element, updated for touched rows
    only; bias correction uses the collection's step counter."""

    betas: tuple[float, float] = field(default=(0.9, 0.999))
    eps: float = 1e-8

    code: ClassVar[int] = ADAM_CODE
    states: ClassVar[dict[str, str]] = {"exp_avg": "element", "exp_avg_sq": "element"}

    def __post_init__(self) -> None:
        super().__post_init__()
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam: betas={self.betas!r} must be two numbers in [0, 1)")
        if self.eps <= 0:
            raise ValueError(f"Adam: eps={self.eps!r} must be > 0")

    def update(self, weight, grad, state, step):
        b1, b2 = self.betas
        grad = self._decayed(weight, grad)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_((1 - b1) * grad)
        v.mul_(b2).add_((1 - b2) * grad * grad)
        m_hat = m / (1 - b1**step)
        v_hat = v / (1 - b2**step)
        return weight - self.lr * m_hat / (v_hat.sqrt() + self.eps)


OPTIMIZERS: dict[str, type[FusedOptimizer]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": Adam,
}
