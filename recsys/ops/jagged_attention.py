"""Alias of :mod:`recsys.ops.jagged.attention`, kept so that ``recsys.ops.jagged_attention`` keeps
working (the op's public import path: README, ``docs/config.md``). New code imports from
:mod:`recsys.ops.jagged.attention`.
"""

from recsys.ops.jagged.attention import (
    TIME_CONVENTIONS,
    jagged_attention,
    jagged_attention_reference,
    query_times,
    relative_bias,
    visible,
)

__all__ = [
    "TIME_CONVENTIONS",
    "jagged_attention",
    "jagged_attention_reference",
    "query_times",
    "relative_bias",
    "visible",
]
