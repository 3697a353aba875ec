"""Arena find: the slot of each key in its own map, for several maps side by side in one
buffer (an arena, see :mod:`recsys.embedding.dynamic.key_arena`).

Map m takes the buckets ``[first_m, first_m + num_buckets_m)`` of the buffer; key k of map m
lives in bucket ``first_m + bucket_of(k, num_buckets_m)`` (the bucket rule of
:mod:`recsys.ops.slot_map.hash_map`), so with a per-key ``first`` and ``num_buckets`` one launch
looks up the keys of every table. Shape letters: C slots of the arena, S bucket_size, N keys.

Backends: the torch path is :func:`~recsys.ops.slot_map.hash_map.find_slots_torch` with per-key map
parameters; the Triton path is the map's own find kernel with per-key map parameters
(``PER_KEY``), a block of keys per program, each scanning its bucket's row. Read-only, no
atomics, no host sync: deterministic, the backends bitwise equal.
"""

from __future__ import annotations

import torch
import triton

from recsys.ops._triton import resolve_backend
from recsys.ops.slot_map.hash_map import (
    FIND_CHUNK,
    FIND_TILE,
    MAX_BUCKET_SIZE,
    find_slots_kernel,
    find_slots_torch,
)

__all__ = ["find_arena_slots"]


def find_arena_slots(
    table_keys: torch.Tensor,
    bucket_size: int,
    num_buckets: torch.Tensor,
    first_bucket: torch.Tensor,
    keys: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """The slot of each key in its own map of an arena (maps side by side in ``table_keys``),
    or -1 where that map does not hold it. Read-only; duplicates allowed; reserved keys (not
    checked here: no map holds them) find -1. No host sync.

    Args:
        table_keys: [C] int64 keys of every map (``EMPTY_KEY`` where free), C a multiple of
            ``bucket_size``.
        bucket_size: slots per bucket of every map, 1..128.
        num_buckets: [N] int64 buckets of each key's map.
        first_bucket: [N] int64 first bucket of each key's map in ``table_keys``.
        keys: [N] int64 keys to look up.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        [N] int64 slots in ``table_keys`` (-1 where absent).

    Raises:
        ValueError: a layout or shape that does not match, a non-int64 tensor, or an unknown
            backend.

    Example::

        # maps of 4 and 2 buckets of 8 slots in one [48] buffer; key 7 in the second map
        find_arena_slots(arena, 8, torch.tensor([2]), torch.tensor([4]), torch.tensor([7]))
    """
    if not 1 <= bucket_size <= MAX_BUCKET_SIZE or table_keys.numel() % bucket_size:
        raise ValueError(
            f"table_keys has {table_keys.numel()} slots and bucket_size={bucket_size}; expected "
            "1 <= bucket_size <= 128 dividing the slots"
        )
    for name, tensor in (
        ("keys", keys),
        ("num_buckets", num_buckets),
        ("first_bucket", first_bucket),
    ):
        if tensor.dtype != torch.int64 or tensor.shape != keys.shape or tensor.dim() != 1:
            raise ValueError(
                f"{name} is {tensor.dtype} {tuple(tensor.shape)}; expected torch.int64 "
                f"{tuple(keys.shape[:1])} (one per key)"
            )
    chosen = resolve_backend(backend, keys.device, op="find_arena_slots", has_triton=True)
    if chosen == "triton":
        out = torch.empty_like(keys)
        block_s = triton.next_power_of_2(bucket_size)
        block_n = FIND_TILE // block_s
        if len(keys):
            find_slots_kernel[(triton.cdiv(len(keys), block_n),)](
                table_keys.contiguous(),
                keys.contiguous(),
                num_buckets.contiguous(),
                first_bucket.contiguous(),
                out,
                len(keys),
                0,  # per key instead
                PER_KEY=True,
                BUCKET_SIZE=bucket_size,
                BLOCK_N=block_n,
                BLOCK_S=block_s,
            )
        return out
    parts = [
        find_slots_torch(table_keys, buckets, bucket_size, chunk, first)
        for chunk, buckets, first in zip(
            keys.split(FIND_CHUNK),
            num_buckets.split(FIND_CHUNK),
            first_bucket.split(FIND_CHUNK),
            strict=True,
        )
    ]
    return torch.cat(parts) if len(parts) != 1 else parts[0]
