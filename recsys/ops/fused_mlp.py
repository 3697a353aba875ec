"""Alias of :mod:`recsys.ops.mlp.fused_linear`, kept so that ``recsys.ops.fused_mlp`` keeps
working (the op's public import path). New code imports from :mod:`recsys.ops.mlp.fused_linear`.
"""

from recsys.ops.mlp.fused_linear import (
    ACTIVATIONS,
    fused_linear,
    fused_linear_reference,
    fused_linear_with_mask,
    unpack_dropout_mask,
)

__all__ = [
    "ACTIVATIONS",
    "fused_linear",
    "fused_linear_reference",
    "fused_linear_with_mask",
    "unpack_dropout_mask",
]
