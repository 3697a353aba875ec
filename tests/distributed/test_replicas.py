"""2D sparse parallelism on 4 gloo ranks (2 groups of 2): with SGD and a sync every step the
tables train as the flat plan does (the unsharded collection on the global batch), with
row-wise Adagrad as documented (each group's update from its own mean gradient, then weights
and state averaged), and checkpoints move between 2D and flat plans; and ``recsys train`` with
``distributed.sparse_replicas`` under torchrun."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recsys.distributed.replicas import _buckets, replica_groups, replica_tensors, sync_replicas
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import SGD, RowWiseAdagrad
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics
from tests.distributed.spawn import run_ranks
from tests.distributed.test_sharded import (
    FEATURES,
    assert_state_equal,
    configs,
    make_plan,
    random_kjt,
    rows_of,
)
from tests.distributed.test_torchrun import OVERRIDES, run_torchrun

BATCH, STEPS = 4, 3


def two_d(unsharded: EmbeddingBagCollection, kinds: list[str]):
    groups = replica_groups(2)
    sharded = ShardedEmbeddingBagCollection(
        unsharded, make_plan(kinds, 2), process_group=groups.shard_group
    )
    sharded.replica_groups = groups
    return sharded


def step(sharded, rank: int, world: int, seed: int) -> None:
    """One step of this rank's rows of a global batch: the mean loss over the global batch,
    each rank's own mean scaled by the collection (1 / group size)."""
    full = random_kjt(seed, BATCH * world, FEATURES, weighted=False)
    out = sharded(rows_of(full, rank * BATCH, (rank + 1) * BATCH))
    grad = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(seed + rank))
    (out.values() * grad).sum().div(BATCH).backward()
    sync_replicas([sharded])


def reference_step(collections, world: int, seed: int, groups: int) -> None:
    """The same step on unsharded collections: one per group, each on its group's rows with
    its group's mean; then their weights and state averaged (one collection: the flat plan)."""
    full = random_kjt(seed, BATCH * world, FEATURES, weighted=False)
    size = world // groups
    for g, collection in enumerate(collections):
        rows = rows_of(full, g * size * BATCH, (g + 1) * size * BATCH)
        out = collection(rows)
        grad = torch.cat(
            [
                torch.randn(
                    BATCH, out.values().shape[1], generator=torch.Generator().manual_seed(seed + r)
                )
                for r in range(g * size, (g + 1) * size)
            ]
        )
        (out.values() * grad).sum().div(BATCH * size).backward()
    if len(collections) > 1:
        with torch.no_grad():
            states = [c.state_dict() for c in collections]
            for key, value in states[0].items():
                if value.is_floating_point():
                    value.copy_(sum(s[key] for s in states) / len(states))
            for collection in collections[1:]:
                collection.load_state_dict(collections[0].state_dict())


def _cases(rank: int, world: int, directory: str) -> None:
    kinds = ["tw", "rw", "cw", "dp"]
    # SGD, synced every step: the flat plan's tables.
    torch.manual_seed(0)
    unsharded = EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.5))
    reference = EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.5))
    reference.load_state_dict(unsharded.state_dict())
    sharded = two_d(unsharded, kinds)
    for s in range(STEPS):
        step(sharded, rank, world, 10 * s + 1)
        reference_step([reference], world, 10 * s + 1, groups=1)
    assert_state_equal(sharded, reference, atol=1e-5)

    # The checkpoint of the 2D run loads into a flat plan on 4 ranks, and back.
    dcp.save(sharded.state_dict(), checkpoint_id=f"{directory}/two_d")
    flat = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.5)), make_plan(kinds, world)
    )
    state = flat.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/two_d")
    flat.load_state_dict(state)
    assert_state_equal(flat, reference, atol=1e-5)
    dcp.save(flat.state_dict(), checkpoint_id=f"{directory}/flat")
    again = two_d(EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.5)), kinds)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=f"{directory}/flat")
    again.load_state_dict(state)
    assert_state_equal(again, reference, atol=1e-5)

    # Row-wise Adagrad (no column-wise: its per-row state cannot be split): each group
    # updates from its own mean gradient, then the replicas average weights and state.
    kinds = ["tw", "rw", "dp"]
    torch.manual_seed(1)
    unsharded = EmbeddingBagCollection(configs(), optimizer=RowWiseAdagrad(lr=0.3))
    groups = [EmbeddingBagCollection(configs(), optimizer=RowWiseAdagrad(lr=0.3)) for _ in "ab"]
    for group in groups:
        group.load_state_dict(unsharded.state_dict())
    sharded = two_d(unsharded, kinds)
    for s in range(STEPS):
        step(sharded, rank, world, 10 * s + 2)
        reference_step(groups, world, 10 * s + 2, groups=2)
    assert_state_equal(sharded, groups[0], atol=1e-5)

    # Packed into buffers or each tensor alone: bitwise the same average (two replicas), timed
    # as the collection's collectives.
    tensors = replica_tensors(sharded)
    with torch.no_grad():
        for k, tensor in enumerate(tensors):  # every rank's own values
            tensor.add_(
                torch.randn(tensor.shape, generator=torch.Generator().manual_seed(k + rank))
            )
    before = [t.clone() for t in tensors]
    sync_replicas([sharded], bucket_bytes=1)  # one all-reduce per tensor
    alone = [t.clone() for t in tensors]
    with torch.no_grad():
        for tensor, value in zip(tensors, before, strict=True):
            tensor.copy_(value)
    seconds = sharded.comm_stats.seconds
    sync_replicas([sharded])  # all in one buffer
    assert sharded.comm_stats.seconds > seconds
    for tensor, expected in zip(tensors, alone, strict=True):
        assert torch.equal(tensor, expected)
    assert not all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_two_d_trains_like_the_flat_plan_and_checkpoints_move_between_them(tmp_path):
    run_ranks(4, _cases, str(tmp_path))


def test_replica_buckets_pack_small_tensors_by_dtype_in_order_and_leave_large_ones_alone():
    a, b, c = (torch.zeros(4) for _ in range(3))  # 16 bytes each
    half = torch.zeros(4, dtype=torch.float16)  # 8 bytes
    large = torch.zeros(16)  # 64 bytes
    buckets = _buckets([a, half, b, large, c], bucket_bytes=40)
    assert [[id(t) for t in bucket] for bucket in buckets] == [
        [id(large)],
        [id(a), id(b)],
        [id(c)],
        [id(half)],
    ]
    assert _buckets([a, b], bucket_bytes=1) == [[a], [b]]


@pytest.mark.slow  # two 4-rank torchrun jobs: about a minute on 2 cores
def test_recsys_train_with_sparse_replicas_under_torchrun(tmp_path):
    """4 ranks, 2 replicas of 2, SGD tables synced every step: the flat run's losses (up to
    float rounding); the 2D checkpoint evaluates in one process to the run's test metrics."""
    overrides = [*OVERRIDES, "--train.embedding_optimizer=sgd", "--train.embedding_lr=0.1"]
    losses = {}
    for replicas in (1, 2):
        run_dir = tmp_path / f"r{replicas}"
        done = run_torchrun(
            ["--nproc-per-node=4", "-m", "recsys", "train", f"--run.dir={run_dir}", *overrides,
             f"--distributed.sparse_replicas={replicas}"],
            timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"ShardingPlan for {4 // replicas} ranks" in done.stdout
        events = read_metrics(run_dir / "metrics.jsonl")
        losses[replicas] = [e["loss"] for e in events if e["split"] == "train"]
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-4, atol=0)
    (test,) = [e for e in read_metrics(tmp_path / "r2" / "metrics.jsonl") if e["split"] == "test"]
    result = evaluate_checkpoint(tmp_path / "r2", [])
    assert abs(result.metrics["auc"] - test["auc"]) < 1e-6
