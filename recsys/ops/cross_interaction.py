"""Alias of :mod:`recsys.ops.interaction.cross`, kept so that ``recsys.ops.cross_interaction`` keeps
working (the op's public import path). New code imports from :mod:`recsys.ops.interaction.cross`.
"""

from recsys.ops.interaction.cross import (
    cross_layer,
    cross_layer_low_rank,
    cross_layer_low_rank_reference,
    cross_layer_reference,
    cross_layer_vector,
    cross_layer_vector_reference,
)

__all__ = [
    "cross_layer",
    "cross_layer_low_rank",
    "cross_layer_low_rank_reference",
    "cross_layer_reference",
    "cross_layer_vector",
    "cross_layer_vector_reference",
]
