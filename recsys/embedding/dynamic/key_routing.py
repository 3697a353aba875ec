"""Where a dynamic table's keys live when the table is split into parts (ranks): a fixed number
of global **routing buckets**, each part owning a contiguous range of them.

    routing_bucket(k) = (hash_keys(k, ROUTING_SEED) >>> 1) mod num_buckets

``hash_keys`` is the seeded splitmix64 hash of :mod:`recsys.ops.slot_map.hash_map`; its seed differs
from the one the id -> slot map buckets keys with, so the two are independent (keys of one routing
bucket spread over all of a map's buckets). A mixing hash, not ``key mod world_size``: patterned
ids (multiples of the world size, ids with a common stride) spread evenly too.

Of P parts, part j owns buckets ``[j * num_buckets // P, (j + 1) * num_buckets // P)``. The
bucket count is fixed for a table's life, so changing the number of parts moves whole buckets:
a checkpoint stores a table's rows ordered by (routing bucket, key) with the number of keys per
bucket, and each part of any later split reads one contiguous range of rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from recsys.ops.slot_map.hash_map import hash_keys

__all__ = [
    "ROUTING_SEED",
    "KeyRouting",
    "bucket_ranges",
    "decode_layout",
    "encode_layout",
    "routing_bucket",
]

# The routing hash's seed: any constant other than the slot map's 0 (here: 2**64 / phi).
ROUTING_SEED = 0x9E3779B97F4A7C15
ROUTING_FUNCTION = "splitmix64"


def bucket_ranges(num_buckets: int, parts: int) -> list[tuple[int, int]]:
    """The routing buckets ``[lo, hi)`` each of ``parts`` parts owns, in part order."""
    return [(j * num_buckets // parts, (j + 1) * num_buckets // parts) for j in range(parts)]


@dataclass(frozen=True)
class KeyRouting:
    """The routing of one dynamic table's keys into ``num_buckets`` global buckets.

    Args:
        num_buckets: the global buckets (>= 1); at most this many parts can hold the table.
        seed: the routing hash's seed.
    """

    num_buckets: int
    seed: int = ROUTING_SEED

    def __post_init__(self) -> None:
        if self.num_buckets < 1:
            raise ValueError(f"routing_buckets={self.num_buckets}; expected >= 1")

    def buckets(self, keys: torch.Tensor) -> torch.Tensor:
        """The routing bucket of each key: int64 of ``keys``' shape, in [0, num_buckets)."""
        return routing_bucket(keys, self.num_buckets, self.seed)

    def key_order(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The permutation that sorts ``keys`` by (routing bucket, key), and the number of keys
        in each bucket ([num_buckets] int64)."""
        by_key = torch.sort(keys, stable=True).indices
        buckets = self.buckets(keys[by_key])
        by_bucket = torch.sort(buckets, stable=True).indices
        counts = torch.bincount(buckets, minlength=self.num_buckets)
        return by_key[by_bucket], counts

    def owners(self, parts: int, device: torch.device | None = None) -> torch.Tensor:
        """[num_buckets] int64: the part owning each bucket, of ``parts`` parts.

        Raises:
            ValueError: more parts than buckets (a part would own none)."""
        if not 1 <= parts <= self.num_buckets:
            raise ValueError(
                f"a dynamic table with routing_buckets={self.num_buckets} cannot be split into "
                f"{parts} parts; expected 1..{self.num_buckets} (raise routing_buckets)"
            )
        owner = torch.empty(self.num_buckets, dtype=torch.int64, device=device)
        for part, (lo, hi) in enumerate(bucket_ranges(self.num_buckets, parts)):
            owner[lo:hi] = part
        return owner

    def describe(self) -> dict[str, object]:
        """What a checkpoint records of the routing (compared when it is loaded)."""
        return {
            "routing": ROUTING_FUNCTION,
            "routing_seed": self.seed,
            "routing_buckets": self.num_buckets,
        }


def routing_bucket(
    keys: torch.Tensor, num_buckets: int | torch.Tensor, seed: int = ROUTING_SEED
) -> torch.Tensor:
    """``(hash_keys(keys, seed) >>> 1) mod num_buckets``; ``num_buckets`` may be a tensor of
    ``keys``' shape (keys of several tables at once)."""
    hashed = hash_keys(keys, seed)
    return ((hashed >> 1) & ((1 << 63) - 1)) % num_buckets


def encode_layout(layout: dict[str, object]) -> torch.Tensor:
    """A checkpoint's description of a table's layout (routing, score policy) as a uint8
    tensor of its JSON text, so it travels with the tensors."""
    return torch.tensor(list(json.dumps(layout, sort_keys=True).encode()), dtype=torch.uint8)


def decode_layout(tensor: torch.Tensor) -> dict[str, object]:
    """The layout :func:`encode_layout` wrote."""
    return json.loads(bytes(tensor.cpu().tolist()).decode())
