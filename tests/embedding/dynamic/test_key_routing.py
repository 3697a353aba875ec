"""Routing a dynamic table's keys into global buckets, each part owning a contiguous range."""

import itertools
import math

import pytest
import torch

from recsys.embedding.dynamic.key_routing import (
    KeyRouting,
    bucket_ranges,
    decode_layout,
    encode_layout,
    routing_bucket,
)
from recsys.ops.slot_map.hash_map import hash_keys


def test_routing_spreads_patterned_keys_and_moves_whole_buckets():
    routing = KeyRouting(64)
    keys = torch.arange(0, 64 * 1000, 64)  # every key == 0 mod 64 (and mod any world size)
    per_rank = torch.bincount(routing.owners(4)[routing.buckets(keys)], minlength=4).float()
    assert per_rank.max() / per_rank.mean() < 1.15
    # 2 -> 4 ranks: each new part's buckets lie inside one old part's range.
    two, four = routing.owners(2), routing.owners(4)
    for bucket in range(64):
        assert two[bucket] == four[bucket] // 2
    with pytest.raises(ValueError, match="routing_buckets=64 cannot be split into 65 parts"):
        routing.owners(65)
    assert math.isclose(float(per_rank.sum()), 1000.0)


def test_the_bucket_is_the_seeded_hash_and_independent_of_the_slot_map_hash():
    keys = torch.tensor([-(2**63) + 2, -1, 0, 1, 2**62, 12345])
    routing = KeyRouting(4096)
    expected = [(int(h) % 2**64 >> 1) % 4096 for h in hash_keys(keys, routing.seed)]
    assert routing.buckets(keys).tolist() == expected
    per_feature = routing_bucket(keys, torch.tensor([7, 7, 7, 4096, 4096, 4096]))
    assert per_feature[3:].tolist() == expected[3:]
    assert not torch.equal(routing.buckets(keys), KeyRouting(4096, seed=0).buckets(keys))


def test_key_order_sorts_by_bucket_then_key_and_counts_keys_per_bucket():
    routing = KeyRouting(8)
    keys = torch.randint(-(2**62), 2**62, (500,), generator=torch.Generator().manual_seed(0))
    order, counts = routing.key_order(keys)
    ordered = keys[order]
    pairs = list(zip(routing.buckets(ordered).tolist(), ordered.tolist(), strict=True))
    assert pairs == sorted(pairs)
    assert counts.tolist() == torch.bincount(routing.buckets(keys), minlength=8).tolist()


def test_ranges_cover_every_bucket_once_and_layouts_round_trip():
    for buckets, parts in [(16, 3), (4096, 7), (5, 5)]:
        ranges = bucket_ranges(buckets, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == buckets
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    layout = {**KeyRouting(64).describe(), "score": "lru"}
    assert decode_layout(encode_layout(layout)) == layout
    with pytest.raises(ValueError, match="routing_buckets=0; expected >= 1"):
        KeyRouting(0)
