"""Alias of :mod:`recsys.ops.interaction.dot`, kept so that ``recsys.ops.dot_interaction`` keeps
working (the op's public import path). New code imports from :mod:`recsys.ops.interaction.dot`.
"""

from recsys.ops.interaction.dot import (
    PAIR_ORDERS,
    TRITON_DTYPES,
    TRITON_MAX_VECTORS,
    PairOrder,
    dot_interaction,
    dot_interaction_reference,
    num_pairs,
    output_width,
    pair_indices,
)

__all__ = [
    "PAIR_ORDERS",
    "TRITON_DTYPES",
    "TRITON_MAX_VECTORS",
    "PairOrder",
    "dot_interaction",
    "dot_interaction_reference",
    "num_pairs",
    "output_width",
    "pair_indices",
]
