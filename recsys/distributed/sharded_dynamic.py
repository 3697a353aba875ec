"""A sharded collection's KEY_WISE (dynamic) tables in the logical layout: the state a
single-process :class:`~recsys.embedding.dynamic.collection.DynamicEmbeddingBagCollection` saves,
whatever the number of ranks.

A dynamic table saves its keys' rows ordered by (routing bucket, key), with the number of keys
per routing bucket (``dynamic.<t>.bucket_counts``; see :mod:`recsys.embedding.dynamic.key_routing`).
Shard j of a KEY_WISE table owns a contiguous range of routing buckets, so its keys are one
contiguous range of those rows:

- per-key tensors (rows, optimizer state, ``keys``, ``scores``, ``last_seen``; the admission
  counter's ``admission_keys`` / ``admission_counts`` by ``admission_bucket_counts``) are
  ShardedTensors of all the table's keys whose shard j is rank j's range, so
  torch.distributed.checkpoint writes each rank's keys from that rank, and a job of another
  size reads, on each rank, the range its own bucket ranges cover;
- per-bucket counts are ShardedTensors of ``[routing_buckets]``, shard j its bucket range;
- per-part counts (``num_buckets``, ``admission_buckets``: the size of each rank's map) are
  ShardedTensors ``[P]``, one element per shard; loaded on the same number of ranks each rank
  takes its own, on another number each takes an even share of their sum;
- ``layout`` (routing function, seed, bucket count, score policy) is the same on every rank,
  and loading a checkpoint of another layout is a ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)

from recsys.distributed.sharded_state import ShardedCollection
from recsys.embedding.dynamic.key_routing import KeyRouting, bucket_ranges, decode_layout
from recsys.embedding.dynamic.mixin import DYNAMIC
from recsys.embedding.dynamic.table import KEYED, PER_BUCKET, PER_PART
from recsys.embedding.interface import TABLES, UNPOOLED_TABLES, SavedState

ROWS = "bucket_counts"  # the counts that split a table's rows (and its keys)
# Per-bucket counts -> the per-key tensor whose length they sum to.
COUNTED = {counts: key for key, counts in KEYED.items() if key.endswith("keys")}


def counts_of(key: str) -> str | None:
    """The per-bucket counts that split state entry ``key`` (relative to the collection) over
    parts: ``bucket_counts`` for the rows and key state, ``admission_bucket_counts`` for the
    admission counter's; None for an entry that is not per key."""
    kind, _, name = key.split(".")
    if kind in (TABLES, UNPOOLED_TABLES):
        return ROWS
    return KEYED.get(name)


def outer_key(sharded: ShardedCollection, key: str) -> str:
    """A key of this rank's shards (a pooled collection: ``embedding_bags.<t>.<x>``) as the
    sharded collection names it (an unpooled one: ``embeddings.<t>.<x>``)."""
    head, _, rest = key.partition(".")
    return f"{sharded.tables_key}.{rest}" if head == TABLES else key


def pooled_key(key: str) -> str:
    """An unpooled collection's state key as its pooled twin (its shards) names it
    (``embeddings.<table>.<x>`` -> ``embedding_bags.<table>.<x>``; other keys unchanged): the
    inverse of :func:`outer_key`."""
    head, _, rest = key.partition(".")
    return f"{TABLES}.{rest}" if head == UNPOOLED_TABLES and rest else key


def table_state_keys(sharded: ShardedCollection, name: str) -> list[str]:
    """KEY_WISE table ``name``'s state keys, as the sharded collection names them."""
    return [outer_key(sharded, key) for key in sharded.shards.table_state_keys(name)]


def _row_sharded(
    sharded: ShardedCollection,
    table: str,
    local: torch.Tensor,
    part_rows: list[int],
) -> torch.Tensor:
    """One ShardedTensor of ``sum(part_rows)`` rows (trailing dims as ``local``'s) whose shard j
    is rows ``[sum(part_rows[:j]), ...)`` on shard j's rank, ``local`` being this rank's; a
    plain tensor when no shard holds a row."""
    total, trailing = sum(part_rows), list(local.shape[1:])
    if total == 0:
        return local
    ranks, device = sharded.plan[table].ranks, local.device
    metadata, mine, offset = [], None, 0
    for rank, rows in zip(ranks, part_rows, strict=True):
        if rows:
            placement = f"rank:{rank}/{device.type}"
            if device.type == "cuda":
                placement = f"rank:{rank}/cuda:{torch.cuda.current_device()}"
            meta = ShardMetadata(
                shard_offsets=[offset] + [0] * len(trailing),
                shard_sizes=[rows, *trailing],
                placement=placement,
            )
            metadata.append(meta)
            if rank == sharded.rank:
                mine = meta
        offset += rows
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False)
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metadata,
        size=torch.Size([total, *trailing]),
        tensor_properties=properties,
    )
    shards = [LocalShard(local.contiguous(), mine)] if mine is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, global_metadata, process_group=sharded.process_group
    )


def key_wise_state(sharded: ShardedCollection, prefix: str) -> dict[str, Any]:
    """Every KEY_WISE table's logical state (see the module docstring), keys under ``prefix``.
    A collective: every rank learns how many keys the others hold."""
    tables = sharded.key_wise_tables()
    if not tables:
        return {}
    local = {
        name: {outer_key(sharded, k): v for k, v in sharded.shards.table_state(name).items()}
        for name in tables
    }
    counted = [(t, k) for t in tables for k in COUNTED.values() if _key(t, k) in local[t]]
    sizes = _all_gather_sizes(sharded, [len(local[t][_key(t, k)]) for t, k in counted])
    rows = {
        (t, k): [sizes[r][i] for r in sharded.plan[t].ranks] for i, (t, k) in enumerate(counted)
    }
    out: dict[str, Any] = {}
    for name in tables:
        j, parts = _part(sharded, name)
        ranges = bucket_ranges(sharded.routing_of(name).num_buckets, parts)
        lo, hi = ranges[j]
        for key, value in local[name].items():
            short, counts = key.split(".")[2], counts_of(key)
            if counts is not None:
                value = _row_sharded(sharded, name, value, rows[name, COUNTED[counts]])
            elif short in PER_BUCKET:
                value = _row_sharded(sharded, name, value[lo:hi], [b - a for a, b in ranges])
            elif short in PER_PART:
                value = _row_sharded(sharded, name, value, [1] * parts)
            out[prefix + key] = value
    return out


def key_wise_targets(
    sharded: ShardedCollection, state: dict[str, Any], saved: SavedState, prefix: str
) -> None:
    """Make ``state`` ready to load a checkpoint's KEY_WISE tables: per-key entries become
    ShardedTensors of the saved key counts whose local shard is the range of rows this rank's
    routing buckets cover (read ahead from the checkpoint's per-bucket counts); the small
    per-bucket / per-part / layout entries are read whole. Entries the checkpoint lacks are
    dropped."""
    for name in sharded.key_wise_tables():
        keys = table_state_keys(sharded, name)
        present = [k for k in keys if saved.shape(k) is not None]
        for key in set(keys) - set(present):
            state.pop(prefix + key, None)
        if _key(name, "keys") not in present:
            continue
        if saved.read is None:
            raise ValueError(f"dynamic table '{name}' is sharded: loading it needs a reader")
        if _key(name, ROWS) not in present:
            raise ValueError(
                f"dynamic table '{name}': the checkpoint has no keys per routing bucket (saved "
                "before tables could be sharded); load it in one process and save it again"
            )
        small = [k for k in present if counts_of(k) is None]
        read = saved.read([saved.prefix + k for k in small])
        values = {k: read[saved.prefix + k] for k in small}
        layout = values.get(_key(name, "layout"))
        if layout is not None:
            sharded.shards.dynamic[name].check_layout(decode_layout(layout))
        j, parts = _part(sharded, name)
        ranges = bucket_ranges(sharded.routing_of(name).num_buckets, parts)
        for key in present:
            counts = counts_of(key)
            if counts is None:
                state[prefix + key] = values[key]
                continue
            per_bucket = values[_key(name, counts)]
            part_rows = [int(per_bucket[a:b].sum()) for a, b in ranges]
            shape = [part_rows[j], *saved.shape(key)[1:]]
            local = torch.empty(shape, dtype=state[prefix + key].dtype, device=sharded.device)
            state[prefix + key] = _row_sharded(sharded, name, local, part_rows)


def load_key_wise(sharded: ShardedCollection, name: str, entries: dict[str, Any]) -> None:
    """Load KEY_WISE table ``name`` from its logical entries (keys relative to the collection):
    ShardedTensors whose local shard is this rank's keys (from :func:`key_wise_targets` or
    another sharded collection of the same plan), or whole tensors (a one-process state
    dict), of which this rank takes its routing buckets' range.

    Raises:
        ValueError: a key this rank does not own (the rows are not in routing order)."""
    j, parts = _part(sharded, name)
    routing = sharded.routing_of(name)
    lo, hi = bucket_ranges(routing.num_buckets, parts)[j]
    local = {}
    for key, value in entries.items():
        short, counts = key.split(".")[2], counts_of(key)
        if isinstance(value, ShardedTensor):
            pieces = value.local_shards()
            dtype = value.metadata().tensor_properties.dtype
            value = pieces[0].tensor if pieces else torch.empty(0, *value.size()[1:], dtype=dtype)
        elif counts is not None:  # the whole table: this rank's range of rows
            per_bucket = torch.as_tensor(entries[_key(name, counts)])
            start, count = int(per_bucket[:lo].sum()), int(per_bucket[lo:hi].sum())
            value = value[start : start + count]
        elif short in PER_PART and len(value) != parts:
            value = torch.tensor([math.ceil(int(value.sum()) / parts)], dtype=torch.int64)
        elif short in PER_PART:
            value = value[j : j + 1]
        local[pooled_key(key)] = value
    keys = local.get(_key(name, "keys"))
    if keys is not None and len(keys):
        owners = routing.owners(parts, keys.device)[routing.buckets(keys)]
        if bool((owners != j).any()):
            raise ValueError(
                f"dynamic table '{name}': the checkpoint gives rank {sharded.rank} keys of "
                "routing buckets it does not own; its rows are not in routing order"
            )
    sharded.shards.load_table_state(name, local)


def key_wise_stats(sharded: ShardedCollection) -> dict[str, dict[str, float]]:
    """Per KEY_WISE table, its counters summed over ranks, ``load_factor`` of the sums, and
    the key balance: ``size_max_over_mean`` and ``size_rank<r>``. A collective."""
    tables = sharded.key_wise_tables()
    if not tables:
        return {}
    local = sharded.shards.dynamic_stats()
    names = sorted({name for table in tables for name in local[table]})
    mine = [float(local[t].get(name, 0.0)) for t in tables for name in names]
    gathered = torch.tensor(mine, dtype=torch.float64, device=sharded.device)
    out_list = [torch.empty_like(gathered) for _ in range(sharded.world_size)]
    dist.all_gather(out_list, gathered, group=sharded.process_group)
    per_rank = torch.stack(out_list).view(sharded.world_size, len(tables), len(names)).cpu()
    out = {}
    for t, table in enumerate(tables):
        totals = dict(zip(names, per_rank[:, t].sum(dim=0).tolist(), strict=True))
        sizes = per_rank[:, t, names.index("size")]
        totals["load_factor"] = totals["size"] / max(totals["capacity"], 1.0)
        totals["size_max_over_mean"] = float(sizes.max() / sizes.mean().clamp(min=1e-9))
        totals.update({f"size_rank{r}": float(n) for r, n in enumerate(sizes.tolist())})
        out[table] = totals
    return out


def gathered_keys(sharded: ShardedCollection, name: str) -> torch.Tensor:
    """[n] int64, ascending: every key KEY_WISE table ``name`` holds, on any rank: each rank's
    own keys (``live_keys`` of its part), all-gathered (their counts, then the keys padded to
    the longest). The same tensor on every rank, and the one process's ``live_keys`` after the
    same training; a collective. Costs one all-gather of the table's keys (8 bytes a key), so
    a caller that needs them every step (a sequence model's uniform negatives, drawn from its
    item corpus) pays that per step."""
    mine = sharded.shards.live_keys(name)
    if mine is None:
        raise ValueError(f"table '{name}' holds no keys of its own (not a dynamic table)")
    mine = mine.to(sharded.device)
    sizes = [s[0] for s in _all_gather_sizes(sharded, [mine.numel()])]
    padded = torch.zeros(max(1, *sizes), dtype=mine.dtype, device=mine.device)
    padded[: mine.numel()] = mine
    out = [torch.empty_like(padded) for _ in range(sharded.world_size)]
    dist.all_gather(out, padded, group=sharded.process_group)
    keys = torch.cat([keys[:size] for keys, size in zip(out, sizes, strict=True)])
    return keys.sort().values


def _key(table: str, name: str) -> str:
    return f"{DYNAMIC}.{table}.{name}"


def _part(sharded: ShardedCollection, table: str) -> tuple[int, int]:
    """(this rank's shard index, the number of shards) of KEY_WISE ``table``."""
    ranks = sharded.plan[table].ranks
    return ranks.index(sharded.rank), len(ranks)


def _all_gather_sizes(sharded: ShardedCollection, sizes: list[int]) -> list[list]:
    """Every rank's ``sizes`` (the same length on every rank), by rank."""
    mine = torch.tensor(sizes, dtype=torch.int64, device=sharded.device)
    out = [torch.empty_like(mine) for _ in range(sharded.world_size)]
    dist.all_gather(out, mine, group=sharded.process_group)
    return [t.tolist() for t in out]


def owner_test(
    routing: KeyRouting, parts: int, part: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function marking the keys of a KEY_WISE table that shard ``part`` of ``parts`` holds."""

    def owns(keys: torch.Tensor) -> torch.Tensor:
        return routing.owners(parts, keys.device)[routing.buckets(keys)] == part

    return owns
