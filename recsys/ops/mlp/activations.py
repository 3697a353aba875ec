"""The activations of the fused linear layer (``recsys.ops.mlp.fused_linear``): torch and Triton
forms.

    relu      max(z, 0)                     act'(z) = 1[z > 0]
    gelu      z * Phi(z) (exact, erf)       act'(z) = Phi(z) + z * phi(z)
    silu      z * sigmoid(z)                act'(z) = s * (1 + z * (1 - s)),  s = sigmoid(z)
    sigmoid   sigmoid(z)                    act'(z) = s * (1 - s)
    none      z                             act'(z) = 1

with Phi and phi the standard normal CDF and density. The Triton forms compute in the dtype
they are given (fp32 in the fused kernels). relu's and none's derivatives need no z, so the
fused backward has no Triton form of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["ACTIVATIONS", "SAVES_PRE_ACTIVATION", "activate", "activate_torch", "activation_grad"]

ACTIVATIONS = ("relu", "gelu", "silu", "sigmoid", "none")
# Activations whose derivative needs the pre-activation z (relu's comes from y, none's is 1).
SAVES_PRE_ACTIVATION = ("gelu", "silu", "sigmoid")

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


def activate_torch(z: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(z)`` in plain torch, for ``activation`` in :data:`ACTIVATIONS`."""
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "silu":
        return F.silu(z)
    if activation == "sigmoid":
        return torch.sigmoid(z)
    return z


@triton.jit
def activate(z, ACTIVATION: tl.constexpr):
    """``act(z)`` in a Triton kernel."""
    if ACTIVATION == "relu":
        a = tl.maximum(z, 0.0)
    elif ACTIVATION == "gelu":
        a = 0.5 * z * (1.0 + tl.erf(z * _SQRT1_2))
    elif ACTIVATION == "silu":
        a = z * tl.sigmoid(z)
    elif ACTIVATION == "sigmoid":
        a = tl.sigmoid(z)
    else:
        a = z
    return a


@triton.jit
def activation_grad(z, ACTIVATION: tl.constexpr):
    """act'(z) in a Triton kernel, for the activations that save z."""
    if ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * _SQRT1_2))
        d = cdf + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    elif ACTIVATION == "silu":
        s = tl.sigmoid(z)
        d = s * (1.0 + z * (1.0 - s))
    else:  # sigmoid
        s = tl.sigmoid(z)
        d = s * (1.0 - s)
    return d
