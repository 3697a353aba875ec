"""The id -> slot maps' ops.

- ``hash_map.py``: one map's hash, find, per-bucket assignment and keep (torch, Triton).
- ``arena_scan.py``: a key arena's bucket scan of every id (torch, Triton).
- ``key_arena_cpu.py`` + ``key_arena_cpu.c``: a key arena's compiled CPU loops.

``recsys.ops.slot_map`` re-exports ``hash_map``'s public names (its import path before the
package).
"""

from recsys.ops.slot_map.hash_map import (
    EMPTY_KEY,
    MAX_BUCKET_SIZE,
    RESERVED_KEY,
    assign_slots,
    bucket_of,
    check_keys,
    find_slots,
    find_slots_torch,
    hash_keys,
    keep_per_bucket,
    mix64,
)

__all__ = [
    "EMPTY_KEY",
    "MAX_BUCKET_SIZE",
    "RESERVED_KEY",
    "assign_slots",
    "bucket_of",
    "check_keys",
    "find_slots",
    "find_slots_torch",
    "hash_keys",
    "keep_per_bucket",
    "mix64",
]
