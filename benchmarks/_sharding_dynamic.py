"""The dynamic-table case of ``benchmarks/sharding.py`` (``--shardings key_wise``): the 26 tables as
dynamic tables keyed by raw 64-bit keys, sharded KEY_WISE over the ranks, against the same
dynamic collection stepping the global batch in one process, and TorchRec's managed-collision
collection under DMP.

- **Keys.** Id n of feature f (the Zipf ids of ``_sharding_setup.make_batch``) becomes the key
  ``hash_keys(f * 2**40 + n, KEY_SEED)``: splitmix64's finalizer, a bijection of int64, so the
  keys spread over the whole int64 range (negative ones included) like hashed raw features,
  and nothing of the ids' order reaches the routing. ``KEY_SEED`` is neither the routing's
  seed nor the slot map's.
- **Tables.** A :class:`~recsys.embedding.dynamic.collection.DynamicEmbeddingBagCollection` of the
  recipe's tables, every table dynamic with ``DynamicTableOptions()``'s defaults (no cap: a
  table grows to keep its load under 0.75; buckets of 32 slots; 4096 routing buckets), starting
  with the table's cardinality in rows, fresh rows seeded by ``--seed``, Adagrad fused into
  backward as for the fixed tables.
- **recsys_sharded** ``key_wise``: ``ShardedEmbeddingBagCollection`` of that collection with
  every table ``key_wise`` over all ranks (a key's rank is its routing bucket's owner).
  **single_process** (dynamic): the same collection stepping the global batch in one process.
- **Steady state.** Before timing, the warmup runs ``max(--warmup, 4)`` steps, so every one of
  the 4 cycled global batches has run once and every key has its row: the timed steps are all
  hits. The notes say how many keys the timed steps inserted or evicted (0 expected).
- **Key balance** (notes): the keys each rank holds, summed over the tables, their max / mean,
  the table whose max / mean is worst, and the distinct keys of the batches.
- **torchrec_mch_dmp**: ``ManagedCollisionEmbeddingBagCollection`` with one
  ``MCHManagedCollisionModule(zch_size, LRU_EvictionPolicy(), eviction_interval=1)`` per table
  (``zch_size``: max(2, W) x the cardinality, so that each rank's shard could hold every id
  of the table), under ``DistributedModelParallel``: ROW_WISE with the FUSED kernel (the only
  sharding TorchRec's managed-collision sharder has; TorchRec's embedding-bag sharder offers
  ROW_WISE on CUDA only, so the plan forces it, as for the fixed row-wise case), Adagrad in
  backward (FBGEMM's EXACT_ADAGRAD), comms by ``QCommsConfig``.
  TorchRec routes a key by FBGEMM's block bucketization: a non-negative key by its value range
  (``key // ceil((2**63 - 1) / W)``), a negative one by ``(uint64) key mod W``. A key reads the
  row of the slot MCH gives it (whatever that slot was initialized to), not a row of (seed,
  table, key), so its outputs cannot be compared with recsys's: it is checked only to train.
  MCH sizes its id history at 1.25x the ids of the first batch it profiles and silently drops
  the ids past that in any later batch (they never get a slot), so its first forward is on all
  of the rank's batches at once; then it holds every key, as recsys does. Its key counts are
  the ids each rank's MCH modules hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._harness import load_note, time_fn
from benchmarks._sharding_setup import (
    EPS,
    LR,
    NUM_BATCHES,
    RECSYS,
    Batch,
    Provider,
    Setup,
    build_on_every_rank,
    check_forward,
    count_kinds,
    inputs,
    kjt_rows,
    make_step,
    recsys_provider,
    table_configs,
)
from benchmarks._sharding_torchrec import output_columns
from recsys import EmbeddingBagConfig, KeyedJaggedTensor  # recsys quiets torchrec's import
from recsys.distributed.plan import ShardingType, key_wise
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import Adagrad
from recsys.ops.slot_map.hash_map import check_keys, hash_keys

MCH = "torchrec_mch_dmp"
KEY_SEED = 0xD1B54A32D192ED03  # any constant but the routing's and the slot map's seeds
FEATURE_SHIFT = 40  # ids below 2**40 per feature

KeyStats = dict[str, Any]  # keys per rank, worst table, inserts / evictions so far


def zch_factor(world: int) -> int:
    """MCH slots per id of a table: W x, so each rank's row-wise shard of the slots could hold
    every id of the table (MCH's routing is uneven on small tables; a full shard evicts), and
    at least 2x."""
    return max(2, world)


def raw_keys(batches: list[Batch]) -> list[Batch]:
    """The batches with id n of feature f replaced by ``hash_keys(f * 2**40 + n, KEY_SEED)``."""
    out = []
    for batch in batches:
        features = []
        for f, (lengths, ids) in enumerate(batch):
            keys = hash_keys(ids + (f << FEATURE_SHIFT), KEY_SEED)
            check_keys(keys, f"keys of feature f{f}")  # no key the map reserves
            features.append((lengths, keys))
        out.append(features)
    return out


def distinct_keys(batches: list[Batch]) -> int:
    """Distinct keys over all batches, summed over the features (one table each)."""
    return sum(
        len(torch.unique(torch.cat([batch[f][1] for batch in batches])))
        for f in range(len(batches[0]))
    )


def dynamic_collection(setup: Setup, device: torch.device) -> DynamicEmbeddingBagCollection:
    """The recipe's tables, every one dynamic (no cap), identical in every process."""
    return DynamicEmbeddingBagCollection(
        table_configs(setup),
        DynamicTableOptions(),
        device=device,
        seed=setup.seed,
        optimizer=Adagrad(lr=LR, eps=EPS),
    )


def warmup_steps(setup: Setup) -> int:
    """Enough untimed steps for every cycled batch to run once (all keys inserted)."""
    return max(setup.warmup, NUM_BATCHES)


def recsys_key_stats(
    module: DynamicEmbeddingBagCollection | ShardedEmbeddingBagCollection, ranks: int
) -> KeyStats:
    """The keys each of ``ranks`` ranks holds (summed over tables), the table with the worst
    max / mean, and the inserts and evictions so far (summed over tables and ranks). A
    collective on a sharded collection."""
    tables = module.dynamic_stats()
    sizes = {
        t: [int(s[f"size_rank{r}"]) for r in range(ranks)] if ranks > 1 else [int(s["size"])]
        for t, s in tables.items()
    }
    return {
        "keys": [sum(per_rank[r] for per_rank in sizes.values()) for r in range(ranks)],
        "worst": worst_table(sizes),
        "inserts": int(sum(s["inserts"] for s in tables.values())),
        "evictions": int(sum(s["evictions"] + s["expirations"] for s in tables.values())),
    }


def worst_table(sizes: dict[str, list[int]]) -> tuple[str, float, int]:
    """(table, its max / mean keys per rank, its keys) of the least balanced table."""
    ratio = {t: max(n) / max(sum(n) / len(n), 1e-9) for t, n in sizes.items()}
    table = max(sizes, key=lambda t: (ratio[t], t))
    return table, ratio[table], sum(sizes[table])


def balance_note(warm: KeyStats, after: KeyStats, warmup: int) -> str:
    """The notes' key balance and steady-state check (keys summed over tables), from the key
    stats after the ``warmup`` steps and after the timed steps."""
    keys, distinct = after["keys"], after["distinct"]
    held = f"(summed over tables; {distinct} distinct keys in the batches)"
    if len(keys) == 1:
        notes = [f"keys {keys[0]} {held}"]
    else:
        ratio = max(keys) / max(sum(keys) / len(keys), 1e-9)
        table, table_ratio, table_keys = after["worst"]
        notes = [
            f"keys/rank {','.join(map(str, keys))} {held} max/mean {ratio:.3f}, "
            f"worst table {table} {table_ratio:.2f} ({table_keys} keys)"
        ]
    if after.get("inserts") is not None:
        inserts = after["inserts"] - warm["inserts"]
        evictions = after["evictions"] - warm["evictions"]
        notes.append(f"timed steps inserted {inserts} keys, evicted {evictions}")
    else:
        notes.append(f"held keys/rank after warmup {','.join(map(str, warm['keys']))}")
    notes.append(f"warmup {warmup} steps: every batch once, so timed steps are all hits")
    return "; ".join(notes)


# ---------------------------------------------------------------------------------------------
# Phase 1: the dynamic collection on the global batch, in this process


def time_single_dynamic(setup: Setup, device: torch.device) -> dict:
    """Time the unsharded dynamic collection stepping the global batch (raw keys)."""
    batches, upstream = inputs(setup)
    batches = raw_keys(batches)
    ebc = dynamic_collection(setup, device)
    kjts = [kjt_rows(batch, 0, setup.global_batch).to(device) for batch in batches]
    step = make_step(lambda kjt: ebc(kjt).values(), kjts, upstream.to(device))
    for _ in range(warmup_steps(setup)):
        step()
    stats = _with_distinct(lambda: recsys_key_stats(ebc, 1), distinct_keys(batches))
    warm = stats()
    timing = time_fn(
        step, device, warmup=0, repeats=setup.steps, min_time_s=0, max_repeats=setup.steps
    )
    balance = balance_note(warm, stats(), warmup_steps(setup))
    note = (
        f"{load_note()}; unsharded DynamicEmbeddingBagCollection (no cap), "
        f"{torch.get_num_threads()} threads; no communication; {balance}"
    )
    return {"timing": dataclasses.asdict(timing), "note": note, "dynamic": True}


# ---------------------------------------------------------------------------------------------
# Phase 2: the ranks


def key_wise_group(
    setup: Setup, batches: list[Batch], upstream: torch.Tensor, rank: int, device: torch.device
) -> tuple[
    dict[tuple[str, str], Provider], dict[tuple[str, str], str], KeyedJaggedTensor, torch.Tensor
]:
    """The providers of the dynamic case on this rank, their forward checked; the (provider,
    precision) pairs that did not build, with the reason; and the check batch (this rank's
    part of the first batch) with the unsharded dynamic collection's output on it.

    Args:
        batches: the global batches of ids (:func:`_sharding_setup.inputs`).
        upstream: this rank's rows of the upstream gradient.
    """
    batches = raw_keys(batches)
    distinct = distinct_keys(batches)
    mine = slice(rank * setup.batch_size, (rank + 1) * setup.batch_size)
    kjts = [kjt_rows(batch, mine.start, mine.stop).to(device) for batch in batches]
    with torch.no_grad():  # a training forward: inserts the first batch's keys
        full = kjt_rows(batches[0], 0, setup.global_batch).to(device)
        expected = dynamic_collection(setup, device)(full).values()[mine]
    unsharded = dynamic_collection(setup, torch.device("cpu"))
    world, tables = setup.world_size, unsharded.embedding_bag_configs()
    plan = {t.name: key_wise(t.num_embeddings, t.embedding_dim, range(world)) for t in tables}
    kinds = count_kinds([ShardingType(s.sharding_type).name for s in plan.values()])
    providers, failed = {}, {}
    for precision in setup.precisions:
        provider = recsys_provider(
            unsharded,
            plan,
            precision,
            kjts,
            upstream,
            device,
            note=f"{kinds}, {DynamicTableOptions().routing_buckets} routing buckets, no cap",
            key_stats=lambda sharded: recsys_key_stats(sharded, world),
        )
        check_forward(provider, kjts[0], expected, precision)
        providers[(RECSYS, precision)] = provider
    if setup.torchrec:
        providers, failed = mch_group(setup, kjts, upstream, device, providers)
    for provider in providers.values():
        provider.key_stats = _with_distinct(provider.key_stats, distinct)
    return providers, failed, kjts[0], expected


def _with_distinct(stats: Callable[[], KeyStats], distinct: int) -> Callable[[], KeyStats]:
    """``stats`` with the batches' distinct keys added (for :func:`balance_note`)."""
    return lambda: stats() | {"distinct": distinct}


# ---------------------------------------------------------------------------------------------
# The TorchRec peer: ManagedCollisionEmbeddingBagCollection under DMP


def mch_group(
    setup: Setup,
    kjts: list[KeyedJaggedTensor],
    upstream: torch.Tensor,
    device: torch.device,
    providers: dict[tuple[str, str], Provider],
) -> tuple[dict[tuple[str, str], Provider], dict[tuple[str, str], str]]:
    """``providers`` with the TorchRec peer of every precision that builds on every rank
    added, and the precisions that did not, with the reason."""
    providers, failed = dict(providers), {}
    for precision in setup.precisions:
        if precision == "bf16" and device.type == "cpu":
            failed[(MCH, precision)] = "skipped: on gloo TorchRec sends bf16 as fp16"
            continue
        provider, error = build_on_every_rank(
            lambda precision=precision: torchrec_mch(setup, precision, kjts, upstream, device),
            setup.world_size,
        )
        if error:
            failed[(MCH, precision)] = error
        else:
            providers[(MCH, precision)] = provider
    return providers, failed


def torchrec_mch(
    setup: Setup,
    precision: str,
    kjts: list[KeyedJaggedTensor],
    upstream: torch.Tensor,
    device: torch.device,
) -> Provider:
    """TorchRec's managed-collision collection of the recipe's tables under DMP (ROW_WISE,
    FUSED), with its check-batch output before training as ``initial`` and
    :func:`mch_key_stats` as ``key_stats``."""
    dmp, tables = mch_model(setup, precision, device)
    forward = lambda kjt: dmp(kjt)[0].values()  # noqa: E731  (pooled, remapped ids: None)
    with torch.no_grad():  # training forwards: MCH takes the keys
        # MCH sizes its id history at 1.25x the ids of the first batch it sees and drops the
        # ids past that of any later batch (never admitting them): all batches at once first.
        dmp(stacked(kjts))
        first = dmp(kjts[0])[0]
    columns = output_columns(first, tables)
    # The same upstream gradient, in TorchRec's column order.
    step = make_step(forward, kjts, upstream[:, columns.to(upstream.device)])
    forced = " forced by the plan (TorchRec's sharder offers it on CUDA only)"
    note = (
        f"ROW_WISE/FUSED x{len(tables)}{forced if device.type == 'cpu' else ''}; MCH "
        f"zch_size={zch_factor(setup.world_size)}x cardinality, LRU, eviction_interval=1, "
        "first forward on all batches (its id history is sized by it); rows not comparable "
        "with recsys's (a key takes its slot's row)"
    )
    return Provider(
        forward,
        step,
        columns=columns,
        note=note,
        initial=first.values().detach(),
        key_stats=lambda: mch_key_stats(dmp, setup.world_size),
    )


def mch_model(
    setup: Setup, precision: str, device: torch.device
) -> tuple[torch.nn.Module, list[EmbeddingBagConfig]]:
    """``ManagedCollisionEmbeddingBagCollection`` (one MCH module per table) under DMP,
    ROW_WISE / FUSED, Adagrad in backward, comms in ``precision``; and its table configs."""
    import torchrec
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed import sharding_plan as tp
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )
    from torchrec.optim import apply_optimizer_in_backward

    meta, world = torch.device("meta"), setup.world_size
    tables = [  # MCH's slots are the table's rows
        dataclasses.replace(t, num_embeddings=zch_factor(world) * t.num_embeddings)
        for t in table_configs(setup)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables, device=meta)
    maps = {
        t.name: MCHManagedCollisionModule(
            zch_size=t.num_embeddings,
            device=meta,
            eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=1,
        )
        for t in tables
    }
    model = ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection(maps, tables))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": LR, "eps": EPS})
    comm = CommType(precision)
    registry = get_qcomm_codecs_registry(QCommsConfig(comm, comm), device=device)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry),
        ManagedCollisionCollectionSharder(),
        qcomm_codecs_registry=registry,
    )
    module_plan = tp.construct_module_sharding_plan(
        model,
        {t.name: tp.row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for t in tables},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type=device.type,
    )
    plan = ShardingPlan({"": module_plan})
    return DistributedModelParallel(model, device=device, sharders=[sharder], plan=plan), tables


def stacked(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The samples of all ``kjts`` (the same keys) in one KJT, one batch after the other."""
    parts, keys = [kjt.to_dict() for kjt in kjts], kjts[0].keys()
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([part[k].values() for k in keys for part in parts]),
        lengths=torch.cat([part[k].lengths() for k in keys for part in parts]),
    )


def mch_key_stats(model: torch.nn.Module, ranks: int) -> KeyStats:
    """The ids every rank's MCH modules hold (summed over tables) and the worst table. A
    collective."""
    empty = torch.iinfo(torch.int64).max
    held = {
        name.split(".")[-2]: int((ids != empty).sum())
        for name, ids in model.named_buffers()
        if name.endswith("_mch_sorted_raw_ids")
    }
    per_rank: list[dict[str, int]] = [{} for _ in range(ranks)]
    dist.all_gather_object(per_rank, held)
    sizes = {t: [rank[t] for rank in per_rank] for t in held}
    keys = [sum(rank.values()) for rank in per_rank]
    return {"keys": keys, "worst": worst_table(sizes), "inserts": None}
