"""Tiered tables (host / disk) of a ShardedEmbeddingBagCollection on 2 gloo ranks, built on the
meta device: every step's output equals the same tables held in memory and sharded the same
way (bitwise: a tiered row starts from the same (seed, table, row or key) value and moves
exactly), with caches small enough to evict and the rows prefetched one batch ahead; and a
checkpoint of the tiered rows (one part per shard) loads under another plan and in one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsys.distributed import planner as P
from recsys.distributed.shard_build import checked_plan
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.dynamic.collection import DynamicEmbeddingBagCollection
from recsys.embedding.dynamic.table import DynamicTableOptions
from recsys.embedding.optim import Adagrad, RowWiseAdagrad
from recsys.embedding.tiered.collection import TieredEmbeddingBagCollection
from recsys.embedding.tiered.options import StorageOptions
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import rows_of

# name, dim, rows, features, pooling: a fixed table read by two features, a mean-pooled fixed
# one, and a dynamic one (raw int64 keys).
TABLES = [
    ("f", 4, 400, ["a", "b"], PoolingType.SUM),
    ("g", 6, 300, ["c"], PoolingType.MEAN),
    ("k", 5, 16, ["d"], PoolingType.SUM),
]
FEATURES = ["a", "b", "c", "d"]
DYNAMIC = {"k": DynamicTableOptions(routing_buckets=16, bucket_size=4)}
SEED = 11
CACHE_ROWS = 64  # per rank and table: >= 2 batches' rows (a batch reads up to 48 of a table)


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(fs), pooling=pool
        )
        for name, dim, rows, fs, pool in TABLES
    ]


def plan(world: int, fixed: str) -> dict[str, P.TableSharding]:
    """``fixed``: "rw" (both fixed tables ROW_WISE) or "tw" (TABLE_WISE on ranks 1 and 0)."""
    out = {"k": P.key_wise(16, 5, range(world))}
    for i, (name, dim, rows, _, _) in enumerate(TABLES[:2]):
        out[name] = (
            P.row_wise(rows, dim, world)
            if fixed == "rw"
            else P.table_wise(rows, dim, (i + 1) % world)
        )
    return out


def batch(step: int, size: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 3, (len(FEATURES), size), generator=g)
    values = []
    for name, n in zip(FEATURES, lengths.sum(1).tolist(), strict=True):
        rows = {"a": 400, "b": 400, "c": 300}.get(name)
        ids = (
            torch.randint(0, rows, (n,), generator=g)
            if rows
            else torch.randint(-50, 50, (n,), generator=g) * 7919
        )
        values.append(ids)
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths.reshape(-1))


def tiered(optimizer, tier: str, path: Path, world: int, fixed: str, device: str = "meta"):
    module = TieredEmbeddingBagCollection(
        configs(),
        StorageOptions(tier=tier, cache_rows=CACHE_ROWS, path=str(path)),
        optimizer,
        dict(DYNAMIC),
        device=device,
        seed=SEED,
    )
    if device != "meta":
        return module
    return ShardedEmbeddingBagCollection(module, plan(world, fixed), device=torch.device("cpu"))


def in_memory(optimizer, world: int, fixed: str) -> ShardedEmbeddingBagCollection:
    module = DynamicEmbeddingBagCollection(
        configs(), dict(DYNAMIC), device="meta", seed=SEED, optimizer=optimizer
    )
    return ShardedEmbeddingBagCollection(
        module, plan(world, fixed), device=torch.device("cpu"), seed=SEED
    )


def train(collection, rank: int, world: int, steps: range, prefetch: bool) -> list[torch.Tensor]:
    """This rank's outputs of ``steps`` (a global batch of 6 per rank), the sum of squares as the
    loss; with ``prefetch``, step i+1's rows are prefetched before step i trains."""
    size = 6

    def mine(step: int) -> KeyedJaggedTensor:
        return rows_of(batch(step, size * world), rank * size, (rank + 1) * size)

    inputs = {step: mine(step) for step in [*steps, steps.stop]}
    outs = []
    if prefetch:
        collection.prefetch(inputs[steps.start])
    for step in steps:
        if prefetch and step + 1 < steps.stop:
            collection.prefetch(inputs[step + 1])
        out = collection(inputs[step]).values()
        out.pow(2).sum().backward()
        outs.append(out.detach())
    collection.drop_prefetched()
    return outs


def _matches_in_memory(rank: int, world: int, root: str) -> None:
    for optimizer, tier, fixed, prefetch in [
        (lambda: RowWiseAdagrad(lr=0.1), "disk", "rw", True),
        (lambda: Adagrad(lr=0.1), "host", "tw", False),
    ]:
        path = Path(root) / f"{tier}-{fixed}"
        sharded = tiered(optimizer(), tier, path, world, fixed)
        reference = in_memory(optimizer(), world, fixed)
        assert sharded.caches and (tier != "disk" or (path / f"rank{rank}").is_dir())
        got = train(sharded, rank, world, range(12), prefetch)
        want = train(reference, rank, world, range(12), False)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"{tier} {fixed}: step {step} differs"
        stats = sharded.tiered_stats()  # summed over the ranks
        assert stats["f"]["evicted"] > 0 and stats["f"]["written_back"] > 0
        if fixed != "rw":
            continue
        # The tiered rows saved by part load under another plan (and the in-memory tables'
        # state_dict), and training goes on as the reference does.
        checkpoint = Path(root) / "checkpoint"
        if rank == 0:
            checkpoint.mkdir()
        dist.barrier()
        sharded.tiered_files().save(checkpoint)
        state = sharded.state_dict()
        dist.barrier()
        names = sorted(p.name for p in checkpoint.iterdir())
        assert "tiered.f.part1of2.rows" in names and "tiered.k.part0of2.keys" in names
        other = tiered(optimizer(), tier, Path(root) / "other", world, "tw")
        other.load_state_dict(state)
        other.tiered_files().load(checkpoint)
        got = train(other, rank, world, range(12, 15), True)
        want = train(reference, rank, world, range(12, 15), False)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        if rank == 0:  # one process reads every part
            whole = tiered(optimizer(), "host", Path(root), 1, "", device="cpu")
            whole.tiered_files().load(checkpoint)
            for name in ("f", "k"):  # every row of every part, negative keys too
                loaded = sum(len(k) for k, _ in whole.caches[name].store.items(1 << 10))
                headers = checkpoint.glob(f"tiered.{name}.part*of2.json")
                saved = sum(json.loads(h.read_text())["rows"] for h in headers)
                assert loaded == saved > 0
        dist.barrier()


def test_tiered_shards_match_in_memory_shards_and_checkpoints_load_on_another_plan(tmp_path):
    run_ranks(2, _matches_in_memory, str(tmp_path))


def test_tiered_tables_refuse_a_sharding_that_splits_their_rows_by_column():
    bad = {**plan(2, "tw"), "g": P.column_wise(300, 6, [0, 1])}
    with pytest.raises(ValueError, match="'g' is tiered .* COLUMN_WISE"):
        checked_plan(configs(), bad, 2, Adagrad(lr=0.1), {"k"}, {"f", "g", "k"})
