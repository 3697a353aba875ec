"""Replicated (DATA_PARALLEL) tables with a fused optimizer on 2 gloo ranks: the sparse exchange
of touched rows gives bitwise the update of summing dense table gradients with an all-reduce
(what the replicated tables did before), sends fewer bytes than that all-reduce when a batch
touches few rows, and costs a fixed handful of host reads and ops whatever the table count."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import recsys.ops.embedding_bag.pooled as embedding_bag_module
from recsys.distributed import planner as P
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import Adagrad, Adam, RowWiseAdagrad
from recsys.ops.embedding_bag.layout import rounding_seed
from recsys.ops.embedding_bag.row_update import update_rows
from recsys.train.step_audit import StepAudit
from tests.distributed.spawn import run_ranks

# Two dims (two dim groups in the packed buffer), sum and mean pooling, a shared table.
TABLES = [
    ("t0", 4, 50, ["a"], PoolingType.SUM),
    ("t1", 8, 30, ["b", "c"], PoolingType.MEAN),
    ("t2", 4, 7, ["d"], PoolingType.SUM),
    ("t3", 8, 400, ["e"], PoolingType.SUM),
]
FEATURES = ["a", "b", "c", "d", "e"]
ROWS = {f: n for _, _, n, fs, _ in TABLES for f in fs}


def configs(tables=TABLES) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(fs), pooling=pool
        )
        for name, dim, rows, fs, pool in tables
    ]


def batch(seed: int, size: int, weighted: bool, rows=ROWS) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = list(rows)
    lengths = torch.randint(0, 4, (len(keys), size), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(n),), generator=g)
            for k, n in zip(keys, lengths.sum(1), strict=True)
        ]
    )
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1), weights=weights)


def dense_reference_step(reference, states, optimizer, kjt, upstream, step, world) -> None:
    """The dense path: every rank's dense table gradients and which rows it touched, summed by
    one all-reduce, averaged; then each table's touched rows updated."""
    out = reference(kjt).values()
    (out * upstream).sum().backward()
    names = [c.name for c in reference.embedding_bag_configs()]
    weights = [reference.embedding_bags[n].weight for n in names]
    touched = []
    per_feature = dict(zip(kjt.keys(), kjt.values().split(kjt.length_per_key()), strict=True))
    for c in reference.embedding_bag_configs():
        ids = torch.cat([per_feature[f] for f in c.feature_names]).long()
        touched.append(torch.zeros(c.num_embeddings).index_fill_(0, ids, 1.0))
    packed = torch.cat([w.grad.reshape(-1) for w in weights] + touched)
    dist.all_reduce(packed)
    pieces = packed.split([w.numel() for w in weights] + [t.numel() for t in touched])
    generator = torch.Generator().manual_seed(rounding_seed(step))
    with torch.no_grad():
        for t, (name, weight) in enumerate(zip(names, weights, strict=True)):
            grad = pieces[t].view_as(weight) / world
            rows = (pieces[len(names) + t] > 0).nonzero().squeeze(1)
            update_rows(optimizer, weight, states[name], rows, grad[rows], step, generator)
            weight.grad = None


def _bitwise_body(rank: int, world: int, sharded_table: bool = False) -> None:
    """``sharded_table``: with a TABLE_WISE table too, so the input dist runs and the
    replicated tables' touched rows are counted ahead and travel with its counts."""
    extra = [("t4", 4, 20, ["f"], PoolingType.SUM)] if sharded_table else []
    rows = {**ROWS, "f": 20} if sharded_table else ROWS
    for case, (make, weighted) in enumerate(
        (
            (lambda: Adagrad(lr=0.1), False),
            (lambda: RowWiseAdagrad(lr=0.1), True),
            (lambda: Adam(lr=0.05), True),
        )
    ):
        # Updates in chunks of 3 rows of the widest dim, then whole: the same either way.
        embedding_bag_module.CHUNK_BYTES = 3 * 8 * 4 if case < 2 else 1 << 20
        torch.manual_seed(0)
        unsharded = EmbeddingBagCollection(
            configs(TABLES + extra), is_weighted=weighted, optimizer=make()
        )
        plan = {n: P.data_parallel(r, d, world) for n, d, r, _, _ in TABLES}
        plan.update({n: P.table_wise(r, d, 0) for n, d, r, _, _ in extra})
        sharded = ShardedEmbeddingBagCollection(unsharded, plan)
        reference = EmbeddingBagCollection(configs(), is_weighted=weighted)
        optimizer = make()
        states = {}
        for c in configs():
            reference.embedding_bags[c.name].weight.data.copy_(
                unsharded.embedding_bags[c.name].weight
            )
            states[c.name] = {
                n: unsharded.embedding_bags[c.name].get_buffer(n).clone() for n in optimizer.states
            }
        for step in range(1, 4):
            kjt = batch(10 * step + rank, 6, weighted, rows)
            if sharded_table:  # as the loader's batches: the ids per key known on the host
                kjt = KeyedJaggedTensor(
                    keys=kjt.keys(),
                    values=kjt.values(),
                    lengths=kjt.lengths(),
                    weights=kjt.weights_or_none(),
                    length_per_key=kjt.lengths().view(len(rows), -1).sum(dim=1).tolist(),
                )
            upstream = torch.randn(
                6, 4 + 8 + 8 + 4 + 8 + 4 * len(extra), generator=torch.Generator().manual_seed(step)
            )
            with StepAudit() as report:
                (sharded(kjt).values() * upstream).sum().backward()
            if sharded_table and step > 1:  # the rows' counts and union came with the counts
                reads = [(op, site.split(":")[0]) for op, site in report.syncs]
                assert reads.count(("tolist", "recsys/distributed/counts.py")) == 1, reads
                files = {file for _, file in reads}
                assert "recsys/distributed/replicated.py" not in files, report.describe()
                assert (
                    "recsys/ops/embedding_bag/row_update.py" not in files
                ), report.describe()  # 2 dim groups
            upstream = upstream[:, : 4 + 8 + 8 + 4 + 8]
            dense_reference_step(reference, states, optimizer, kjt, upstream, step, world)
        for c in configs():
            name = c.name
            assert torch.equal(
                sharded.replicated.weight(name), reference.embedding_bags[name].weight
            ), (type(optimizer).__name__, name)
            for n, state in sharded.replicated.optimizer_state(name).items():
                assert torch.equal(state, states[name][n]), (type(optimizer).__name__, name, n)
        assert int(sharded.optimizer_step()) == 3


def test_sparse_exchange_is_bitwise_the_dense_all_reduce():
    run_ranks(2, _bitwise_body)


def test_rows_counted_ahead_travel_with_the_input_dist_counts_and_change_no_bit():
    run_ranks(2, _bitwise_body, True)


def _cost_body(rank: int, world: int) -> None:
    # 12 tables of 1000 x 16; a batch of 8 one-hot samples touches at most 16 rows of each.
    tables = [(f"t{i}", 16, 1000, [f"f{i}"], PoolingType.SUM) for i in range(12)]
    rows = {f"f{i}": 1000 for i in range(12)}
    torch.manual_seed(0)
    unsharded = EmbeddingBagCollection(configs(tables), optimizer=Adagrad(lr=0.1))
    plan = {n: P.data_parallel(r, d, world) for n, d, r, _, _ in tables}
    sharded = ShardedEmbeddingBagCollection(unsharded, plan)
    upstream = torch.randn(8, 12 * 16)
    for step in range(3):
        kjt = batch(step * 2 + rank, 8, False, rows)
        sharded.comm_stats.reset()
        with StepAudit() as report:
            (sharded(kjt).values() * upstream).sum().backward()
        dense = sum(n * d * 4 for _, d, n, _, _ in tables)
        sent = sum(sharded.comm_stats.bytes.values())
        assert 0 < sent < dense / 10, (sent, dense)
        replicated = [s for s in report.syncs if "replicated.py" in s[1] or s[0] == "nonzero"]
        assert len(replicated) <= 1, report.describe()  # the ranks' row counts, nothing per table
        assert report.num_ops < 150, report.describe()


def test_exchange_sends_touched_rows_with_a_fixed_cost_per_step():
    run_ranks(2, _cost_body)
