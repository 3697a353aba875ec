"""ShardedEmbeddingBagCollection on 2 and 4 gloo ranks against the unsharded collection run on
the concatenated batch in one process: forward outputs, and after several steps with the fused
optimizer (or dense gradients and a torch optimizer) the gathered tables and optimizer states.
Each test spawns its ranks once and runs every case inside them."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from recsys.data.batch import Batch
from recsys.distributed import planner as P
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from recsys.embedding.row_init import initial_rows, table_seed
from tests.distributed.spawn import run_ranks

# name, dim, rows, features, pooling: odd dims, a 3-row table (fewer rows than 4 ranks), a
# table shared by two features, mean pooling.
TABLES = [
    ("t0", 4, 10, ["a"], PoolingType.SUM),
    ("t1", 8, 13, ["b", "c"], PoolingType.MEAN),
    ("t2", 6, 7, ["d"], PoolingType.SUM),
    ("t3", 5, 3, ["e"], PoolingType.MEAN),
]
ROWS = {f: n for _, _, n, fs, _ in TABLES for f in fs}
FEATURES = ["a", "b", "c", "d", "e"]


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(fs), pooling=pool
        )
        for name, dim, rows, fs, pool in TABLES
    ]


def random_kjt(seed: int, batch_size: int, keys: list[str], weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys), batch_size), generator=g)
    values = torch.cat(
        [
            torch.randint(0, ROWS.get(k, 5), (int(n),), generator=g)
            for k, n in zip(keys, lengths.sum(1), strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1), weights=weights)


def rows_of(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    size = kjt.stride()
    return Batch(torch.zeros(size, 1), kjt, torch.zeros(size, 1)).slice(start, stop).sparse


def make_plan(kinds: list[str], world: int, tables=TABLES) -> dict[str, P.TableSharding]:
    """``tables`` (name, dim, rows, ...) placed by ``kinds`` in turn (tw: table i on rank
    i + 1 mod W; rw; cw: on ranks W - 1 and 0; dp)."""
    plan = {}
    for i, (name, dim, rows, *_) in enumerate(tables):
        kind = kinds[i % len(kinds)]
        if kind == "tw":
            plan[name] = P.table_wise(rows, dim, (i + 1) % world)
        elif kind == "rw":
            plan[name] = P.row_wise(rows, dim, world)
        elif kind == "cw":
            plan[name] = P.column_wise(rows, dim, [world - 1, 0])
        else:
            plan[name] = P.data_parallel(rows, dim, world)
    return plan


def assert_state_equal(sharded: ShardedEmbeddingBagCollection, reference, atol: float) -> None:
    """Every shard this rank holds (and every replicated table) equals the reference's rows and
    columns; the state_dict has the reference's keys and logical shapes."""
    expected = reference.state_dict()
    state = sharded.state_dict()
    assert set(state) == set(expected)
    for key, value in state.items():
        assert_entry_equal(key, value, expected[key], atol)


def assert_entry_equal(key: str, value, expected: torch.Tensor, atol: float) -> None:
    """One state entry equals the reference's: a ShardedTensor by its local shards, each at its
    offsets in the logical ``expected``."""
    if not isinstance(value, ShardedTensor):
        torch.testing.assert_close(value, expected, atol=atol, rtol=0, msg=key)
        return
    assert tuple(value.size()) == tuple(expected.shape), key
    for shard in value.local_shards():
        meta = shard.metadata
        where = tuple(
            slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes, strict=True)
        )
        torch.testing.assert_close(shard.tensor, expected[where], atol=atol, rtol=0, msg=key)


def train_and_compare(rank, world, kinds, make_optimizer, weighted, steps=3, batch=5):
    torch.manual_seed(0)
    unsharded = EmbeddingBagCollection(configs(), is_weighted=weighted, optimizer=make_optimizer())
    reference = EmbeddingBagCollection(configs(), is_weighted=weighted, optimizer=make_optimizer())
    reference.load_state_dict(unsharded.state_dict())
    sharded = ShardedEmbeddingBagCollection(unsharded, make_plan(kinds, world))
    fused = make_optimizer() is not None
    torch_optimizers = []
    if not fused:
        torch_optimizers = [
            torch.optim.SGD(sharded.trainable_parameters(), lr=0.5),
            torch.optim.SGD(reference.parameters(), lr=0.5),
        ]
    # Keys in another order than the tables', plus one the collection does not read.
    keys = ["e", "zz", "d", "c", "b", "a"]
    for step in range(steps):
        full = random_kjt(100 * step + 1, batch * world, keys, weighted)
        out = sharded(rows_of(full, rank * batch, (rank + 1) * batch))
        expected = reference(full)
        assert out.keys() == expected.keys()
        mine = expected.values()[rank * batch : (rank + 1) * batch]
        torch.testing.assert_close(out.values(), mine, atol=1e-6, rtol=1e-6)
        grad = torch.randn(expected.values().shape, generator=torch.Generator().manual_seed(step))
        # The mean over the global batch: each rank's own mean, averaged over ranks.
        (out.values() * grad[rank * batch : (rank + 1) * batch]).sum().div(batch).backward()
        (expected.values() * grad).sum().div(batch * world).backward()
        for optimizer in torch_optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_state_equal(sharded, reference, atol=1e-6)


def _sharding_cases(rank: int, world: int) -> None:
    for kinds in (["tw"], ["rw"], ["cw"], ["dp"], ["tw", "rw", "cw", "dp"], ["rw", "dp", "tw"]):
        train_and_compare(rank, world, kinds, lambda: Adagrad(lr=0.1), weighted=False)
    no_columns = ["rw", "tw", "dp"]
    train_and_compare(rank, world, no_columns, lambda: RowWiseAdagrad(lr=0.1), weighted=True)
    train_and_compare(rank, world, ["cw", "rw"], lambda: Adam(lr=0.05), weighted=True)
    train_and_compare(rank, world, ["tw", "cw", "rw"], lambda: SGD(lr=0.3), weighted=False)
    # Dense gradients and a torch optimizer (replicated tables need DDP: see test_parallel).
    train_and_compare(rank, world, ["tw", "cw", "rw"], lambda: None, weighted=False)


def test_every_sharding_type_matches_one_process_on_two_ranks():
    run_ranks(2, _sharding_cases)


def _four_rank_cases(rank: int, world: int) -> None:
    train_and_compare(rank, world, ["rw", "cw", "dp", "tw"], lambda: Adagrad(lr=0.1), False)
    train_and_compare(rank, world, ["rw"], lambda: RowWiseAdagrad(lr=0.1), True, steps=2)


def test_mixed_plan_matches_one_process_on_four_ranks():
    run_ranks(4, _four_rank_cases)


def _uneven_and_loading(rank: int, world: int) -> None:
    torch.manual_seed(1)
    unsharded = EmbeddingBagCollection(configs(), optimizer=Adagrad(lr=0.1))
    sharded = ShardedEmbeddingBagCollection(unsharded, make_plan(["tw", "rw", "cw", "dp"], world))
    # Ranks with different batch sizes, one of them empty.
    sizes = [3, 0, 7, 1][:world]
    full = random_kjt(7, sum(sizes), FEATURES, weighted=False)
    start = sum(sizes[:rank])
    with torch.no_grad():
        out = sharded(rows_of(full, start, start + sizes[rank])).values()
        expected = unsharded(full).values()[start : start + sizes[rank]]
    assert out.shape == (sizes[rank], expected.shape[1])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    # Loading the unsharded state into another sharding reproduces the collection.
    fresh = ShardedEmbeddingBagCollection(
        EmbeddingBagCollection(configs(), optimizer=Adagrad(lr=0.1)),
        make_plan(["rw", "cw", "dp", "tw"], world),
    )
    missing, unexpected = fresh.load_state_dict(unsharded.state_dict())
    assert not missing and not unexpected
    assert_state_equal(fresh, unsharded, atol=0)
    # From the meta device: shards initialized in place, replicas equal on every rank.
    torch.manual_seed(rank)  # different RNG streams must not make replicas differ
    meta = EmbeddingBagCollection(configs(), device="meta", optimizer=Adagrad(lr=0.1))
    plan = make_plan(["tw", "rw", "cw", "dp"], world)
    built = ShardedEmbeddingBagCollection(meta, plan, device=torch.device("cpu"))
    replica = built.state_dict()["embedding_bags.t3.weight"].clone()  # t3 is DATA_PARALLEL
    gathered = [torch.empty_like(replica) for _ in range(world)]
    torch.distributed.all_gather(gathered, replica)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    # Each shard holds its block of the table's initial rows, a function of (seed, table,
    # row): t0 is TABLE_WISE, t1 (13 rows) ROW_WISE, t2 COLUMN_WISE; the bound is TorchRec's
    # default init's, sqrt(1 / rows).
    for name, rows, dim in [("t1", 13, 8), ("t0", 10, 4), ("t2", 7, 6)]:
        if built.local_table(name) is None:
            continue
        shard = built.local_shard(name)
        keys = torch.arange(shard.row_offset, shard.row_offset + shard.num_rows)
        full = initial_rows(keys, table_seed(0, name), dim, (1 / rows) ** 0.5)
        columns = slice(shard.col_offset, shard.col_offset + shard.num_cols)
        assert torch.equal(built.local_table(name).weight, full[:, columns]), name
    # Bad input names the problem on the sending rank.
    bad = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.tensor([0, 0, 0, 0, 99]),
        lengths=torch.ones(5, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="id 99 is out of range"):
        sharded(bad)
    with pytest.raises(ValueError, match="missing features"):
        sharded(random_kjt(0, 2, ["a", "b"], weighted=False))


def test_uneven_batches_bad_input_and_loading_another_plan():
    run_ranks(2, _uneven_and_loading)


def _quantized(rank: int, world: int) -> None:
    torch.manual_seed(2)
    unsharded = EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.5))
    plan = make_plan(["tw", "cw", "dp"], world)
    exact = ShardedEmbeddingBagCollection(unsharded, plan)
    full = random_kjt(3, 8 * world, FEATURES, weighted=False)
    mine = rows_of(full, 8 * rank, 8 * (rank + 1))
    reference = exact(mine).values().detach()
    scale = reference.abs().amax(dim=1, keepdim=True)  # >= every row's max of the sample
    for precision, bound in [("fp16", 2**-11), ("bf16", 2**-8), ("int8", 1 / 254)]:
        quantized = ShardedEmbeddingBagCollection(
            unsharded, plan, forward_precision=precision, backward_precision=precision
        )
        out = quantized(mine)
        err = (out.values() - reference).abs()
        assert (err <= scale * bound * (1 + 1e-5) + 1e-7).all(), (precision, err.max())
        assert err.max() > 0  # it really was quantized
        sent = quantized.comm_stats.bytes["forward"]
        assert sent < exact.comm_stats.bytes["forward"]
        out.values().sum().backward()
        assert quantized.comm_stats.bytes["backward"] > 0


def test_quantized_comms_stay_within_their_error_bound():
    run_ranks(2, _quantized)


def test_plans_that_do_not_match_the_collection_are_rejected():
    tables = configs()
    with pytest.raises(ValueError, match="not a ROW_WISE placement"):
        bad = P.TableSharding(
            P.ShardingType.ROW_WISE, (P.Shard(0, 0, 5, 0, 4), P.Shard(1, 5, 5, 0, 4))
        )
        P.check_table_sharding(tables[0], bad, 3)
    with pytest.raises(ValueError, match="distinct ranks"):
        P.check_table_sharding(tables[0], P.column_wise(10, 4, [1, 1]), 2)


def _nccl(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    torch.manual_seed(3)
    unsharded = EmbeddingBagCollection(configs(), device=device, optimizer=Adagrad(lr=0.1))
    reference = EmbeddingBagCollection(configs(), device=device, optimizer=Adagrad(lr=0.1))
    reference.load_state_dict(unsharded.state_dict())
    # column shards need distinct ranks: one GPU gets the other three kinds
    kinds = ["tw", "rw", "cw", "dp"] if world > 1 else ["tw", "rw", "dp"]
    sharded = ShardedEmbeddingBagCollection(unsharded, make_plan(kinds, world))
    for step in range(3):
        full = random_kjt(step, 16 * world, FEATURES, weighted=False).to(device)
        out = sharded(rows_of(full.to(torch.device("cpu")), 16 * rank, 16 * (rank + 1)).to(device))
        expected = reference(full).values()
        mine = expected[16 * rank : 16 * (rank + 1)]
        torch.testing.assert_close(out.values(), mine, atol=1e-5, rtol=1e-5)
        out.values().sum().div(16).backward()
        expected.sum().div(16 * world).backward()
    assert_state_equal(sharded, reference, atol=1e-5)


@pytest.mark.gpu
def test_nccl_path_on_the_gpus_there_are():
    run_ranks(min(torch.cuda.device_count(), 2), _nccl, backend="nccl")
