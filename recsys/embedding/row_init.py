"""Deterministic initial rows of dynamic tables: a function of (seed, table, key) only.

A dynamic table gives a key a row when the key first arrives (or arrives again after its row
was evicted or expired). That row must not depend on which slot the key lands in, on the order
keys arrive in, on the batch, or (once tables are sharded) on the rank: two runs, a resumed run
and a run on another number of ranks must start every key from the same vector. So the row is
drawn from a counter-based generator keyed by the key itself::

    z[k, j] = mix64(mix64(key_k ^ table_seed) + (j + 1) * GOLDEN)    (64-bit wraparound)
    u[k, j] = (z[k, j] >>> 40) / 2**24                               uniform in [0, 1)
    row[k, j] = bound * (2 * u[k, j] - 1)                            uniform in [-bound, bound)

with ``table_seed = mix64(seed * GOLDEN ^ crc32(table name))`` (the table's name, not its
position, so adding a table changes no other table's rows) and ``mix64`` the splitmix64
finalizer of :mod:`recsys.ops.slot_map.hash_map`. ``bound`` defaults to TorchRec's default init,
``sqrt(1 / num_embeddings)``.

Fixed tables built on the ``meta`` device and materialized shard by shard (under torchrun) start
from the same function of (seed, table, row) (:func:`fill_initial_rows`): a table starts the same
whatever the number of ranks and the plan, and no two shards repeat each other's rows.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import torch

from recsys.ops.slot_map.hash_map import mix64

__all__ = ["fill_initial_rows", "initial_rows", "table_seed", "uniform_bound"]

# 2**64 / golden ratio, as a signed int64 (wraparound arithmetic).
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_INT64 = (1 << 63) - 1


def _wrap(value: int) -> int:
    """``value`` modulo 2**64, as the signed int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value > _INT64 else value


def table_seed(seed: int, table: str) -> int:
    """The generator key of one table of a run: mixes the run's seed and the table's name."""
    mixed = _wrap(seed * GOLDEN) ^ zlib.crc32(table.encode())
    return int(mix64(torch.tensor([mixed], dtype=torch.int64))[0])


def initial_rows(
    keys: torch.Tensor, seed: int, dim: int, bound: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The initial rows ``[len(keys), dim]`` of ``keys`` in a table whose generator key is
    ``seed`` (see :func:`table_seed`), uniform in ``[-bound, bound)``, on ``keys``' device.

    Computed in float64 and rounded once to ``dtype``, so a row is the same in every dtype's
    precision."""
    keys = keys.to(torch.int64).reshape(-1, 1)
    if isinstance(seed, torch.Tensor):  # one per key: keys of several tables at once
        seed = seed.reshape(-1, 1)
    if isinstance(bound, torch.Tensor):
        bound = bound.to(torch.float64).reshape(-1, 1)
    columns = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * GOLDEN
    z = mix64(mix64(keys ^ seed) + columns)  # [K, dim]
    top = (z >> 40) & ((1 << 24) - 1)
    uniform = top.to(torch.float64) / float(1 << 24)
    return (bound * (2.0 * uniform - 1.0)).to(dtype)


CHUNK_ROWS = 1 << 16  # rows generated at a time (the generator's int64 temporaries are 8x dim)


def fill_initial_rows(
    weight: torch.Tensor, seed: int, bound: float, row_offset: int = 0, col_offset: int = 0
) -> None:
    """Fill ``weight`` [rows, cols], the block at (``row_offset``, ``col_offset``) of a table
    whose generator key is ``seed``, with that block of the table's initial rows (row ``r`` of
    the table is ``initial_rows([r], seed, col_offset + cols, bound)``), a chunk of rows at a
    time."""
    rows, cols = weight.shape
    with torch.no_grad():
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            keys = torch.arange(row_offset + start, row_offset + stop, device=weight.device)
            block = initial_rows(keys, seed, col_offset + cols, bound, weight.dtype)
            weight[start:stop] = block[:, col_offset:]


def uniform_bound(init_fn: Callable[[torch.Tensor], Any] | None) -> float | None:
    """``b`` when ``init_fn`` draws uniformly from ``[-b, b]`` (TorchRec's default init is
    ``partial(torch.nn.init.uniform_, a=-b, b=b)``), else None (an init of its own)."""
    if not isinstance(init_fn, functools.partial) or init_fn.func is not torch.nn.init.uniform_:
        return None
    low, high = init_fn.keywords.get("a"), init_fn.keywords.get("b")
    if init_fn.args or low is None or high is None or low != -high:
        return None
    return float(high)
